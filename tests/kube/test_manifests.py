"""The Kubernetes manifests in configs/kubernetes: each valid against Kubernetes' own
schemas (kubernetes-validate, strict, the version docs/kubernetes.md names), and each
agreeing with the code it deploys (docs/kubernetes.md, "Install")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kube.extender.model import ask
from kube.resources import RESOURCES
from nodemgr import config

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "configs" / "kubernetes"
# The Kubernetes version the manifests are written for (docs/kubernetes.md).
KUBERNETES = "1.35.0"


def _documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]


def _all() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted(MANIFESTS.glob("*.yaml")) for d in _documents(p.name)]


def test_the_manifests_are_there() -> None:
    kinds = {d["kind"] for _, d in _all()}
    assert {
        "Namespace",
        "ConfigMap",
        "DaemonSet",
        "Deployment",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "RoleBinding",
        "Pod",
    } <= kinds


@pytest.mark.parametrize(("name", "doc"), _all(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_manifest_is_valid_kubernetes(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def _one(name: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _documents(name) if d["kind"] == kind]
    return doc


def test_the_scheduler_config_names_what_the_extender_serves() -> None:
    cm = _one("scheduler-config.yaml", "ConfigMap")
    cfg = yaml.safe_load(cm["data"]["scheduler-config.yaml"])
    assert cfg["kind"] == "KubeSchedulerConfiguration"
    assert cfg["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    (ext,) = cfg["extenders"]
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["bindVerb"]) == (
        "filter",
        "prioritize",
        "bind",
    )
    assert ext["nodeCacheCapable"] is True
    assert sorted(r["name"] for r in ext["managedResources"]) == sorted(RESOURCES)
    deployment = _one("scheduler.yaml", "Deployment")
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    command = containers["extender"]["command"]
    listen = command[command.index("--listen") + 1]
    assert ext["urlPrefix"] == f"http://{listen}"
    assert cfg["profiles"][0]["schedulerName"] == "gpushare-scheduler"
    pod = _one("example-pod.yaml", "Pod")
    assert pod["spec"]["schedulerName"] == "gpushare-scheduler"
    assert pod["spec"]["runtimeClassName"] == "nvidia"


def test_the_node_config_is_a_nodemgr_config(tmp_path: Path) -> None:
    cm = _one("nodemgr-config.yaml", "ConfigMap")
    f = tmp_path / "nodemgr.toml"
    f.write_text(cm["data"]["nodemgr.toml"])
    loaded = config.load(f)
    assert loaded.run_dir == Path("/run/gpushare")
    daemonset = _one("node-daemonset.yaml", "DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    plugin = next(c for c in spec["containers"] if c["name"] == "device-plugin")
    mounts = {m["mountPath"] for m in plugin["volumeMounts"]}
    # The plugin reaches nodemgr's admin socket and state, and kubelet's two sockets.
    assert {
        str(loaded.run_dir),
        str(loaded.state_dir),
        "/var/lib/kubelet/device-plugins",
        "/var/lib/kubelet/pod-resources",
    } <= mounts
    assert not plugin["securityContext"].get("privileged")
    # It finds the host's NVIDIA device nodes through a read-only view of the host's /dev.
    host_dev = plugin["command"][plugin["command"].index("--host-dev") + 1]
    (dev,) = [m for m in plugin["volumeMounts"] if m["mountPath"] == host_dev]
    assert dev["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == dev["name"]]
    assert volume["hostPath"]["path"] == "/dev"
    # Its account may read pods (their class), and no more.
    account = spec["serviceAccountName"]
    (binding,) = [d for d in _documents("node-rbac.yaml") if d["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "gpushare-system"}
    ]
    role = _one("node-rbac.yaml", "ClusterRole")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]


def test_the_example_pod_asks_as_the_extender_reads_it() -> None:
    got = ask(_one("example-pod.yaml", "Pod"))
    assert (got.gpus, got.gpu_memory, got.qos) == (1, 24, "LS")
