"""gpushare-run's settings: options, GPUSHARE_* variables, waiting, CPU fallback, nesting."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.client.conftest import gpushare_run
from tests.conftest import BIN, Holder

GiB = 1 << 30
SHOW = (
    "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), "
    "os.environ.get('GPUSHARE_TASK_ID'), os.environ.get('GPUSHARE_TASK_OWNER'))"
)


def test_settings_come_from_the_environment(node: Any) -> None:
    ep = node.env("alice", gpus=2, memory=GiB)
    r = gpushare_run(
        sys.executable, "-c", SHOW, env={"GPUSHARE_ENDPOINT": ep, "GPUSHARE_GPUS": "2"}
    )
    assert r.returncode == 0, r.stderr
    visible, task_id, owner = r.stdout.split()
    assert len(visible.strip("'").split(",")) == 2
    assert len(task_id) == 16 and int(owner) > 0
    # An option beats its variable.
    r = gpushare_run(
        "--gpus",
        "1",
        sys.executable,
        "-c",
        SHOW,
        env={"GPUSHARE_ENDPOINT": ep, "GPUSHARE_GPUS": "2"},
    )
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()[0].strip("'").split(",")) == 1
    # The memory hint from the environment is checked like --memory.
    r = gpushare_run("true", env={"GPUSHARE_ENDPOINT": ep, "GPUSHARE_MEMORY": "2GiB"})
    assert r.returncode == 77
    assert "memory quota" in r.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("GPUSHARE_GPUS", "two"),
        ("GPUSHARE_GPUS", "0"),
        ("GPUSHARE_WAIT", "maybe"),
        ("GPUSHARE_WAIT_TIMEOUT", "-1"),
        ("GPUSHARE_MEMORY", "lots"),
        ("GPUSHARE_CPU_FALLBACK", "2"),
        ("GPUSHARE_GRACE", "soon"),
        ("GPUSHARE_COMPUTE", "0"),
        ("GPUSHARE_COMPUTE", "half"),
    ],
)
def test_a_bad_variable_is_a_usage_error_naming_it(node: Any, name: str, value: str) -> None:
    ep = node.env("alice")
    r = gpushare_run("true", env={"GPUSHARE_ENDPOINT": ep, name: value})
    assert r.returncode == 2
    assert name in r.stderr
    assert node.tasks() == []


def test_help_shows_examples_and_exit_codes() -> None:
    r = gpushare_run("--help")
    assert r.returncode == 0
    for text in (
        "Examples:",
        "--wait / --no-wait",
        "--wait-timeout",
        "--cpu-fallback",
        "GPUSHARE_WAIT_TIMEOUT",
        "75 no GPUs free",
    ):
        assert text in r.stdout


def test_version_is_nodemgrs() -> None:
    r = gpushare_run("--version")
    assert r.returncode == 0, r.stderr
    nodemgr = subprocess.run(
        [str(BIN / "nodemgr"), "--version"], capture_output=True, text=True, timeout=30
    )
    assert nodemgr.returncode == 0
    version = nodemgr.stdout.split()[-1]
    assert r.stdout == f"gpushare-run, version {version}\n"


def test_waits_by_default_until_gpus_come_free(node: Any, wait_for: Any) -> None:
    a, b = Holder(node.env("a")), Holder(node.env("b"))
    p = subprocess.Popen(
        [str(BIN / "gpushare-run"), "--endpoint", node.env("c"), "true"],
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: len(node.admin("queue")["waiting"]) == 1, 10)
    a.close()
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert "no GPUs free now" in err
    assert "waiting for 1 GPU: position 1 of 1, waited 0s" in err
    assert "granted after waiting" in err
    b.close()


def test_wait_timeout_gives_up_with_75(node: Any) -> None:
    a, b = Holder(node.env("a")), Holder(node.env("b"))
    start = time.monotonic()
    r = gpushare_run("--endpoint", node.env("c"), "--wait-timeout", "1", "true")
    took = time.monotonic() - start
    assert r.returncode == 75, r.stderr
    assert 1.0 <= took < 10
    assert "--wait-timeout" in r.stderr  # the refusal names what to change
    r = gpushare_run(
        "true", env={"GPUSHARE_ENDPOINT": node.env("c"), "GPUSHARE_WAIT_TIMEOUT": "0.5"}
    )
    assert r.returncode == 75
    assert node.admin("queue")["waiting"] == []
    a.close()
    b.close()


def test_progress_is_redrawn_in_place_on_a_terminal(node: Any, wait_for: Any) -> None:
    a, b = Holder(node.env("a")), Holder(node.env("b"))
    master, slave = pty.openpty()
    p = subprocess.Popen(
        [str(BIN / "gpushare-run"), "--endpoint", node.env("c"), "--wait-timeout", "2.5", "true"],
        stderr=slave,
    )
    os.close(slave)
    assert p.wait(30) == 75
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    text = out.decode()
    # Each redraw returns to the line's start and clears its rest; the seconds count up.
    assert text.count("\r") >= 3
    assert "\x1b[K" in text
    assert "waited 1s" in text and "waited 2s" in text
    a.close()
    b.close()


def test_cpu_fallback_runs_the_command_without_a_gpu(node: Any) -> None:
    zero = node.env("zero", gpus=0)
    r = gpushare_run("--endpoint", zero, "--cpu-fallback", sys.executable, "-c", SHOW)
    assert r.returncode == 0, r.stderr
    visible, task_id, owner = r.stdout.split()
    assert visible == "''" and task_id == "None" and int(owner) > 0
    assert "running without a GPU (quota_zero)" in r.stderr
    # Without the flag, a zero quota is refused and the fix is named.
    r = gpushare_run("--endpoint", zero, "true")
    assert r.returncode == 77
    assert "--cpu-fallback" in r.stderr
    # Nothing free and no waiting: the same fallback, from the variable, exit code the command's.
    a, b = Holder(node.env("a")), Holder(node.env("b"))
    r = gpushare_run(
        "--endpoint",
        node.env("c"),
        "--no-wait",
        "sh",
        "-c",
        'test -z "$CUDA_VISIBLE_DEVICES" && exit 4',
        env={"GPUSHARE_CPU_FALLBACK": "1"},
    )
    assert r.returncode == 4, r.stderr
    assert "running without a GPU (no_resources)" in r.stderr
    assert [t["env"] for t in node.tasks()] == ["a", "b"]
    a.close()
    b.close()


def test_a_nested_gpushare_run_shares_the_enclosing_grant(node: Any) -> None:
    ep = node.env("alice", gpus=1)
    inner = f'{BIN / "gpushare-run"} --endpoint {ep} -- {sys.executable} -c "{SHOW}"'
    r = gpushare_run(
        "--endpoint",
        ep,
        "sh",
        "-c",
        f"echo $GPUSHARE_TASK_ID; {inner}; echo tasks",
    )
    assert r.returncode == 0, r.stderr
    outer_id, _visible, inner_id, _owner, _ = r.stdout.split()
    assert inner_id == outer_id
    [rec] = node.admin("history", env="alice")["records"]
    assert rec["task_id"] == outer_id


def test_cuda_visible_devices_restricts_the_grant(node: Any) -> None:
    ep = node.env("alice", gpus=1)
    show = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    r = gpushare_run(
        "--endpoint", ep, sys.executable, "-c", show, env={"CUDA_VISIBLE_DEVICES": "1"}
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == node.admin("status")["gpus"][1]["uuid"]
    uuid0 = node.admin("status")["gpus"][0]["uuid"]
    r = gpushare_run(
        "--endpoint", ep, sys.executable, "-c", show, env={"CUDA_VISIBLE_DEVICES": uuid0}
    )
    assert r.stdout.strip() == uuid0
    # Naming a GPU the node lacks is refused, with the fix; so is an empty list.
    r = gpushare_run("--endpoint", ep, "true", env={"CUDA_VISIBLE_DEVICES": "7"})
    assert r.returncode == 77
    assert "'7' names no GPU" in r.stderr and "CUDA_VISIBLE_DEVICES" in r.stderr
    r = gpushare_run("--endpoint", ep, "true", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 77
    assert "allows no GPU" in r.stderr
    # The allowed GPU busy and the other free: no grant (without waiting: 75).
    other = Holder(node.env("other"))  # takes the GPU with most free memory
    taken = next(t for t in node.tasks() if t["env"] == "other")["gpus"][0]
    r = gpushare_run(
        "--endpoint", ep, "--no-wait", "true", env={"CUDA_VISIBLE_DEVICES": str(taken)}
    )
    assert r.returncode == 75
    other.close()


def test_a_mistyped_option_is_a_usage_error_not_a_command(node: Any) -> None:
    ep = node.env("alice")
    r = gpushare_run("--endpoint", ep, "--gpu", "2", "true")
    assert r.returncode == 2
    assert "--gpu" in r.stderr
    assert node.admin("history", env="alice")["records"] == []
    # The command's own options pass through untouched.
    r = gpushare_run("--endpoint", ep, sys.executable, "-c", "import sys; print(sys.argv)", "-x")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['-c', '-x']"


def test_cpu_fallback_for_cuda_visible_devices_minus_one(node: Any) -> None:
    ep = node.env("alice")
    env = {"CUDA_VISIBLE_DEVICES": "-1"}
    r = gpushare_run("--endpoint", ep, "true", env=env)
    assert r.returncode == 77 and "allows no GPU" in r.stderr
    r = gpushare_run(
        "--endpoint", ep, "--cpu-fallback", "sh", "-c", 'exit "${#CUDA_VISIBLE_DEVICES}"', env=env
    )
    assert r.returncode == 0, r.stderr
    assert node.admin("history", env="alice")["records"] == []


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--wait-timeout", "nan"], {}, "'nan' is not a number of seconds from 0 to 604800"),
        (["--wait-timeout", "inf"], {}, "is not a number of seconds"),
        (["--grace", "nan"], {}, "'nan' is not a number of seconds from 0 to 3600"),
        (["--gpus", "\uff12"], {}, "is not a whole number from 1"),
        (["--memory", "1" + "0" * 400 + ".5"], {}, "'--memory': size out of range"),
        ([], {"GPUSHARE_WAIT_TIMEOUT": "1e400"}, "GPUSHARE_WAIT_TIMEOUT='1e400'"),
        ([], {"GPUSHARE_WAIT_TIMEOUT": "inf"}, "GPUSHARE_WAIT_TIMEOUT='inf'"),
        ([], {"GPUSHARE_WAIT_TIMEOUT": "Infinity"}, "GPUSHARE_WAIT_TIMEOUT='Infinity'"),
        ([], {"GPUSHARE_WAIT_TIMEOUT": "nan"}, "GPUSHARE_WAIT_TIMEOUT='nan'"),
        ([], {"GPUSHARE_GRACE": "\uff13"}, "is not a number of seconds"),
    ],
)
def test_bad_numbers_are_usage_errors(args: list[str], env: dict[str, str], needle: str) -> None:
    r = gpushare_run(*args, "--endpoint", "ipc:///nonexistent/task.sock", "true", env=env)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
