"""Three nodes, end to end: three nodemgrs on simulated GPUs, each with its device plugin
and a fake kubelet; a fake API server; the extender over them. Pods of the Alibaba GPU
v2023 trace arrive one by one; this test plays kube-scheduler (its resource-fit filter,
then the extender's filter, prioritize and bind) and each node's kubelet (device IDs by
the plugin's preference, Allocate, the pod-resources list), then runs each placed pod's
task through its environment. The placement engine, run directly on the same pods, must
place every pod where the live system did, so the two allocation ratios agree
(docs/kubernetes.md, "How it is tested without a cluster")."""

from __future__ import annotations

import math
import random
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kube.extender.model import Ask, ask, node_info
from kube.resources import ENV_ANNOTATION, GPU_MEMORY, GPUS, SOCKETS
from placement.cluster import ClusterState
from placement.registry import make
from placement.trace import read_pods
from tests.conftest import BIN, Daemon, _wait_for
from tests.fixtures.fake_apiserver import FakeApiServer, node, pod
from tests.fixtures.fake_kubelet import FakeKubelet
from tests.kube.conftest import ExtenderProcess, PluginProcess

# isort: off
from tests.placement.conftest import traces  # first: it puts the repository on sys.path
from benchmarks.cluster_bench import TRACES_ENV

# isort: on

FACTOR = 4
GIB = 16  # each simulated GPU's memory
GPUS_PER_NODE = (2, 4, 2)
NODE_CPU, NODE_MEMORY = 64, 256  # cores, GiB
ARRIVALS = 1.3  # the stream asks for this many times the nodes' GPU-count quota


@pytest.fixture
def trace_pods() -> list[Any]:
    csv = traces() / "openb_pod_list_default.csv"
    if not csv.is_file():
        pytest.skip(f"no Alibaba GPU v2023 trace at {csv.parent} (set {TRACES_ENV})")
    return read_pods(csv)


class Node:
    """One node: its nodemgr, kubelet, plugin, and what kubelet has handed out."""

    def __init__(self, name: str, daemon: Daemon, kubelet: FakeKubelet, plugin: PluginProcess):
        self.name, self.daemon, self.kubelet, self.plugin = name, daemon, kubelet, plugin
        self.free = {
            r: [i for i, _ in kubelet.list_devices(SOCKETS[r])] for r in (GPUS, GPU_MEMORY)
        }
        self.capacity = {r: len(v) for r, v in self.free.items()}
        self.pods: list[tuple[str, str, str, dict[str, list[str]]]] = []

    def obj(self) -> dict[str, Any]:
        made = node(
            self.name,
            gpus=1,
            gib=1,
            factor=1,
            cpu=str(NODE_CPU),
            memory=f"{NODE_MEMORY}Gi",
            model="A100",
        )
        alloc = made["status"]["allocatable"]
        alloc[GPUS], alloc[GPU_MEMORY] = str(self.capacity[GPUS]), str(self.capacity[GPU_MEMORY])
        return made


@pytest.fixture
def cluster(daemon_factory: Any) -> Iterator[list[Node]]:
    root = Path(tempfile.mkdtemp(prefix="gs-m-", dir="/tmp"))
    made: list[Node] = []
    try:
        for k, gpus in enumerate(GPUS_PER_NODE):
            daemon: Daemon = daemon_factory(
                {
                    "kube": {"oversubscription": FACTOR},
                    "gpus": {"simulated_count": gpus, "simulated_memory": f"{GIB}GiB"},
                },
                heartbeat_timeout=600.0,
            )
            kubelet = FakeKubelet(root / f"n{k}" / "dp", root / f"n{k}" / "pr" / "kubelet.sock")
            plugin = PluginProcess(root / f"n{k}", daemon, kubelet)
            _wait_for(lambda kubelet=kubelet: len(kubelet.registrations()) == 2, 30)
            made.append(Node(f"node-{k}", daemon, kubelet, plugin))
        yield made
    finally:
        for n in made:
            n.plugin.stop()
            n.kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


def _stream(trace_pods: list[Any]) -> list[dict[str, Any]]:
    """Trace pods that ask for GPUs, in an order drawn with a fixed seed, as Kubernetes
    pods: their GPUs, their share of each as GiB of its 16 (at least 1), their CPU and
    memory; until they ask for ARRIVALS times the nodes' gpushare.io/gpus."""
    rng = random.Random(42)
    gpu_pods = sorted((p for p in trace_pods if p.num_gpu), key=lambda p: p.name)
    rng.shuffle(gpu_pods)
    slots = sum(GPUS_PER_NODE) * FACTOR
    out, asked = [], 0
    for p in gpu_pods:
        if asked >= ARRIVALS * slots:
            break
        per_gpu = max(1, math.ceil(p.gpu_milli * GIB / 1000))
        out.append(
            pod(
                f"{p.name}",
                p.num_gpu,
                per_gpu * p.num_gpu,
                cpu=f"{p.cpu}m",
                memory=f"{p.memory}Mi",
                namespace="trace",
            )
        )
        asked += p.num_gpu
    return out


def _wants(a: Ask) -> dict[str, int]:
    """What a pod asks of a node's allocatable resources (CPU in milli-cores, memory in
    MiB), as kube-scheduler counts it."""
    return {"cpu": a.cpu, "memory": a.memory, GPUS: a.gpus, GPU_MEMORY: a.gpu_memory}


