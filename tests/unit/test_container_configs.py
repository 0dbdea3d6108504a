"""The container configs (configs/container, configs/devcontainer-feature) agree with each
other and with the installed package: the same fixed shim path and endpoint everywhere, and
the command they find the shim with works."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "configs" / "container" / "Dockerfile.gpushare"
FEATURE = ROOT / "configs" / "devcontainer-feature" / "gpushare"
SHIM_LINK = "/usr/local/lib/gpushare/libgpushare.so"
ENDPOINT = "ipc:///run/gpushare/task.sock"


def _dockerfile_env() -> dict[str, str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(dict(re.findall(r"(\w+)=(\S+)", line)))
    return env


def test_feature_metadata() -> None:
    meta = json.loads((FEATURE / "devcontainer-feature.json").read_text())
    assert meta["id"] == FEATURE.name  # the spec: the id names the feature's folder
    assert re.fullmatch(r"\d+\.\d+\.\d+", meta["version"])
    for option in meta["options"].values():
        assert option["type"] == "string" and "default" in option
    assert meta["containerEnv"] == {
        "LD_PRELOAD": SHIM_LINK,
        "GPUSHARE_AUTOLOAD": "1",
        "GPUSHARE_ENDPOINT": ENDPOINT,
    }


def test_dockerfile_sets_what_the_feature_sets() -> None:
    env = _dockerfile_env()
    assert env == {"LD_PRELOAD": SHIM_LINK, "GPUSHARE_AUTOLOAD": "1", "GPUSHARE_ENDPOINT": ENDPOINT}


def test_both_link_the_shim_where_ld_preload_looks() -> None:
    for text in (DOCKERFILE.read_text(), (FEATURE / "install.sh").read_text()):
        assert f'ln -sf "$shim" {SHIM_LINK}' in text


def test_install_script_is_executable_sh() -> None:
    script = FEATURE / "install.sh"
    assert os.access(script, os.X_OK)  # the spec: the tool runs it directly
    subprocess.run(["sh", "-n", str(script)], check=True, timeout=120)


def test_shim_discovery_command(tmp_path: Path) -> None:
    """The command both configs run at build time prints the installed shim, from any
    working directory."""
    out = subprocess.run(
        [sys.executable, "-I", "-c", "import gpushare.libs as l; print(l.shim_path())"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "GPUSHARE_SHIM"},
        timeout=120,
    ).stdout.strip()
    assert Path(out).is_file() and Path(out).name == "libgpushare.so"
