"""The shim's side of a top-up (docs/prediction.md#admission): a charge past a grant by
prediction asks through the ledger and waits for the limit, against a ledger this test
writes as nodemgr would, with the C client in a child process (and the sanitizer builds
in make test's sanitizer tier). nodemgr's side: tests/daemon/test_admission.py."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodemgr.host.ledger import Ledger
from tests.shim.test_attach import NODE, TASK, environment

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    """A grant by prediction on GPU 0: 256 MiB granted, up to 1 GiB on request."""
    led = Ledger.create(tmp_path / "ledger", [g.uuid_bytes for g in NODE])
    led.set_limit(0, 256 * MiB)
    led.set_topup(0, GiB)
    led.task_add(TASK)
    yield led
    led.close()


def start(cbin: dict[str, Path], ledger: Ledger, *steps: str) -> subprocess.Popen[str]:
    env = environment(GPUSHARE_LEDGER=str(ledger.path), GPUSHARE_TASK_ID=TASK)
    return subprocess.Popen(
        [str(cbin["client"]), *steps],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def asked(ledger: Ledger, timeout: float = 30.0) -> int:
    """Wait for the client's ask; what it asked for."""
    deadline = time.monotonic() + timeout
    while (wanted := ledger.wanted(0)) == 0:
        assert time.monotonic() < deadline, "the client never asked for a top-up"
        time.sleep(0.005)
    return wanted


def waiting(
    cbin: dict[str, Path], ledger: Ledger, *steps: str
) -> tuple[subprocess.Popen[str], int]:
    """The client started with an hour's wait for a top-up (only an answer lets it on
    before the test's timeout), once it has asked; and what it asked for."""
    ledger.set_topup_wait(3600)
    p = start(cbin, ledger, *steps)
    return p, asked(ledger)


def finish(p: subprocess.Popen[str]) -> list[str]:
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err  # a sanitizer's report fails here too
    return out.split()


def test_a_charge_past_the_grant_waits_and_goes_through_once_topped_up(
    cbin: dict[str, Path], ledger: Ledger
) -> None:
    p, ask = waiting(cbin, ledger, "alloc", "128", "alloc", "384", "info")
    # It asks for the count it needs: 128 MiB held and 384 MiB more.
    assert ask == 512 * MiB
    ledger.set_limit(0, 600 * MiB)
    ledger.answer(0, 512 * MiB)
    out = finish(p)
    assert out[:4] == ["alloc", "ok", "alloc", "ok"]
    assert ledger.wanted(0) == 0


def test_an_answer_without_a_new_limit_refuses_at_once(
    cbin: dict[str, Path], ledger: Ledger
) -> None:
    p, ask = waiting(cbin, ledger, "alloc", "384")
    # A refusal leaves no top-up to ask for: nodemgr sets the top-up limit down first.
    ledger.set_topup(0, 0)
    ledger.answer(0, ask)
    assert finish(p)[:3] == ["alloc", "err", "2"]  # CUDA_ERROR_OUT_OF_MEMORY


def test_an_answer_to_an_older_ask_leaves_a_newer_one_standing(
    cbin: dict[str, Path], ledger: Ledger
) -> None:
    p, ask = waiting(cbin, ledger, "alloc", "384")
    ledger.answer(0, ask - 1)  # not the ask that stands: nothing answered
    assert ledger.wanted(0) == ask
    ledger.set_limit(0, GiB)
    ledger.answer(0, ask)
    assert finish(p)[:2] == ["alloc", "ok"]


def test_a_wait_that_runs_out_refuses_and_withdraws_the_ask(
    cbin: dict[str, Path], ledger: Ledger
) -> None:
    ledger.set_topup_wait(0.2)
    p = start(cbin, ledger, "alloc", "384")
    assert finish(p)[:3] == ["alloc", "err", "2"]
    # Withdrawn: nodemgr holds nothing back for it.
    assert ledger.wanted(0) == 0


@pytest.mark.parametrize("wait", [0.0, 3600.0])
def test_no_wait_past_the_top_up_limit_or_without_a_wait(
    cbin: dict[str, Path], ledger: Ledger, wait: float
) -> None:
    """Past the top-up limit (1 GiB) no top-up can help; with no wait set none is
    asked for: either way refused at once, nothing asked."""
    ledger.set_topup_wait(wait)
    steps = ("alloc", "2048") if wait else ("alloc", "384")
    assert finish(start(cbin, ledger, *steps))[:3] == ["alloc", "err", "2"]
    assert ledger.wanted(0) == 0
