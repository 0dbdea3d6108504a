"""The source distribution builds: a wheel made from the unpacked sdist, offline and with this
venv's build tools, holds every file the installed package has (the shim, the simulated
driver and NVML, the ledger bindings, the auto-load hook)."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import client_plugin
from tests.conftest import ROOT


def source_tree(dest: Path) -> Path:
    """The checkout's files that git keeps or would add (not build outputs), copied."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the files of the source tree are unknown")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = ROOT / name
        if src.is_file():  # not one deleted in the working tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def package_files(names: list[str]) -> set[str]:
    """What a wheel or an installation holds in site-packages, less its metadata and byte
    code (an installation's scripts are outside it, made by pip from the entry points)."""
    return {
        n
        for n in names
        if not n.startswith("../")
        and ".dist-info/" not in n
        and "__pycache__/" not in n
        and not n.endswith(".pyc")
    }


def test_a_wheel_built_from_the_sdist_is_the_installed_package(tmp_path: Path) -> None:
    tree = source_tree(tmp_path / "tree")
    build = "from setuptools import build_meta; print(build_meta.build_sdist('dist'))"
    p = subprocess.run(
        [sys.executable, "-c", build], cwd=tree, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stdout + p.stderr
    sdist = tree / "dist" / p.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    offline = ["--no-deps", "--no-build-isolation", "--no-index"]
    wheel_dir = tmp_path / "wheel"
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", *offline, "-w", str(wheel_dir), str(unpacked)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, f"the sdist does not build:\n{p.stdout}{p.stderr}"
    (wheel,) = wheel_dir.glob("gpushare-*.whl")
    with zipfile.ZipFile(wheel) as z:
        built = package_files(z.namelist())
    # The installed copy the tests run (not a build's metadata in the checkout).
    site = Path(client_plugin.__file__).resolve().parents[1]
    (dist,) = importlib.metadata.distributions(name="gpushare", path=[str(site)])
    installed = package_files([str(f) for f in dist.files or []])
    assert {"gpushare/lib/libgpushare.so", "gpushare-autoload.pth"} <= installed
    assert built == installed, (
        f"missing from the sdist's wheel: {sorted(installed - built)}; "
        f"only in it: {sorted(built - installed)}"
    )
