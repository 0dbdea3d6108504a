"""What a pod asks gpushare for on Kubernetes, and what a node offers: one home for the
resource names, their units and the device IDs the plugin advertises (docs/kubernetes.md,
"Resources").

A dev environment's pod asks, per container, for ``gpushare.io/gpus`` (the GPUs its tasks
may hold at once: nodemgr's GPU-count quota) and ``gpushare.io/gpu-memory`` (GiB over
those GPUs: the per-GPU memory quota is this divided by the GPU count). A node offers each
GPU ``oversubscription`` times over in both: quotas oversubscribe a node safely because
nodemgr grants GPUs only while a task runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gpushare.protocol import BE, CLASSES

DOMAIN = "gpushare.io"
GPUS = f"{DOMAIN}/gpus"
GPU_MEMORY = f"{DOMAIN}/gpu-memory"
RESOURCES = (GPUS, GPU_MEMORY)
# One unit of gpushare.io/gpu-memory.
MEMORY_UNIT = 1 << 30
# The kubelet's directory of device-plugin sockets (its own kubelet.sock among them), and
# its pod-resources socket.
KUBELET_DIR = Path("/var/lib/kubelet/device-plugins")
POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
# The plugin's socket in the kubelet's device-plugin directory, per resource.
SOCKETS = {GPUS: "gpushare-gpus.sock", GPU_MEMORY: "gpushare-gpu-memory.sock"}
# An environment the plugin made for a container: this prefix, then a digest of the
# device IDs it was first allocated (nodemgr's names: [A-Za-z0-9][A-Za-z0-9_.-]{0,63}).
ENV_PREFIX = "k8s-"
# On each Allocate answer: the environment the container's devices make.
ENV_ANNOTATION = f"{DOMAIN}/env"
# Optional, on the pod: its tasks' class (seed 000: the device plugin sets it on the
# environment, the extender places by it) and the GPU models it accepts (seed 003).
CLASS_ANNOTATION = f"{DOMAIN}/class"
MODEL_ANNOTATION = f"{DOMAIN}/gpu-model"
# On the node: its GPU model (what a pod's MODEL_ANNOTATION names), and its
# oversubscription where it is not the extender's --oversubscription.
MODEL_LABEL = MODEL_ANNOTATION
OVERSUBSCRIPTION_LABEL = f"{DOMAIN}/oversubscription"

_PREFIX = {GPUS: "gpu", GPU_MEMORY: "mem"}


def device_ids(resource: str, gpu: int, count: int) -> list[str]:
    """The IDs GPU ``gpu`` advertises for ``resource``: ``gpu3-0`` ... (gpus) or
    ``mem3-0`` ... (gpu-memory), ``count`` of them."""
    return [f"{_PREFIX[resource]}{gpu}-{k}" for k in range(count)]


def gpu_of(device_id: str) -> int | None:
    """The GPU index a device ID names; None for an ID the plugin never made."""
    for prefix in _PREFIX.values():
        head, sep, tail = device_id.partition("-")
        if sep and head.startswith(prefix) and head[len(prefix) :].isdigit() and tail.isdigit():
            return int(head[len(prefix) :])
    return None


def pod_class(annotations: Mapping[str, Any]) -> str:
    """The class a pod's CLASS_ANNOTATION names, as nodemgr's wire does (``ls`` or
    ``be``; best-effort where it names none); ValueError for any other value."""
    cls = str(annotations.get(CLASS_ANNOTATION, BE)).lower()
    if cls not in CLASSES:
        raise ValueError(f"annotation {CLASS_ANNOTATION} is {cls!r}, not {' or '.join(CLASSES)}")
    return cls


def env_name(ids: Iterable[str]) -> str:
    """The environment named after the device IDs a container was first allocated."""
    digest = hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()
    return f"{ENV_PREFIX}{digest[:16]}"
