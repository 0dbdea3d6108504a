#!/usr/bin/env python3
"""gpushare on Kubernetes (docs/kubernetes.md): the scheduler extender's and the device
plugin's latency, each as its own process over real sockets.

    python benchmarks/kube_bench.py [--quick] [--only NAME]... [--out FILE] [--check]

- ``extender``: ``gpushare-cluster extender`` (policy gpushare) over a fake API server
  holding 1,000 GPU nodes of four models (8 x H200 141 GiB, 8 x A100 80 GiB, 8 x V100
  32 GiB, 4 x T4 16 GiB; oversubscription 4) and 3,000 bound pods of shapes drawn with a
  fixed seed. For each of 300 pending pods (of the same shapes), kube-scheduler's two
  calls as it makes them with nodeCacheCapable: filter with every node's name, then
  prioritize with the names that passed, each over HTTP; then bind to the best node, as
  the scheduler would (not timed). Figures: the milliseconds of filter + prioritize,
  p50, p99 and max. Target: p99 at most 10 ms. ``--quick``: 100 pods.
- ``allocate``: ``gpushare-cluster device-plugin`` against a fake kubelet (real gRPC on
  unix sockets) and a real nodemgr on 8 simulated GPUs; 120 containers allocated as
  kubelet does (their gpus, then their gpu-memory), each Allocate making or completing
  the container's environment in nodemgr. Figures: milliseconds per Allocate, p50, p99
  and max. Target: p99 at most 50 ms. ``--quick``: 40 containers.

JSON on stdout and in ``--out``; progress on stderr.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent))

from benchmarks import harness

BIN = Path(sys.executable).parent
EXTENDER_P99_MS = 10.0
ALLOCATE_P99_MS = 50.0
NODE_KINDS = (("H200", 8, 141), ("A100", 8, 80), ("V100", 8, 32), ("T4", 4, 16))
# Pod shapes: (GPUs, GiB over them, CPU cores), drawn uniformly.
SHAPES = ((1, 8, 2), (1, 16, 4), (1, 24, 4), (1, 40, 8), (2, 64, 8), (1, 80, 8), (4, 320, 16))


class _Client:
    """One kept-alive HTTP connection, as kube-scheduler's extender client keeps one."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)

    def post(self, verb: str, body: Any) -> Any:
        data = json.dumps(body).encode()
        self.conn.request("POST", f"/{verb}", data, {"Content-Type": "application/json"})
        reply = self.conn.getresponse()
        got = json.loads(reply.read())
        if reply.status != 200:
            raise harness.BenchError(f"{verb}: HTTP {reply.status}: {got}")
        return got


