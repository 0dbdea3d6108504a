"""Holds one grant for a test from a process of its own: ``python grant_holder.py ENDPOINT``.

It prints one JSON line, the grant (or ``{"error": CODE, "message": ...}`` and exits 1),
then heartbeats at the grant's interval until its stdin closes, says ``done`` and exits.
nodemgr watches this process, not the test's: a late heartbeat under load gets this
process killed, never the test run. tests/conftest.py's ``Holder`` runs it.
"""

from __future__ import annotations

import contextlib
import json
import select
import sys

from nodemgr.client import Connection, NodeError, Unreachable


def main(endpoint: str) -> int:
    with Connection(endpoint) as conn:
        try:
            grant = conn.call("request", gpus=1)
        except NodeError as e:
            print(json.dumps({"error": e.code, "message": e.message}), flush=True)
            return 1
        print(json.dumps(grant), flush=True)
        task_id = str(grant["task_id"])
        interval = float(grant["heartbeat_interval"])
        while True:
            ready, _, _ = select.select([sys.stdin], [], [], interval)
            if ready and not sys.stdin.readline():
                break  # the test is done with it
            # nodemgr restarting: the task is restored, and the next beat re-attaches it.
            with contextlib.suppress(Unreachable):
                # A beat lost in the restart must not hold up the next past the timeout.
                conn.call("heartbeat", timeout=0.5, task_id=task_id)
        conn.call("done", task_id=task_id)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
