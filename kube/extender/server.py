"""The extender's HTTP server: kube-scheduler's extender protocol (filter, prioritize,
bind; JSON in the shapes of k8s.io/kube-scheduler/extender/v1) over a :class:`View` of
the cluster that a background thread refreshes from the API server (docs/kubernetes.md,
"The scheduler extender")."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kube.apiserver import ApiError, ApiServer
from kube.extender.model import (
    DEFAULT_POLICY,
    UNKNOWN_NODE,
    Ask,
    ModelError,
    NodeInfo,
    View,
    ask,
    node_info,
)

log = logging.getLogger("gpushare.extender")

MAX_BODY = 64 << 20  # an ExtenderArgs of full Node objects for thousands of nodes


class Extender:
    """The protocol's three verbs over a view of the cluster; ``api`` None: nodes come
    only in the requests (nodeCacheCapable false) and bind is refused."""

    def __init__(
        self,
        api: ApiServer | None,
        policy: str = DEFAULT_POLICY,
        oversubscription: int = 4,
        refresh: float = 5.0,
    ) -> None:
        self.api = api
        self.policy = policy
        self.factor = oversubscription
        self.refresh_every = refresh
        self.lock = threading.Lock()
        self.view: View | None = None  # None: no node known yet
        self.infos: dict[str, NodeInfo] = {}
        self.bound: list[Ask] = []  # as the API server last listed them
        self.waiting: list[Ask] = []  # pods without a node, likewise
        # Pods this extender bound that the API server did not list bound yet.
        self.assumed: dict[str, tuple[Ask, float]] = {}
        self.stopping = threading.Event()

    # --- the view ----------------------------------------------------------------------

    def refresh(self) -> None:
        """The view anew from the API server: its nodes and the pods bound to them. It
        is built without the lock (requests go on with the old one meanwhile) and
        swapped in; a bind made during the build is held in the new view too."""
        if self.api is None:
            return
        nodes = []
        for n in self.api.nodes():
            try:
                nodes.append(node_info(n, self.factor))
            except ModelError as e:
                log.warning("%s: left out of the view", e)
        asks = []
        for p in self.api.pods():
            try:
                asks.append(ask(p))
            except ModelError as e:
                log.warning("%s", e)
        bound = [a for a in asks if a.node]
        waiting = [a for a in asks if not a.node]
        with self.lock:
            listed = {a.ident for a in bound}
            now = time.monotonic()
            for ident, (_, since) in list(self.assumed.items()):
                if ident in listed or now - since > 10 * self.refresh_every:
                    del self.assumed[ident]
            self.bound, self.waiting = bound, waiting
            assumed = dict(self.assumed)
        self._swap({n.name: n for n in nodes}, bound, assumed, waiting)

    def _swap(
        self,
        infos: dict[str, NodeInfo],
        bound: list[Ask],
        assumed: dict[str, tuple[Ask, float]],
        waiting: list[Ask],
    ) -> None:
        """Build the view of ``infos`` with the bound pods and those this extender bound
        (``assumed``), outside the lock; swap it in, with any bind made meanwhile."""
        view = None
        if infos:
            pods = {a.ident: a for a in bound}
            pods.update((ident, a) for ident, (a, _) in assumed.items())
            ordered = sorted(pods.values(), key=lambda a: (a.key, a.ident))
            view = View(list(infos.values()), ordered, self.policy, waiting=waiting)
            # The shapes of the pods the cluster runs and of those waiting, scored once
            # on every node: the first request of such a shape finds the scores kept.
            view.warm([*ordered, *waiting])
        with self.lock:
            if view is not None:
                for ident, (a, _) in self.assumed.items():
                    if ident not in assumed:  # bound while the view was built
                        view.place(a, a.node)
            self.view, self.infos = view, infos
        # The view lives until the next refresh: kept out of the collector's full passes,
        # which would otherwise walk it in the middle of requests; the old one, let go.
        gc.unfreeze()
        gc.collect()
        gc.freeze()

    def _nodes_from(self, args: Mapping[str, Any]) -> list[str]:
        """The candidate node names; full Node objects (nodeCacheCapable false) update
        the view's nodes when they differ."""
        items = (args.get("Nodes") or {}).get("items")
        if items:
            infos = [node_info(n, self.factor) for n in items]
            with self.lock:
                stale = any(self.infos.get(i.name) != i for i in infos)
                merged = {**self.infos, **{i.name: i for i in infos}}
                bound, assumed, waiting = self.bound, dict(self.assumed), self.waiting
            if stale:
                self._swap(merged, bound, assumed, waiting)
            return [i.name for i in infos]
        return [str(n) for n in args.get("NodeNames") or []]

    # --- the verbs ---------------------------------------------------------------------

    def filter(self, args: Mapping[str, Any]) -> dict[str, Any]:
        try:
            pod = ask(args.get("Pod") or {})
            names = self._nodes_from(args)
            with self.lock:
                passed: list[str] = []
                if self.view is None:
                    failed = dict.fromkeys(names, UNKNOWN_NODE)
                else:
                    passed, failed = self.view.filter(pod, names)
        except ModelError as e:
            return {"Nodes": None, "NodeNames": None, "FailedNodes": {}, "Error": str(e)}
        result: dict[str, Any] = {
            "NodeNames": passed,
            "FailedNodes": failed,
            "FailedAndUnresolvableNodes": {},
            "Error": "",
        }
        if (args.get("Nodes") or {}).get("items"):
            keep = set(passed)
            result["Nodes"] = {
                "items": [n for n in args["Nodes"]["items"] if n["metadata"]["name"] in keep]
            }
            result["NodeNames"] = None
        else:
            result["Nodes"] = None
        return result

    def prioritize(self, args: Mapping[str, Any]) -> list[dict[str, Any]]:
        pod = ask(args.get("Pod") or {})
        names = self._nodes_from(args)
        with self.lock:
            scores = {} if self.view is None else self.view.score(pod, names)
        return [{"Host": n, "Score": scores.get(n, 0)} for n in names]

    def bind(self, args: Mapping[str, Any]) -> dict[str, Any]:
        name, namespace = str(args.get("PodName") or ""), str(args.get("PodNamespace") or "")
        uid, node = str(args.get("PodUID") or ""), str(args.get("Node") or "")
        if self.api is None:
            return {"Error": "gpushare: this extender has no API server to bind with"}
        key = f"{namespace}/{name}"
        try:
            obj = self.api.pod(namespace, name)
            if obj is None:
                return {"Error": f"gpushare: no pod {key}"}
            pod = ask(obj)
            with self.lock:
                view = self.view
                if view is None or node not in view.index:
                    return {"Error": f"gpushare: node {node} not known to the extender"}
                if not view.place(pod, node):
                    return {"Error": f"gpushare: pod {key} no longer fits node {node}"}
                self.assumed[pod.ident] = (dataclasses.replace(pod, node=node), time.monotonic())
            try:
                self.api.bind(namespace, name, uid, node)
            except ApiError:
                with self.lock:
                    view.release(pod.ident)
                    self.assumed.pop(pod.ident, None)
                raise
        except (ApiError, ModelError) as e:
            return {"Error": f"gpushare: {e}"}
        return {"Error": ""}

    def loop(self) -> None:
        """Refresh the view until stopped; a failed refresh keeps the view it had."""
        while not self.stopping.is_set():
            try:
                self.refresh()
            except (ApiError, ModelError) as e:
                log.warning("refresh failed, keeping the view: %s", e)
            except Exception:  # a fault of its own: logged whole; the next one may do
                log.exception("refresh failed, keeping the view")
            self.stopping.wait(self.refresh_every)


