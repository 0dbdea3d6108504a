"""configs/nodemgr.service against docs/operations.md's install commands ("systemd"): the
unit runs the nodemgr of the venv the commands make, with the config they install, under
the name they enable; and `systemd-analyze verify` passes on it as those commands install
it (in a root directory of its own)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from nodemgr import config
from nodemgr.host import gpulock
from tests.conftest import ROOT

UNIT = ROOT / "configs" / "nodemgr.service"
OPERATIONS = ROOT / "docs" / "operations.md"


def unit_settings(text: str) -> dict[str, list[str]]:
    """``Section.Key`` -> its values in order (a key may be given more than once)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def install_commands() -> list[list[str]]:
    """The shell commands of the "systemd" section's code block, each split into words."""
    section = OPERATIONS.read_text().split("\n## systemd\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "docs/operations.md's systemd section has no ```sh block"
    return [shlex.split(line) for line in block[1].splitlines() if line.strip()]


def the(commands: list[list[str]], *prefix: str) -> list[str]:
    """The one command that starts with ``prefix``: its words after it."""
    found = [c[len(prefix) :] for c in commands if tuple(c[: len(prefix)]) == prefix]
    assert len(found) == 1, f"{len(found)} commands start with {' '.join(prefix)!r}"
    return found[0]


def documented_install() -> dict[str, str]:
    """What the commands make: the venv, the config and unit paths, the unit's name."""
    commands = install_commands()
    (venv,) = the(commands, "python3", "-m", "venv")
    assert the(commands, f"{venv}/bin/pip", "install") == ["."], "pip installs into the venv"
    src, config = the(commands, "install", "-D", "-m", "0644")
    assert src == "configs/nodemgr.toml"
    src, unit = the(commands, "install", "-m", "0644")
    assert src == "configs/nodemgr.service"
    (name,) = the(commands, "systemctl", "enable", "--now")
    assert name == Path(unit).name
    assert the(commands, "systemd-analyze", "verify") == [unit]
    assert ["systemctl", "daemon-reload"] in commands
    return {"venv": venv, "config": config, "unit": unit}


def test_the_unit_runs_the_documented_venvs_nodemgr_with_the_documented_config() -> None:
    done = documented_install()
    (exec_start,) = unit_settings(UNIT.read_text())["Service.ExecStart"]
    assert shlex.split(exec_start) == [
        f"{done['venv']}/bin/nodemgr",
        "serve",
        "--config",
        done["config"],
    ], "the unit's ExecStart is not what docs/operations.md installs"


def test_systemd_analyze_verify_passes_on_the_installed_unit(tmp_path: Path) -> None:
    """The unit where the commands put it, the venv's nodemgr a program, systemd's own
    units beside it: `systemd-analyze verify --root` finds nothing wrong."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not found (apt-get install systemd): unit not verified")
    system_units = next(
        (d for d in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if d.is_dir()),
        None,
    )
    if system_units is None:
        pytest.skip("no systemd unit directory: the unit's dependencies cannot be found")
    done = documented_install()
    root = tmp_path / "root"
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    unit = root / done["unit"].lstrip("/")
    unit.parent.mkdir(parents=True)
    shutil.copy(UNIT, unit)
    program = root / done["venv"].lstrip("/") / "bin" / "nodemgr"
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    p = subprocess.run(
        [analyze, "verify", f"--root={root}", done["unit"]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and not p.stderr.strip(), p.stdout + p.stderr


def test_the_unit_lets_nodemgr_write_where_it_must() -> None:
    """ProtectSystem=strict makes the whole file system read-only but ReadWritePaths: the
    shipped config's run_dir and state_dir, and the directory of the GPUs' locks (without
    which nodemgr cannot lock its first GPU and exits 78 on every start)."""
    settings = unit_settings(UNIT.read_text())
    assert settings["Service.ProtectSystem"] == ["strict"]
    writable = {
        Path(p.lstrip("-")) for line in settings["Service.ReadWritePaths"] for p in line.split()
    }
    shipped = config.load(ROOT / "configs" / "nodemgr.toml")
    for path in (shipped.run_dir, shipped.state_dir, gpulock.NVML_LOCK_DIRS[0]):
        assert any(path == w or w in path.parents for w in writable), path


def test_the_unit_waits_for_nodemgr_to_say_ready() -> None:
    """Type=notify: systemd counts nodemgr started once it says READY=1 (after binding its
    sockets, tests/daemon/test_sdnotify.py), and only nodemgr itself may say it."""
    unit = unit_settings(UNIT.read_text())
    assert unit["Service.Type"] == ["notify"]
    assert unit["Service.NotifyAccess"] == ["main"]
