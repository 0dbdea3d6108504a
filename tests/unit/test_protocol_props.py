"""gpushare.protocol and gpushare.messages on arbitrary input: only ProtocolError ever
comes out.

Hypothesis properties over arbitrary bytes, arbitrary msgpack objects and maps shaped
like messages, generated from the message classes (new types and fields are covered
without touching this file); then regression tests for what fuzzing found.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare import messages, protocol
from gpushare.messages import Message, Schema, schema
from gpushare.protocol import Err, ProtocolError
from tests.conftest import accepts

Table = Mapping[str, type[Message]]

# Fast, and nothing written to a example database in the repository.
FAST = settings(max_examples=400, deadline=None, database=None)

TABLES: dict[str, Table] = {"task": messages.TASK_REQUESTS, "admin": messages.ADMIN_REQUESTS}
TYPES = sorted({kind for table in TABLES.values() for kind in table})
FIELDS = sorted({name for t in TABLES.values() for cls in t.values() for name in schema(cls)})
ERROR_CODES = frozenset(v for k, v in vars(Err).items() if k.isupper() and isinstance(v, str))

ints = st.integers(-(1 << 63), (1 << 64) - 1)  # all msgpack can carry
scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    st.floats(),
    st.text(),
    st.binary(),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)),
    st.builds(msgpack.Timestamp, st.integers(-(1 << 33), 1 << 33), st.integers(0, 10**9 - 1)),
)
keys = st.one_of(st.text(), st.binary(), ints, st.booleans(), st.none())
objects = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=12,
)
# As msgpack carries them: nodemgr unpacks with strict_map_key (str and bin keys only).
plain_objects = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text() | st.binary(), inner, max_size=4)
    ),
    max_leaves=12,
)
# Boundaries and look-alikes of what fields take.
SAMPLES: list[Any] = [
    *[0, 1, 2, 4, 63, 64, 65, -1, (1 << 31) - 1, 1 << 31, -(1 << 31) - 1],
    *[(1 << 63) - 1, 1 << 63, (1 << 64) - 1, -(1 << 63), 1.0, True, None],
    *["", "a", "a" * 64, "a" * 65, "0123456789abcdef", "x" * 4096, "x" * 4097, "a\n", b"a"],
]
field_values = st.one_of(
    st.sampled_from(SAMPLES),
    st.integers(-3, 70),
    ints,
    st.from_regex(protocol.ENV_NAME),  # not fullmatch: look-alikes with a trailing "\n" too
    st.from_regex(protocol.TASK_ID),
    st.text(max_size=40),
    plain_objects,
)
extra_fields = st.dictionaries(st.text(max_size=10), plain_objects, max_size=3)


@st.composite
def message_like(draw: st.DrawFn) -> dict[str, Any]:
    """A map with v, type and id mostly right, any schema's fields and unknown ones."""

    def mostly(likely: st.SearchStrategy[Any], otherwise: st.SearchStrategy[Any]) -> Any:
        return draw(draw(st.sampled_from([likely] * 4 + [otherwise])))

    msg = mostly(extra_fields, st.dictionaries(keys, objects, max_size=3))
    for name in FIELDS:
        if draw(st.booleans()):
            msg[name] = draw(field_values)
    if mostly(st.just(True), st.just(False)):
        msg["v"] = mostly(st.just(protocol.PROTOCOL_VERSION), objects)
    if mostly(st.just(True), st.just(False)):
        msg["type"] = mostly(st.sampled_from(TYPES), objects)
    if draw(st.booleans()):
        msg["id"] = mostly(st.integers(0, (1 << 63) - 1), objects)
    return dict(msg)


