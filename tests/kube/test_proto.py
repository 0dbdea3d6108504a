"""The committed protocol modules are what `make proto` makes from the .proto files: the
.proto files are their one home (docs/kubernetes.md, "The protocol files")."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ("deviceplugin", "podresources")


def test_committed_protocol_modules_are_generated_from_the_proto_files(tmp_path: Path) -> None:
    (tmp_path / "kube" / "proto").mkdir(parents=True)
    for name in PROTOS:
        shutil.copy(ROOT / "kube" / "proto" / f"{name}.proto", tmp_path / "kube" / "proto")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            "--python_out=.",
            "--grpc_python_out=.",
        ]
        + [f"kube/proto/{name}.proto" for name in PROTOS],
        cwd=tmp_path,
        check=True,
        timeout=120,
    )
    for name in PROTOS:
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            made = (tmp_path / "kube" / "proto" / f"{name}{suffix}").read_text()
            kept = (ROOT / "kube" / "proto" / f"{name}{suffix}").read_text()
            assert made == kept, f"kube/proto/{name}{suffix} is stale: run `make proto`"
