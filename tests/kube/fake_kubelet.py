"""A fake kubelet for the device plugin's tests: a real gRPC Registration server on
kubelet.sock in a device-plugin directory, a real pod-resources server, and calls into
the plugin's sockets as kubelet makes them."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from kube.proto import deviceplugin_pb2 as dp
from kube.proto import deviceplugin_pb2_grpc as dp_grpc
from kube.proto import podresources_pb2 as pr
from kube.proto import podresources_pb2_grpc as pr_grpc


class _Registration(dp_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    def Register(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self.kubelet.lock:
            self.kubelet.registered.append(request)
            refuse = self.kubelet.refuse
        if refuse:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, refuse)
        return dp.Empty()


class _PodResources(pr_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self.kubelet.lock:
            pods = list(self.kubelet.pods)
        return pr.ListPodResourcesResponse(pod_resources=pods)


class FakeKubelet:
    """kubelet.sock in ``plugins_dir`` and a pod-resources socket at ``pod_resources``."""

    def __init__(self, plugins_dir: Path, pod_resources: Path) -> None:
        self.plugins_dir = plugins_dir
        self.pod_resources = pod_resources
        self.lock = threading.Lock()
        self.registered: list[Any] = []
        self.refuse = ""
        self.pods: list[Any] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        dp_grpc.add_RegistrationServicer_to_server(_Registration(self), self.server)
        pr_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self), self.server)
        plugins_dir.mkdir(parents=True, exist_ok=True)
        pod_resources.parent.mkdir(parents=True, exist_ok=True)
        self.server.add_insecure_port(f"unix://{plugins_dir / 'kubelet.sock'}")
        self.server.add_insecure_port(f"unix://{pod_resources}")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0).wait(10)

    def registrations(self) -> list[tuple[str, str, str]]:
        with self.lock:
            return [(r.version, r.endpoint, r.resource_name) for r in self.registered]

    def set_pods(self, pods: Sequence[tuple[str, str, str, dict[str, list[str]]]]) -> None:
        """The live containers: (namespace, pod, container, device IDs by resource)."""
        made = []
        for namespace, pod, container, ids in pods:
            devices = [pr.ContainerDevices(resource_name=r, device_ids=v) for r, v in ids.items()]
            made.append(
                pr.PodResources(
                    name=pod,
                    namespace=namespace,
                    containers=[pr.ContainerResources(name=container, devices=devices)],
                )
            )
        with self.lock:
            self.pods = made

    def plugin(self, socket: str) -> tuple[grpc.Channel, Any]:
        """A channel to the plugin's ``socket`` (a name in the directory) and its stub."""
        channel = grpc.insecure_channel(f"unix://{self.plugins_dir / socket}")
        return channel, dp_grpc.DevicePluginStub(channel)

    def list_devices(self, socket: str, timeout: float = 10.0) -> list[tuple[str, str]]:
        """ListAndWatch's first answer, as kubelet reads it: (ID, health) pairs."""
        channel, stub = self.plugin(socket)
        with channel:
            stream = stub.ListAndWatch(dp.Empty(), timeout=timeout)
            first = next(stream)
            stream.cancel()
        return [(d.ID, d.health) for d in first.devices]

    def allocate(self, socket: str, ids: list[str], timeout: float = 10.0) -> Any:
        """Allocate one container's ``ids``, as kubelet does after choosing them."""
        channel, stub = self.plugin(socket)
        with channel:
            request = dp.AllocateRequest(
                container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)]
            )
            return stub.Allocate(request, timeout=timeout).container_responses[0]

    def preferred(self, socket: str, available: list[str], size: int) -> list[str]:
        channel, stub = self.plugin(socket)
        with channel:
            request = dp.PreferredAllocationRequest(
                container_requests=[
                    dp.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available, allocation_size=size
                    )
                ]
            )
            got = stub.GetPreferredAllocation(request, timeout=10.0)
        return list(got.container_responses[0].deviceIDs)
