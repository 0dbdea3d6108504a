"""The time replay on clusters whose timeline can be worked out by hand."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from placement.cli import cli
from placement.cluster import ClusterState, Placement, Pod
from placement.policies.fgd import Fgd
from placement.registry import names, register
from placement.timeline import MIGRATION_SECONDS, Stats, replay_in_time
from tests.placement.conftest import nodes, pod


def timed(p: Pod, created: float, runs: float | None) -> Pod:
    return dataclasses.replace(p, created=created, deleted=None if runs is None else created + runs)


def test_a_pod_waits_for_the_one_before_it_to_leave() -> None:
    cluster = nodes((8000, 1000, 1, "T4"))
    pods = [timed(pod("a"), 0, 100), timed(pod("b"), 10, 50)]
    r = replay_in_time(cluster, pods, "bestfit")
    assert (r.completed, r.refused, r.unfinished) == (2, 0, 0)
    assert r.wait["LS"] == Stats(2, 45.0, 90.0, 90.0)  # b waits from 10 to 100
    assert r.jct["LS"] == Stats(2, 120.0, 140.0, 140.0)  # a: 100; b: 150 - 10
    assert r.makespan == 150.0 and r.gpu_hours == pytest.approx(150 / 3600)


def test_latency_sensitive_pods_go_first_and_displace_best_effort_ones() -> None:
    cluster = nodes((8000, 1000, 1, "T4"))
    pods = [
        timed(pod("c", qos="BE"), 0, 100),
        timed(pod("d", qos="BE"), 10, 10),
        timed(pod("e", qos="LS"), 10, 20),
    ]
    r = replay_in_time(cluster, pods, "gpushare")
    # e displaces c at 10 and ends at 30; c, saved, resumes first: 30 + 90 = 120; then d.
    assert r.evicted == 1
    assert r.wait["LS"].max == 0.0
    assert r.jct["LS"] == Stats(1, 20.0, 20.0, 20.0)
    assert r.jct["BE"] == Stats(2, (120 + 120) / 2, 120.0, 120.0)  # c 120; d 130 - 10
    assert r.makespan == 130.0
    # Without displacement (best fit knows no classes) e waits for c.
    blind = replay_in_time(cluster, pods, "bestfit")
    assert blind.evicted == 0 and blind.wait["LS"].max == 90.0


class _MovesXForZ(Fgd):
    """FGD, except that z always goes to x's node, x moving to the other node."""

    def decide(self, state: ClusterState, p: Pod, rng: np.random.Generator) -> Placement | None:
        if p.name != "z":
            return super().decide(state, p, rng)
        x = state.placed["x"][1].node
        return Placement(x, (0,), moves=(("x", Placement(1 - x, (1,))),))


if "test-moves-x-for-z" not in names():  # this module imported once more in a process
    register("test-moves-x-for-z", "a migration on cue, for the test below")(_MovesXForZ)


def test_a_migrated_pod_loses_a_checkpoint_s_worth_of_progress() -> None:
    cluster = nodes((8000, 1000, 2, "T4"), (8000, 1000, 2, "T4"))
    pods = [timed(pod("x", milli=400), 0, 1000), timed(pod("z", gpus=1), 10, 100)]
    r = replay_in_time(cluster, pods, "test-moves-x-for-z")
    assert r.migrations == 1
    assert r.jct["LS"].max == 1000.0 + MIGRATION_SECONDS  # x
    assert r.makespan == 1000.0 + MIGRATION_SECONDS


def test_pods_that_fit_nowhere_are_refused_and_never_deleted_ones_unfinished() -> None:
    cluster = nodes((8000, 1000, 2, "T4"))
    pods = [
        timed(pod("big", gpus=4), 0, 10),
        timed(pod("forever"), 0, None),
        timed(pod("ok"), 5, 5),
    ]
    r = replay_in_time(cluster, pods, "fgd")
    assert (r.refused, r.unfinished, r.completed) == (1, 1, 1)
    assert r.gpu_hours == pytest.approx((10 + 5) / 3600)  # forever: 0 to the last event


def test_speedup_brings_arrivals_together() -> None:
    cluster = nodes((8000, 1000, 1, "T4"))
    pods = [timed(pod("a"), 0, 100), timed(pod("b"), 1000, 100)]
    assert replay_in_time(cluster, pods, "fgd").wait["LS"].max == 0.0
    squeezed = replay_in_time(cluster, pods, "fgd", speedup=20)  # b arrives at 50
    assert squeezed.wait["LS"].max == 50.0
    with pytest.raises(ValueError, match="speedup"):
        replay_in_time(cluster, pods, "fgd", speedup=0)


def test_replay_command(tmp_path: Path) -> None:
    (tmp_path / "n.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,8000,1000,1,T4\n")
    (tmp_path / "p.csv").write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,qos,creation_time,deletion_time\n"
        "a,1000,0,1,1000,BE,0,100\nb,1000,0,1,1000,LS,10,60\n"
    )
    args = ["replay", "--nodes", str(tmp_path / "n.csv"), "--pods", str(tmp_path / "p.csv")]
    r = CliRunner().invoke(cli, [*args, "--policy", "gpushare", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["evicted"] == 1 and doc["wait"]["LS"]["max"] == 0.0
    assert doc["jct"]["BE"]["mean"] == 150.0  # a: displaced at 10, resumes at 60, ends 150
    text = CliRunner().invoke(cli, [*args, "--policy", "fgd"])
    assert text.exit_code == 0 and "class   pods   JCT mean" in text.output