def _wait_for_line(log: Path, pattern: str, proc: Any, timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text())
        if m:
            return m
        if proc.poll() is not None:
            raise harness.BenchError(f"{log.name}: the process ended: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    raise harness.BenchError(f"{log.name}: no {pattern!r} within {timeout} s")


def _figures(ms: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(harness.percentile(ms, 50), 3),
        "p99_ms": round(harness.percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
    }


def bench_extender(quick: bool) -> dict[str, Any]:
    from tests.fixtures.fake_apiserver import FakeApiServer, node, pod

    rng = random.Random(7)
    api = FakeApiServer()
    root = Path(tempfile.mkdtemp(prefix="gs-kb-"))
    try:
        api.nodes = [
            node(f"node-{i:04d}", gpus=g, gib=gib, model=model, cpu="128", memory="1Ti")
            for i, (model, g, gib) in ((i, NODE_KINDS[i % len(NODE_KINDS)]) for i in range(1000))
        ]
        for k in range(3000):
            gpus, gib, cpu = rng.choice(SHAPES)
            api.pods.append(
                pod(
                    f"bound-{k}",
                    gpus,
                    gib,
                    cpu=str(cpu),
                    node_name=f"node-{rng.randrange(1000):04d}",
                )
            )
        log = root / "extender.log"
        with open(log, "wb") as out:
            proc = harness.start_child(
                [
                    str(BIN / "gpushare-cluster"),
                    "extender",
                    "--listen",
                    "127.0.0.1:0",
                    "--api-server",
                    api.url,
                    "--refresh",
                    "3600",
                ],
                stdout=out,
                stderr=out,
            )
        port = int(_wait_for_line(log, r"serving on 127\.0\.0\.1:(\d+)", proc, 60).group(1))
        client = _Client(f"http://127.0.0.1:{port}")
        names = [n["metadata"]["name"] for n in api.nodes]
        # The first refresh has read the cluster once a filter passes some node.
        probe = pod("probe", 1, 8)
        deadline = time.monotonic() + 120
        while not client.post("filter", {"Pod": probe, "NodeNames": names})["NodeNames"]:
            if time.monotonic() > deadline:
                raise harness.BenchError("the extender never saw the nodes")
            time.sleep(0.1)
        pending = 100 if quick else 300
        ms: list[float] = []
        unplaced = 0
        for k in range(pending):
            gpus, gib, cpu = rng.choice(SHAPES)
            p = pod(f"new-{k}", gpus, gib, cpu=str(cpu))
            with api.lock:
                api.pods.append(p)
            started = time.perf_counter()
            got = client.post("filter", {"Pod": p, "Nodes": None, "NodeNames": names})
            passed = got["NodeNames"]
            scores = client.post("prioritize", {"Pod": p, "Nodes": None, "NodeNames": passed})
            ms.append((time.perf_counter() - started) * 1000)
            if not passed:
                unplaced += 1
                continue
            best = max(scores, key=lambda h: h["Score"])["Host"]
            bound = client.post(
                "bind",
                {
                    "PodName": p["metadata"]["name"],
                    "PodNamespace": "team",
                    "PodUID": p["metadata"]["uid"],
                    "Node": best,
                },
            )
            if bound["Error"]:
                raise harness.BenchError(f"bind failed: {bound['Error']}")
        harness.finish(proc)
        result: dict[str, Any] = {
            "nodes": len(names),
            "bound_pods": 3000,
            "pending_pods": pending,
            "unplaced": unplaced,
            "filter_prioritize": _figures(ms),
        }
        return harness.judge(result, "filter_prioritize.p99_ms", "<=", EXTENDER_P99_MS)
    finally:
        api.stop()
        shutil.rmtree(root, ignore_errors=True)


def bench_allocate(quick: bool) -> dict[str, Any]:
    from kube.resources import GPU_MEMORY, GPUS, SOCKETS
    from tests.fixtures.fake_kubelet import FakeKubelet

    root = Path(tempfile.mkdtemp(prefix="gs-kb-", dir="/tmp"))
    kubelet = FakeKubelet(root / "dp", root / "pr" / "kubelet.sock")
    try:
        config = root / "nodemgr.toml"
        config.write_text(
            f'[node]\nrun_dir = "{root / "run"}"\nstate_dir = "{root / "state"}"\n'
            '[gpus]\nsource = "simulated"\nsimulated_count = 8\nsimulated_memory = "80GiB"\n'
            "[kube]\noversubscription = 16\n"
        )
        nodemgr_log = open(root / "nodemgr.log", "wb")  # noqa: SIM115 (the child's)
        nodemgr = harness.start_child(
            [str(BIN / "nodemgr"), "serve", "--config", str(config)],
            stdout=nodemgr_log,
            stderr=nodemgr_log,
        )
        from gpushare.client import wait_until_serving

        if not wait_until_serving(
            f"ipc://{root / 'run' / 'admin.sock'}", lambda: nodemgr.poll() is None, 30
        ):
            raise harness.BenchError("nodemgr did not start")
        log = root / "plugin.log"
        with open(log, "wb") as out:
            plugin = harness.start_child(
                [
                    str(BIN / "gpushare-cluster"),
                    "device-plugin",
                    "--kubelet-dir",
                    str(kubelet.plugins_dir),
                    "--pod-resources",
                    str(kubelet.pod_resources),
                    "--config",
                    str(config),
                ],
                stdout=out,
                stderr=out,
            )
        deadline = time.monotonic() + 60
        while len(kubelet.registrations()) < 2:
            if time.monotonic() > deadline or plugin.poll() is not None:
                raise harness.BenchError(f"the plugin did not register: {log.read_text()}")
            time.sleep(0.05)
        containers = 40 if quick else 120
        ms: list[float] = []
        live = []
        for k in range(containers):
            gpu_ids = [f"gpu{k % 8}-{k // 8}"]
            mem_ids = [f"mem{k % 8}-{k // 8 * 16 + j}" for j in range(16)]
            for socket, ids in ((SOCKETS[GPUS], gpu_ids), (SOCKETS[GPU_MEMORY], mem_ids)):
                started = time.perf_counter()
                kubelet.allocate(socket, ids)
                ms.append((time.perf_counter() - started) * 1000)
            live.append(("team", f"pod-{k}", "dev", {GPUS: gpu_ids, GPU_MEMORY: mem_ids}))
            kubelet.set_pods(live)
        harness.finish(plugin)
        harness.finish(nodemgr)
        result: dict[str, Any] = {"containers": containers, "allocate": _figures(ms)}
        return harness.judge(result, "allocate.p99_ms", "<=", ALLOCATE_P99_MS)
    finally:
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


BENCHMARKS = {"extender": bench_extender, "allocate": bench_allocate}


def describe() -> dict[str, Any]:
    import grpc

    return harness.machine({"grpcio": grpc.__version__})


def main(argv: list[str] | None = None) -> int:
    return harness.main(__doc__, BENCHMARKS, (harness.BenchError,), describe, argv)


if __name__ == "__main__":
    sys.exit(main())