@st.composite
def valid_message(draw: st.DrawFn) -> tuple[dict[str, Any], Table]:
    """A message its table accepts, built from the schema: each field an arbitrary value
    its validator accepts (else a sample it accepts), optional fields at random."""
    table = TABLES[draw(st.sampled_from(sorted(TABLES)))]
    kind = draw(st.sampled_from(sorted(table)))
    msg: dict[str, Any] = {k: v for k, v in draw(extra_fields).items() if k not in FIELDS}
    msg |= {"v": protocol.PROTOCOL_VERSION, "type": kind}
    if draw(st.booleans()):
        msg["id"] = draw(st.integers(0, (1 << 63) - 1))
    for name, (required, check) in schema(table[kind]).items():
        if not required and draw(st.booleans()):
            continue
        value = draw(field_values)
        if not accepts(check, value):
            samples = [s for s in SAMPLES if accepts(check, s)]
            if not samples:
                continue  # validate may refuse a required field: checked, not assumed
            value = draw(st.sampled_from(samples))
        msg[name] = value
    return msg, table


def check_decode(frame: bytes) -> dict[str, Any] | None:
    """decode's contract: a message with int id, str type and v 1, or ProtocolError."""
    try:
        msg = protocol.decode(frame)
    except ProtocolError as e:
        assert e.code in (Err.BAD_REQUEST, Err.UNSUPPORTED_VERSION)
        assert isinstance(e.message, str) and "\n" not in e.message
        return None
    assert isinstance(msg, dict)
    assert msg["v"] == protocol.PROTOCOL_VERSION
    assert isinstance(msg["type"], str)
    assert type(msg["id"]) is int and 0 <= msg["id"] < 1 << 63
    again = protocol.encode(msg)
    assert protocol.encode(protocol.decode(again)) == again
    return msg


def check_validate(msg: dict[str, Any], table: Table) -> Message | None:
    """parse's contract: the type's class, exactly its fields, checked, or ProtocolError."""
    try:
        request = messages.parse(msg, table)
    except ProtocolError as e:
        expected = Err.BAD_REQUEST if msg["type"] in table else Err.UNKNOWN_TYPE
        assert e.code == expected, e.message
        assert isinstance(e.message, str) and "\n" not in e.message
        return None
    fields: Schema = schema(table[msg["type"]])
    body = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
    assert set(body) == set(fields)
    for name, (required, check) in fields.items():
        if name in msg:
            assert protocol.encode(body[name]) == protocol.encode(check(msg[name]))
        else:
            assert not required and body[name] is None
    return request


@FAST
@given(st.binary(max_size=4096))
def test_decode_arbitrary_bytes(frame: bytes) -> None:
    check_decode(frame)


@FAST
@given(objects, st.booleans())
def test_decode_arbitrary_objects(obj: Any, bin_type: bool) -> None:
    check_decode(msgpack.packb(obj, use_bin_type=bin_type))


@FAST
@given(message_like(), st.booleans())
def test_decode_and_validate_message_like_maps(msg: dict[str, Any], bin_type: bool) -> None:
    decoded = check_decode(msgpack.packb(msg, use_bin_type=bin_type))
    if decoded is None:
        return
    for table in TABLES.values():
        check_validate(decoded, table)
        # The same fields under each type of the table: every validator sees them.
        for kind in table:
            check_validate({**decoded, "type": kind}, table)


@FAST
@given(valid_message())
def test_valid_messages_round_trip(case: tuple[dict[str, Any], Table]) -> None:
    msg, table = case
    frame = protocol.encode(msg)
    decoded = protocol.decode(frame)
    expected = dict(msg)
    expected["id"] = msg.get("id", 0)  # decode fills in the default id
    assert protocol.encode(decoded) == protocol.encode(expected)
    assert protocol.encode(protocol.decode(protocol.encode(decoded))) == protocol.encode(decoded)
    body = check_validate(decoded, table)
    if all(name in msg for name, (required, _) in schema(table[msg["type"]]).items() if required):
        assert body is not None, msg


# --- regressions ----------------------------------------------------------------------


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
    cases: list[tuple[dict[str, Any], Table]] = [
        ({"type": "quota_set", "env": name, "gpus": 1, "memory": 1}, messages.ADMIN_REQUESTS),
        ({"type": "quota_show", "env": name}, messages.ADMIN_REQUESTS),
        ({"type": "heartbeat", "task_id": name}, messages.TASK_REQUESTS),
    ]
    for fields, table in cases:
        with pytest.raises(ProtocolError) as e:
            messages.parse({"v": 1, "id": 0, **fields}, table)
        assert e.value.code == Err.BAD_REQUEST