def _fits(requested: dict[str, float], n: Node, p: dict[str, Any]) -> bool:
    """kube-scheduler's NodeResourcesFit, which runs before any extender."""
    want = _wants(ask(p))
    have = {"cpu": NODE_CPU * 1000, "memory": NODE_MEMORY * 1024, **n.capacity}
    return all(requested.get(k, 0) + v <= have[k] for k, v in want.items())


def test_pods_of_the_trace_placed_across_three_nodes_agree_with_the_engine(
    cluster: list[Node], trace_pods: list[Any]
) -> None:
    stream = _stream(trace_pods)
    api = FakeApiServer()
    api.nodes = [n.obj() for n in cluster]
    api.pods = [dict(p) for p in stream]  # every pod waiting: the extender's workload
    ext = ExtenderProcess(
        "--api-server", api.url, "--refresh", "3600", "--oversubscription", str(FACTOR)
    )
    try:
        names = [n.name for n in cluster]
        _wait_for(
            lambda: (
                ext.post("filter", {"Pod": stream[0], "NodeNames": names})[1]["FailedNodes"]
                != dict.fromkeys(names, "gpushare: node not known to the extender")
            ),
            30,
        )
        requested: dict[str, dict[str, float]] = {n.name: {} for n in cluster}
        live: dict[str, str] = {}
        for p in stream:
            key = p["metadata"]["name"]
            fit = [n.name for n in cluster if _fits(requested[n.name], n, p)]
            if not fit:
                continue
            _, got = ext.post("filter", {"Pod": p, "Nodes": None, "NodeNames": fit})
            assert got["Error"] == ""
            if not got["NodeNames"]:
                continue
            _, scores = ext.post(
                "prioritize", {"Pod": p, "Nodes": None, "NodeNames": got["NodeNames"]}
            )
            best = max(s["Score"] for s in scores)
            target = next(s["Host"] for s in scores if s["Score"] == best)  # node order
            _, bound = ext.post(
                "bind",
                {
                    "PodName": key,
                    "PodNamespace": "trace",
                    "PodUID": p["metadata"]["uid"],
                    "Node": target,
                },
            )
            assert bound == {"Error": ""}
            live[key] = target
            n = next(n for n in cluster if n.name == target)
            a = ask(p)
            for k, v in _wants(a).items():
                requested[target][k] = requested[target].get(k, 0) + v
            # The node's kubelet: IDs by the plugin's preference, then Allocate.
            ids = {}
            for r, count in ((GPUS, a.gpus), (GPU_MEMORY, a.gpu_memory)):
                ids[r] = n.kubelet.preferred(SOCKETS[r], n.free[r], count)
                n.free[r] = [i for i in n.free[r] if i not in ids[r]]
            env = n.kubelet.allocate(SOCKETS[GPUS], ids[GPUS]).annotations[ENV_ANNOTATION]
            second = n.kubelet.allocate(SOCKETS[GPU_MEMORY], ids[GPU_MEMORY])
            assert second.annotations[ENV_ANNOTATION] == env
            n.pods.append(("trace", key, "dev", ids))
            n.kubelet.set_pods(n.pods)
            # Its task, through its environment's socket (the container's mount).
            endpoint = f"ipc://{n.daemon.run_dir / 'envs' / env / 'task.sock'}"
            run = subprocess.run(
                [
                    str(BIN / "gpushare-run"),
                    "--endpoint",
                    endpoint,
                    "--gpus",
                    str(a.gpus),
                    "--no-wait",
                    "--",
                    "true",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert run.returncode == 0, run.stderr
        # The engine on the same pods: the same policy, nodes, workload and pre-filter.
        infos = [node_info(n.obj(), FACTOR) for n in cluster]
        state = ClusterState([i.placement_node() for i in infos])
        policy = make("gpushare")
        asks = [ask(p) for p in stream]
        policy.setup(state, [t for a in asks for t in a.tasks(infos[0])])
        engine: dict[str, str] = {}
        sim_requested: dict[str, dict[str, float]] = {n.name: {} for n in cluster}
        rng = np.random.default_rng(0)
        for p, a in zip(stream, asks, strict=True):
            (task,) = a.tasks(infos[0])
            allowed = state.feasible(task) & np.array(
                [_fits(sim_requested[n.name], n, p) for n in cluster]
            )
            where = policy.choose(state, task, rng, allowed)  # type: ignore[attr-defined]
            if where is None:
                continue
            state.place(task, where)
            target = cluster[where.node].name
            engine[p["metadata"]["name"]] = target
            for k, v in _wants(a).items():
                sim_requested[target][k] = sim_requested[target].get(k, 0) + v
        assert live == engine
        # The allocation ratio, of the nodes' quota memory: the live one from nodemgrs.
        held = sum(
            q["gpus"] * q["memory"]
            for n in cluster
            for q in n.daemon.admin("quota_show")["quotas"]
            if q["env"].startswith("k8s-")
        )
        capacity = sum(GPUS_PER_NODE) * GIB * FACTOR << 30
        simulated = sum(a.gpu_memory for a in asks if a.key.split("/")[1] in engine) << 30
        print(
            f"pods {len(stream)}, placed {len(live)}; allocation ratio live "
            f"{held / capacity:.4f}, engine {simulated / capacity:.4f}"
        )
        assert held == simulated
        assert 0 < len(live) < len(stream)  # the stream overfills the nodes
    finally:
        ext.stop()
        api.stop()
