"""The device plugin's process: a gRPC server per resource on a socket in the kubelet's
device-plugin directory, registered with kubelet, serving the v1beta1 device-plugin API;
environments made in the node's nodemgr; the pod-resources list read to reconcile
(docs/kubernetes.md, "The device plugin").
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from gpushare import envvars, paths
from gpushare.client import Connection, NodeError, Unreachable
from gpushare.messages import QuotaDelete, QuotaSet, QuotaShow, Status
from gpushare.protocol import BE, LS, MAX_ADMIN_REPLY_BYTES
from kube.apiserver import ApiError, ApiServer
from kube.deviceplugin.book import Allocation, Book, BookError, Holder, plan
from kube.proto import deviceplugin_pb2 as dp
from kube.proto import deviceplugin_pb2_grpc as dp_grpc
from kube.proto import podresources_pb2 as pr
from kube.proto import podresources_pb2_grpc as pr_grpc
from kube.resources import (
    ENV_ANNOTATION,
    GPU_MEMORY,
    GPUS,
    KUBELET_DIR,
    MEMORY_UNIT,
    POD_RESOURCES_SOCKET,
    RESOURCES,
    SOCKETS,
    device_ids,
    gpu_of,
    pod_class,
)
from nodemgr.config import Config

log = logging.getLogger("gpushare.device-plugin")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
BOOK_FILE = "kube-allocations.json"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
# The NVIDIA device nodes a container that runs CUDA needs, beside one per GPU.
NVIDIA_CONTROL = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
RPC_TIMEOUT = 10.0


class PluginError(Exception):
    """What keeps the plugin from serving: the message names the fix."""


class ListenError(PluginError):
    """The plugin cannot listen in the kubelet's directory."""


def unix(path: Path) -> str:
    return f"unix://{path}"


