"""The progress lines of a wait whose stderr is not a terminal, as in a batch job's log (a
real daemon, real gpushare-run)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.client.conftest import gpushare_run
from tests.conftest import BIN, Holder


def test_a_wait_without_a_terminal_says_where_it_is_every_interval(
    node: Any, run_task: Any, tmp_path: Path, wait_for: Any
) -> None:
    a, b = Holder(node.env("a")), Holder(node.env("b"))
    log = tmp_path / "stderr"
    with log.open("w") as err:
        p = subprocess.Popen(
            [str(BIN / "gpushare-run"), "--endpoint", node.env("c"), "true"],
            stderr=err,
            env={**os.environ, "GPUSHARE_PROGRESS_INTERVAL": "1"},
        )
    line = "gpushare-run: waiting for 1 GPU: position 1 of 1, waited "

    def said() -> list[str]:
        return [x for x in log.read_text().splitlines() if x.startswith(line)]

    # The first line when it is queued, then one at least every second though nothing
    # changes; each says why it waits.
    wait_for(lambda: len(said()) >= 1, 10)
    started = time.monotonic()
    wait_for(lambda: len(said()) >= 4, 10)
    assert time.monotonic() - started < 8
    for x in said():
        assert x.endswith("wait for other tasks to end)"), x
    assert log.read_text().startswith("gpushare-run: no GPUs free now: 1 GPU needed")

    # A new reason (a GPU drained) is said at once, with the position unchanged.
    node.admin("drain", gpu=0, drained=True)
    wait_for(lambda: "drained by an admin)\n" in log.read_text(), 10)
    lines = log.read_text().splitlines()
    changed = [x for x in lines if x.startswith("gpushare-run: still waiting: ")]
    assert len(changed) == 1 and "GPU 0 drained by an admin" in changed[0], lines
    wait_for(lambda: said()[-1].endswith("drained by an admin))"), 10)
    node.admin("drain", gpu=0, drained=False)
    a.close()
    assert p.wait(30) == 0
    b.close()
    assert "granted after waiting" in log.read_text()


def test_progress_interval_must_be_seconds(node: Any) -> None:
    r = gpushare_run(
        "--endpoint", node.env("c"), "true", env={"GPUSHARE_PROGRESS_INTERVAL": "soon"}
    )
    assert r.returncode == 2 and "GPUSHARE_PROGRESS_INTERVAL" in r.stderr