def handler(extender: Extender) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[Mapping[str, Any]], Any]] = {
        "/filter": extender.filter,
        "/prioritize": extender.prioritize,
        "/bind": extender.bind,
    }

    class Handler(BaseHTTPRequestHandler):
        # Keep-alive, as kube-scheduler's client uses it; an answer's headers and body go
        # out at once (no Nagle wait for the client's delayed ACK between them).
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def _reply(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/healthz":
                self._reply(200, {"ok": True})
            else:
                self._reply(404, {"Error": f"no such path {self.path}"})

        def do_POST(self) -> None:
            route = routes.get(self.path.rstrip("/"))
            if route is None:
                self._reply(404, {"Error": f"no such verb {self.path}: filter, prioritize, bind"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self._reply(413, {"Error": f"request over {MAX_BODY} bytes"})
                return
            try:
                args = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(args, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                self._reply(400, {"Error": f"bad request: {e}"})
                return
            try:
                self._reply(200, route(args))
            except ModelError as e:
                self._reply(400, {"Error": str(e)})
            except Exception as e:  # a fault of the extender's own: answered, and logged
                log.exception("%s failed", self.path)
                self._reply(500, {"Error": f"gpushare: internal error: {e}"})

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

    return Handler


def serve(extender: Extender, host: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), handler(extender))
    server.daemon_threads = True
    return server