class NodeManager:
    """The node's nodemgr, through its admin socket."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.endpoint = config.admin_endpoint

    def _send(self, request: Any) -> Any:
        with Connection(self.endpoint, timeout=5.0, max_reply=MAX_ADMIN_REPLY_BYTES) as conn:
            return conn.send(request)

    def gpus(self) -> list[dict[str, Any]]:
        return [dict(g) for g in self._send(Status()).gpus]

    def envs(self) -> set[str]:
        return {str(q["env"]) for q in self._send(QuotaShow(env=None)).quotas}

    def ensure(self, allocation: Allocation) -> None:
        gpus, memory = allocation.quota()
        self._send(QuotaSet(env=allocation.env, gpus=gpus, memory=memory))

    def delete(self, env: str) -> None:
        self._send(QuotaDelete(env=env, force=True))

    def set_class(self, env: str, cls: str) -> None:
        """The environment's tasks' class (docs/scheduling.md, "Classes"); a
        latency-sensitive one is allowed such tasks."""
        self._send(QuotaSet(env=env, class_default=cls, allow_ls=True if cls == LS else None))


class Plugin:
    """Both resources' servers, the book and the reconciliation loop."""

    def __init__(
        self,
        config: Config,
        kubelet_dir: Path = KUBELET_DIR,
        pod_resources: Path = POD_RESOURCES_SOCKET,
        interval: float | None = None,
        api: ApiServer | None = None,
        host_dev: Path = Path("/dev"),
    ) -> None:
        self.config = config
        self.host_dev = host_dev
        # Where the pods' annotations are read (their class); None: not read.
        self.api = api
        self.classes: dict[str, str] = {}  # environment -> the class set on it
        self.node = NodeManager(config)
        self.kubelet_dir = kubelet_dir
        self.pod_resources = pod_resources
        self.factor = config.kube_oversubscription
        # Reconciling twice per heartbeat timeout: a deleted pod's environment goes
        # within one (docs/kubernetes.md).
        self.interval = interval if interval is not None else config.heartbeat_timeout / 2
        self.book_path = config.state_dir / BOOK_FILE
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.stopping = threading.Event()
        self.devices: dict[str, list[tuple[str, str]]] = {r: [] for r in RESOURCES}
        self.generation = 0
        self.servers: dict[str, grpc.Server] = {}
        self.inodes: dict[str, int] = {}
        self.registered: set[str] = set()
        self.book = self._load_book()

    # --- the book on disk -------------------------------------------------------------

    def _load_book(self) -> Book:
        try:
            return Book.from_wire(json.loads(self.book_path.read_text()))
        except FileNotFoundError:
            return Book()
        except (OSError, ValueError, BookError) as e:
            # Reconciliation takes the live containers' allocations back in.
            log.warning("%s: %s; starting from the live containers", self.book_path, e)
            return Book()

    def _save_book(self) -> None:
        self.book_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.book_path.with_name(f".{self.book_path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.book.wire(), indent=1))
        os.replace(tmp, self.book_path)

    # --- devices ------------------------------------------------------------------------

    def refresh_devices(self) -> None:
        """The devices both resources advertise, from nodemgr's GPUs; streams are woken
        when they change."""
        gpus = self.node.gpus()
        new: dict[str, list[tuple[str, str]]] = {r: [] for r in RESOURCES}
        for g in gpus:
            # Lost, or drained by the operator (nodemgr drain): no new pods on its share.
            health = UNHEALTHY if g.get("lost") or g.get("drained") else HEALTHY
            index = int(g["index"])
            new[GPUS] += [(i, health) for i in device_ids(GPUS, index, self.factor)]
            units = int(g["memory"]) // MEMORY_UNIT * self.factor
            new[GPU_MEMORY] += [(i, health) for i in device_ids(GPU_MEMORY, index, units)]
        with self.changed:
            if new != self.devices:
                self.devices = new
                self.generation += 1
                self.changed.notify_all()

    def watch(self, resource: str, context: grpc.ServicerContext) -> Iterator[Any]:
        """ListAndWatch's stream: the devices now, then at every change, until the stream
        or the plugin ends."""
        seen = -1
        while not self.stopping.is_set() and context.is_active():
            with self.changed:
                if seen == self.generation:
                    self.changed.wait(1.0)
                    continue
                seen = self.generation
                listed = list(self.devices[resource])
            yield dp.ListAndWatchResponse(devices=[dp.Device(ID=i, health=h) for i, h in listed])

    # --- allocation ---------------------------------------------------------------------

    def allocate(self, resource: str, ids: list[str]) -> Any:
        """One container's devices of ``resource``: its environment made (or its quota
        completed) in nodemgr; what the container needs to reach it."""
        with self.lock:
            # Tried on a copy: the book changes only once nodemgr has the environment.
            trial = self.book.copy()
            allocation, dropped = trial.allocate(resource, ids, time.time())
            self.node.ensure(allocation)
            self.book = trial
            self._save_book()
        for env in dropped:
            log.info("environment %s dropped: a new container took some of its devices", env)
        return self.container_response(allocation.env)

    def container_response(self, env: str) -> Any:
        host_dir = paths.env_dir(self.config.run_dir, env)
        socket = paths.CONTAINER_DIR / paths.TASK_SOCKET
        envs = {
            envvars.ENDPOINT: paths.endpoint(socket),
            envvars.AUTOLOAD: "1",
            # The NVIDIA Container Toolkit's runtime injects the driver's libraries.
            "NVIDIA_VISIBLE_DEVICES": "all",
            "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
        }
        devices = [
            dp.DeviceSpec(container_path=p, host_path=p, permissions="rw")
            for p in self.nvidia_devices()
        ]
        return dp.ContainerAllocateResponse(
            envs=envs,
            mounts=[
                dp.Mount(
                    container_path=str(paths.CONTAINER_DIR),
                    host_path=str(host_dir),
                    read_only=False,
                )
            ],
            devices=devices,
            annotations={ENV_ANNOTATION: env},
        )

    def nvidia_devices(self) -> list[str]:
        """The NVIDIA device nodes the host has (none on simulated GPUs), by their host
        paths, as found in ``host_dev``: the host's /dev as this process sees it."""
        gpus = sorted(
            (p.name for p in self.host_dev.glob("nvidia[0-9]*") if p.name[6:].isdigit()),
            key=lambda name: int(name[6:]),
        )
        names = [Path(p).name for p in NVIDIA_CONTROL] + gpus
        return [f"/dev/{n}" for n in names if (self.host_dev / n).exists()]

    # --- reconciliation -----------------------------------------------------------------

    def live(self) -> list[Holder]:
        """The containers holding the plugin's devices, from kubelet's pod-resources."""
        with grpc.insecure_channel(unix(self.pod_resources)) as channel:
            stub = pr_grpc.PodResourcesListerStub(channel)
            got = stub.List(pr.ListPodResourcesRequest(), timeout=RPC_TIMEOUT)
        holders = []
        for pod in got.pod_resources:
            for c in pod.containers:
                ids: dict[str, tuple[str, ...]] = {}
                for d in c.devices:
                    if d.resource_name in RESOURCES:
                        ids[d.resource_name] = ids.get(d.resource_name, ()) + tuple(d.device_ids)
                if ids:
                    holders.append(Holder(pod.namespace, pod.name, c.name, ids))
        return holders

    def reconcile(self) -> None:
        """Bring nodemgr's environments in line with the live containers once."""
        with self.lock:
            # Read under the lock: no Allocate between the list and the plan acting on it.
            live = self.live()
            todo = plan(
                self.book, live, self.node.envs(), time.time(), self.config.heartbeat_timeout
            )
            for env in todo.delete:
                self.node.delete(env)
                self.classes.pop(env, None)
                log.info("environment %s removed: no live container holds it", env)
            for allocation in todo.ensure:
                self.node.ensure(allocation)
                self.classes.pop(allocation.env, None)  # a new environment: set it again
                log.info("environment %s restored for a live container", allocation.env)
            for note in todo.notes:
                log.warning("%s", note)
            self._save_book()
            owners = [(h, self.book.owner(i for v in h.ids.values() for i in v)) for h in live]
        if self.api is not None:
            for holder, owner in owners:
                if owner is not None and owner.env not in self.classes:
                    self.apply_class(holder, owner.env)

    def apply_class(self, holder: Holder, env: str) -> None:
        """Set ``env``'s class from its pod's annotation (gpushare.io/class, default
        best-effort); a pod gone or unreadable is tried again next round."""
        assert self.api is not None
        try:
            pod = self.api.pod(holder.namespace, holder.pod)
        except ApiError as e:
            log.warning("pod %s/%s: %s", holder.namespace, holder.pod, e)
            return
        if pod is None:
            return
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        try:
            cls = pod_class(annotations)
        except ValueError as e:
            log.warning("pod %s/%s: %s; left %s", holder.namespace, holder.pod, e, BE)
            cls = BE
        self.node.set_class(env, cls)
        self.classes[env] = cls
        log.info("environment %s: class %s, from pod %s", env, cls, holder.name)

    # --- serving ------------------------------------------------------------------------

    def socket(self, resource: str) -> Path:
        return self.kubelet_dir / SOCKETS[resource]

    def serve(self, resource: str) -> None:
        """Start ``resource``'s server on its socket (one left over is replaced)."""
        path = self.socket(resource)
        if not self.kubelet_dir.is_dir():
            raise ListenError(
                f"cannot listen in {self.kubelet_dir}: no such directory (give kubelet's"
                " device-plugin directory with --kubelet-dir, mounted from the host)"
            )
        path.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        dp_grpc.add_DevicePluginServicer_to_server(Servicer(self, resource), server)
        try:
            port = server.add_insecure_port(unix(path))
        except RuntimeError:  # grpcio raises where older versions returned 0
            port = 0
        if port == 0:
            raise ListenError(f"cannot listen on {path}: is {self.kubelet_dir} writable?")
        server.start()
        self.servers[resource] = server
        self.inodes[resource] = path.stat().st_ino

    def register(self, resource: str) -> None:
        """Register ``resource`` with kubelet; PluginError when kubelet refuses."""
        kubelet = self.kubelet_dir / KUBELET_SOCKET
        request = dp.RegisterRequest(
            version=API_VERSION,
            endpoint=SOCKETS[resource],
            resource_name=resource,
            options=dp.DevicePluginOptions(get_preferred_allocation_available=True),
        )
        try:
            with grpc.insecure_channel(unix(kubelet)) as channel:
                dp_grpc.RegistrationStub(channel).Register(request, timeout=RPC_TIMEOUT)
        except grpc.RpcError as e:
            raise PluginError(
                f"kubelet at {kubelet} refused {resource}: {e.code().name} {e.details()}"
            ) from None
        log.info("registered %s with kubelet", resource)

    def start(self) -> None:
        self.refresh_devices()
        for resource in RESOURCES:
            self.serve(resource)
            self.register(resource)
            self.registered.add(resource)

    def restarted(self) -> list[str]:
        """Resources whose socket is gone or replaced: kubelet empties its directory
        when it starts, and then expects every plugin to register again."""
        out = []
        for resource in RESOURCES:
            try:
                same = self.socket(resource).stat().st_ino == self.inodes.get(resource)
            except FileNotFoundError:
                same = False
            if not same:
                out.append(resource)
        return out

    def step(self) -> None:
        """One round of the loop: serve again after a kubelet restart, refresh the
        devices, reconcile. What fails is logged and tried again next round."""
        for resource in self.restarted():
            log.info("%s's socket is gone (kubelet restarted?): serving again", resource)
            self.registered.discard(resource)
            old = self.servers.pop(resource, None)
            if old is not None:
                old.stop(0)
            self.serve(resource)
        for resource in RESOURCES:
            # Until kubelet takes it: a kubelet still starting refuses, and is asked again.
            if resource not in self.registered:
                self.register(resource)
                self.registered.add(resource)
        self.refresh_devices()
        self.reconcile()

    def loop(self) -> None:
        """Rounds of :meth:`step` until :meth:`stop`."""
        while not self.stopping.wait(self.interval):
            try:
                self.step()
            except (Unreachable, NodeError, PluginError, grpc.RpcError, OSError) as e:
                log.warning("this round failed, trying again: %s", _why(e))
            except Exception:  # a fault of the plugin's own: logged whole, and served on
                log.exception("this round failed, trying again")

    def stop(self) -> None:
        self.stopping.set()
        with self.changed:
            self.changed.notify_all()
        for resource, server in self.servers.items():
            server.stop(1).wait(5)
            self.socket(resource).unlink(missing_ok=True)


def _why(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name} {e.details()}"
    return str(e)


class Servicer(dp_grpc.DevicePluginServicer):  # type: ignore[misc]
    """The device-plugin API for one resource."""

    def __init__(self, plugin: Plugin, resource: str) -> None:
        self.plugin = plugin
        self.resource = resource

    def GetDevicePluginOptions(self, request: Any, context: grpc.ServicerContext) -> Any:
        return dp.DevicePluginOptions(get_preferred_allocation_available=True)

    def ListAndWatch(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        yield from self.plugin.watch(self.resource, context)

    def GetPreferredAllocation(self, request: Any, context: grpc.ServicerContext) -> Any:
        return dp.PreferredAllocationResponse(
            container_responses=[
                dp.ContainerPreferredAllocationResponse(
                    deviceIDs=preferred(
                        list(r.available_deviceIDs),
                        list(r.must_include_deviceIDs),
                        r.allocation_size,
                    )
                )
                for r in request.container_requests
            ]
        )

    def Allocate(self, request: Any, context: grpc.ServicerContext) -> Any:
        responses = []
        for r in request.container_requests:
            try:
                responses.append(self.plugin.allocate(self.resource, list(r.devices_ids)))
            except Unreachable as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"nodemgr: {e}")
            except NodeError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"nodemgr: {e.message}")
            except ValueError as e:  # a quota no nodemgr request can carry (over 64 GPUs)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"gpushare: {e}")
        return dp.AllocateResponse(container_responses=responses)

    def PreStartContainer(self, request: Any, context: grpc.ServicerContext) -> Any:
        return dp.PreStartContainerResponse()


def preferred(available: list[str], must: list[str], size: int) -> list[str]:
    """The IDs to take: those that must be, then one per GPU in turn (a container's
    gpushare.io/gpus slots on distinct GPUs, its memory spread alike), in kubelet's order
    within a GPU."""
    chosen = list(dict.fromkeys(must))[:size]
    by_gpu: dict[int, list[str]] = {}
    for i in available:
        if i not in chosen:
            by_gpu.setdefault(gpu_of(i) or 0, []).append(i)
    queues = [by_gpu[g] for g in sorted(by_gpu)]
    used = {gpu_of(i) for i in chosen}
    # First the GPUs none of the chosen is on, then round after round.
    queues.sort(key=lambda q: gpu_of(q[0]) in used)
    while len(chosen) < size and any(queues):
        for q in queues:
            if q and len(chosen) < size:
                chosen.append(q.pop(0))
    return chosen
