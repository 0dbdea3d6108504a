"""The Kubernetes API server, as much of it as gpushare reads and writes: the nodes and
the pods (the extender; a pod's class, the device plugin) and a pod's binding (the
extender; docs/kubernetes.md). Plain HTTPS with the service account's token; no client
library."""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT = 10.0
# Seconds a token read from a file is used before the file is read again: kubelet
# rewrites a pod's service account token well before it expires.
TOKEN_REREAD = 60.0


class ApiError(Exception):
    """The API server could not be read or refused a write: the message says which."""


class ApiServer:
    """``url`` (``https://HOST:PORT``), with a bearer ``token``, or one read from
    ``token_file`` (again every TOKEN_REREAD seconds), and the ``ca`` file that signs
    its certificate where given."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        ca: Path | None = None,
        token_file: Path | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.token_file = token_file
        self._token_read = -TOKEN_REREAD
        self.context = ssl.create_default_context(cafile=str(ca)) if ca else None
        if token_file is not None:
            self._bearer()  # a file that cannot be read is said now

    @classmethod
    def in_cluster(cls) -> ApiServer:
        """The API server a pod reaches: its service's address and the pod's account."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ApiError("not in a cluster (no KUBERNETES_SERVICE_HOST): give --api-server URL")
        return cls(
            f"https://{host}:{port}",
            ca=SERVICE_ACCOUNT / "ca.crt",
            token_file=SERVICE_ACCOUNT / "token",
        )

    def _bearer(self) -> str | None:
        if self.token_file is not None:
            now = time.monotonic()
            if now - self._token_read >= TOKEN_REREAD:
                try:
                    self.token = self.token_file.read_text().strip()
                except OSError as e:
                    raise ApiError(f"no token at {self.token_file}: {e}") from None
                self._token_read = now
        return self.token

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        token = self._bearer()
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT, context=self.context) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise ApiError(f"{method} {path}: {e.code} {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ApiError(f"{method} {path}: {e}") from None

    def nodes(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/nodes").get("items") or [])

    def pods(self) -> list[dict[str, Any]]:
        """Pods that hold resources: bound or not, but not finished."""
        query = urllib.parse.urlencode(
            {"fieldSelector": "status.phase!=Succeeded,status.phase!=Failed"}
        )
        return list(self._call("GET", f"/api/v1/pods?{query}").get("items") or [])

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """One pod; None when there is none of that name."""
        ns, pod = urllib.parse.quote(namespace), urllib.parse.quote(name)
        try:
            got = self._call("GET", f"/api/v1/namespaces/{ns}/pods/{pod}")
        except ApiError as e:
            if " 404 " in str(e):
                return None
            raise
        return dict(got)

    def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        ns, pod = urllib.parse.quote(namespace), urllib.parse.quote(name)
        self._call("POST", f"/api/v1/namespaces/{ns}/pods/{pod}/binding", body)
