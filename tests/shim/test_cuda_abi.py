"""shim/cuda_abi.h, written by hand so that the project builds without the CUDA toolkit,
against CUDA's own cuda.h (the nvidia-cuda-runtime test dependency's): every struct it
declares has the same size and every field the same offset and size, and every CU_/CUDA_
constant the same value. Two programs print the same facts, one compiled against each
header; their outputs must be equal. (Its NVML slice is not in cuda.h: the real-driver
tier calls the real NVML with it.)
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.sim.test_sim_api import include_dir

ABI = ROOT / "shim" / "cuda_abi.h"

STRUCT = re.compile(r"^typedef struct \{\n(.*?)^\} (\w+);", re.M | re.S)
CONSTANT = re.compile(r"^\s*((?:CU|CUDA)_[A-Z0-9_]+) = ", re.M)


def _fields(body: str) -> list[str]:
    """The member designators of a struct body: top-level names, and a nested struct's
    members as ``outer.inner`` beside ``outer`` itself."""
    out: list[str] = []
    nested: list[str] = []
    depth = 0
    for raw in body.splitlines():
        line = re.sub(r"/\*.*?\*/", "", raw).strip()
        if not line:
            continue
        if line.startswith("struct {"):
            depth, nested = 1, []
            continue
        if depth and line.startswith("}"):
            outer = line.strip("} ;")
            out += [outer, *(f"{outer}.{name}" for name in nested)]
            depth = 0
            continue
        names = [re.sub(r"\[.*\]", "", d).strip(" *") for d in line.rstrip(";").split(",")]
        names[0] = names[0].split()[-1].lstrip("*")
        (nested if depth else out).extend(names)
    return out


def _program(header: str, structs: dict[str, list[str]], constants: list[str]) -> str:
    lines = [header, "#include <stddef.h>", "#include <stdio.h>", "int main(void) {"]
    for name, fields in structs.items():
        lines.append(f'printf("{name} %zu\\n", sizeof({name}));')
        for f in fields:
            lines.append(
                f'printf("{name}.{f} %zu %zu\\n", offsetof({name}, {f}), '
                f"sizeof((({name} *)0)->{f}));"
            )
    for c in constants:
        lines.append(f'printf("{c} %lld\\n", (long long){c});')
    lines += ["return 0;", "}"]
    return "\n".join(lines) + "\n"


def _facts(tmp_path: Path, name: str, source: str, include: Path) -> list[str]:
    src = tmp_path / f"{name}.c"
    exe = tmp_path / name
    src.write_text(source)
    subprocess.run(
        ["cc", "-std=gnu11", "-I", str(include), "-o", str(exe), str(src)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return subprocess.run(
        [str(exe)], check=True, capture_output=True, text=True, timeout=120
    ).stdout.split("\n")


def test_cuda_abi_h_lays_out_what_cuda_h_does(tmp_path: Path) -> None:
    text = ABI.read_text()
    cuda_part = text[: text.index("/* NVML")] + text[text.index("enum {\n\tCUDA_SUCCESS") :]
    structs = {name: _fields(body) for body, name in STRUCT.findall(cuda_part)}
    constants = sorted(set(CONSTANT.findall(cuda_part)))
    # A parser that found nothing proves nothing: the header's known contents are there.
    assert {"CUDA_ARRAY3D_DESCRIPTOR", "CUmemAllocationProp", "CUlaunchConfig"} <= set(structs)
    assert "allocFlags.usage" in structs["CUmemAllocationProp"]
    assert len(constants) > 40
    ours = _facts(
        tmp_path, "ours", _program('#include "cuda_abi.h"', structs, constants), ABI.parent
    )
    theirs = _facts(
        tmp_path, "cuda", _program("#include <cuda.h>", structs, constants), include_dir()
    )
    assert ours == theirs, "\n".join(
        f"ours {a!r} cuda.h {b!r}" for a, b in zip(ours, theirs, strict=False) if a != b
    )


@pytest.mark.parametrize(
    ("right", "wrong"),
    [
        ("\tint id;", "\tlong id;"),
        ("CU_MEM_LOCATION_TYPE_HOST = 2,", "CU_MEM_LOCATION_TYPE_HOST = 7,"),
    ],
)
def test_a_layout_that_differs_is_caught(tmp_path: Path, right: str, wrong: str) -> None:
    """The comparison fails for a header wrong in one field's type or one value."""
    text = ABI.read_text()
    assert right in text
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "cuda_abi.h").write_text(text.replace(right, wrong, 1))
    structs = {"CUmemLocation": ["type", "id"]}
    constants = ["CU_MEM_LOCATION_TYPE_HOST"]
    ours = _program('#include "cuda_abi.h"', structs, constants)
    theirs = _program("#include <cuda.h>", structs, constants)
    assert _facts(tmp_path, "ours", ours, tmp_path / "inc") != _facts(
        tmp_path, "cuda", theirs, include_dir()
    )
