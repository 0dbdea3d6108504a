"""gpushare.paths: the rules nodemgr and its clients share for endpoints and ledgers."""

from __future__ import annotations

from pathlib import Path

from gpushare import paths


def test_an_ipc_endpoint_names_its_socket_and_the_ledger_beside_it() -> None:
    endpoint = paths.endpoint(paths.env_dir(Path("/run/gs"), "alice") / paths.TASK_SOCKET)
    assert endpoint == "ipc:///run/gs/envs/alice/task.sock"
    assert paths.socket_of(endpoint) == "/run/gs/envs/alice/task.sock"
    assert paths.ledger_beside(endpoint) == "/run/gs/envs/alice/ledger"


def test_other_transports_name_no_socket() -> None:
    assert paths.socket_of("tcp://127.0.0.1:5555") is None
    assert paths.socket_of("ipc://") == ""  # an empty path: callers refuse it
