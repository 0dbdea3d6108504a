"""nodemgr.protocol on arbitrary input: only ProtocolError ever comes out."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from nodemgr import protocol
from nodemgr.protocol import Err, ProtocolError


def nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@pytest.mark.parametrize("depth", [10, 500, 990])
def test_deeply_nested_version_is_unsupported_not_a_crash(depth: int) -> None:
    # Regression: the error message was built with repr(v), which raised
    # RecursionError for a ~1000-deep v, so nodemgr answered "internal".
    frame = msgpack.packb({"v": nested(depth), "type": "status"})
    with pytest.raises(ProtocolError) as e:
        protocol.decode(frame)
    assert e.value.code == Err.UNSUPPORTED_VERSION
    assert len(e.value.message) < 300


def test_huge_version_makes_a_short_message() -> None:
    for v in ("x" * 60_000, b"\xff" * 60_000, list(range(10_000))):
        with pytest.raises(ProtocolError) as e:
            protocol.decode(msgpack.packb({"v": v, "type": "status"}))
        assert e.value.code == Err.UNSUPPORTED_VERSION
        assert len(e.value.message) < 300


@pytest.mark.parametrize("name", ["alice\n", "a\n", "0123456789abcdef\n"])
def test_names_with_a_trailing_newline_are_refused(name: str) -> None:
    # Regression: ENV_NAME/TASK_ID end in "$", which re.match lets match before a
    # final "\n", so quota_set created an environment (and directory) "alice\n".
    for fields, schemas in [
        ({"type": "quota_set", "env": name, "gpus": 1, "memory": 1}, protocol.ADMIN_REQUESTS),
        ({"type": "quota_show", "env": name}, protocol.ADMIN_REQUESTS),
        ({"type": "heartbeat", "task_id": name}, protocol.TASK_REQUESTS),
    ]:
        with pytest.raises(ProtocolError) as e:
            protocol.validate({"v": 1, "id": 0, **fields}, schemas)
        assert e.value.code == Err.BAD_REQUEST
