"""docs/placement.md states the engine's constants: each as the code has it."""

from __future__ import annotations

from pathlib import Path

from placement.frag import TYPICAL_SHARE
from placement.policies import room
from placement.policies.base import CPU_SCALE, GPU_SCALE
from placement.policies.gpushare import MAX_MOVES
from placement.replay import CHECKPOINTS, DEFAULT_TUNE
from placement.timeline import MIGRATION_SECONDS

DOC = (Path(__file__).resolve().parent.parent.parent / "docs" / "placement.md").read_text()
TEXT = " ".join(DOC.split())  # the sentences whatever their line breaks


def test_the_documented_constants_are_the_code_s() -> None:
    for said in [
        f"migrating up to {MAX_MOVES} tasks",
        f"at most {MAX_MOVES} of them",
        f"at most {room.MAX_DISPLACE_LOOKED_AT}, the least GPU share",
        f"the {room.MAX_LOOKED_AT} nodes with the least GPU share",
        f"a node is tried (at most {room.MAX_TRIED_NODES})",
        f"loses {MIGRATION_SECONDS:g} s of progress",
        f"a migrated pod loses {MIGRATION_SECONDS:g} s",
        f"until they cover {TYPICAL_SHARE:.0%} of the tasks",
        f"The scales {CPU_SCALE:,} milli-cores and {GPU_SCALE:,} milli-GPU",
        f"`--tune` ({DEFAULT_TUNE:g})",
        "(" + ", ".join(str(a) for a in CHECKPOINTS) + "%; those the run reached)",
    ]:
        assert said in TEXT, said
