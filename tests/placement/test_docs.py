"""docs/placement.md states the engine's constants: each as the code has it."""

from __future__ import annotations

from pathlib import Path

from benchmarks.cluster_bench import FLEET_GPUS, FLEET_SIZES
from placement.adapt import ADAPT_FACTOR, SCALING_EFFICIENCY
from placement.failures import FailureModel, Workload
from placement.frag import TYPICAL_SHARE
from placement.policies import room
from placement.policies.base import CPU_SCALE, GPU_SCALE
from placement.policies.gpushare import MAX_MOVES
from placement.policies.seed004 import HIDDEN, RECENCY_DAYS, Training
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


def test_seed_004_s_documented_constants_are_the_code_s() -> None:
    model, workload, training = FailureModel(), Workload(), Training()
    for said in [
        f"{model.error_prone_share:.0%} of the GPUs (exactly, at random places)",
        f"{model.error_prone_factor:g} times the others' rate",
        f"{model.history_days:g} days before the batch",
        f"{model.repair_hours:g} h: a failed GPU is out",
        f"{model.checkpoint_hours:g} h of work",
        f"{model.restart_overhead_hours:g} h of reload",
        f"{HIDDEN} hidden units",
        f"exp(-days / {RECENCY_DAYS:g})",
        f"runs the best of {training.randoms} random placements on it and {training.samples} draws",
        f"plus {training.restart_weight:g} times the same relative difference",
        f"Adam (learning rate {training.learning_rate:g})",
        f"trains {training.episodes} episodes from seed {training.seed}",
        f"A pool of {workload.gpus:,} GPUs",
        f"past {workload.fill:.0%} of the pool",
        f"from {workload.min_days:g} to {workload.max_days:g} days",
    ]:
        assert said in TEXT, said


def test_seed_003_and_the_fleet_s_documented_constants_are_the_code_s() -> None:
    sizes = ", ".join(f"{g:,}" for g in FLEET_SIZES[:-1]) + f" or {FLEET_SIZES[-1]:,}"
    for said in [
        f"{FLEET_GPUS:,} GPUs, jobs of {sizes} GPUs",
        f"goes {ADAPT_FACTOR} \u00d7 {SCALING_EFFICIENCY:g} times as fast",
        f"loses {MIGRATION_SECONDS:g} s (a checkpoint, restarted at the smaller size)",
    ]:
        assert said in TEXT, said
