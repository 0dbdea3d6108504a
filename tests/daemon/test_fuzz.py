"""Fuzz a live nodemgr's task and admin endpoints with malformed and mutated messages.

Messages are generated from the message classes in gpushare.messages, so new message types
and fields are fuzzed without touching this file. The fuzzed environment "fz" has a
GPU quota of 0: every well-formed request on its endpoint is refused, so nothing the
fuzzer sends there may change the node. On the admin endpoint the fuzzer never sends
a message that validates as a type in MUTATING_ADMIN (checked here before sending).

Every message (but one with a frame over MAX_MESSAGE_BYTES, whose connection nodemgr
drops unread) must get exactly one reply, decided by the same decode/validate as
nodemgr's: a message this process rejects must be answered with that error code; no
reply may be "internal".

The run is reproducible from its seed: GPUSHARE_FUZZ_SEED=N pytest tests/daemon/test_fuzz.py
"""

from __future__ import annotations

import collections
import math
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from gpushare import messages, protocol
from gpushare.client import Connection
from gpushare.messages import Message as WireMessage
from gpushare.messages import Schema, parse, schema
from gpushare.protocol import Err, ProtocolError
from tests.conftest import accepts

SEED = int(os.environ.get("GPUSHARE_FUZZ_SEED", "20240917"))
MESSAGES_PER_ENDPOINT = 10_000
WINDOW = 100  # outstanding messages per endpoint
REPLY_TIMEOUT_MS = 10_000
GiB = 1 << 30
MAX = protocol.MAX_MESSAGE_BYTES

# The only hand-kept list: admin types that change state, never sent valid. Types
# not in the schemas are simply unused.
MUTATING_ADMIN = frozenset(
    {"quota_set", "quota_delete", "reclaim", "pause", "resume", "drain", "idle_set"}
)

PRINTABLE = bytes(0x20 + b % 0x5F for b in range(256))
ERROR_CODES = frozenset(v for k, v in vars(Err).items() if k.isupper() and isinstance(v, str))
# Codes only decode/validate give; a message valid here must never get them.
ENVELOPE_CODES = frozenset({Err.UNSUPPORTED_VERSION, Err.UNKNOWN_TYPE})

INTS = [
    0,
    1,
    2,
    3,
    4,
    5,
    16,
    63,
    64,
    65,
    -1,
    -2,
    1 << 20,
    GiB,
    2 * GiB,
    (1 << 31) - 1,
    1 << 31,
    (1 << 31) + 1,
    -(1 << 31),
    -(1 << 31) - 1,
    (1 << 32) - 1,
    1 << 32,
    (1 << 63) - 1,
    1 << 63,
    (1 << 64) - 1,
    -(1 << 63),
]
# Values a schema field may accept; a valid message takes each field from those its
# validator accepts.
CANDIDATES: list[Any] = [
    None,
    True,
    False,
    *INTS,
    0.0,
    1.0,
    1.5,
    -0.5,
    "",
    "fz",
    "ok",
    "nobody",
    "a" * 64,
    "a" * 65,
    "0123456789abcdef",
    "ffffffffffffffff",
    "x" * 23,
    "x" * 24,
    "sleep 30",
    "x" * 4096,
    "x" * 4097,
    "a\n",
    "../etc",
    "a/b",
    "é",
    b"fz",
    [],
    {},
    [1],
    {"a": 1},
]


def expect(payload: bytes, table: Mapping[str, type[WireMessage]]) -> tuple[str, Any, int]:
    """What nodemgr must answer: ("error", code, id), ("ok", type, id), or ("crash", repr, 0)
    when this process's own decode/validate raised something other than ProtocolError."""
    msg_id = 0
    try:
        msg = protocol.decode(payload)
        msg_id = msg["id"]
        parse(msg, table)
    except ProtocolError as e:
        return ("error", e.code, msg_id)
    except Exception as e:
        return ("crash", f"{type(e).__name__}: {e}"[:200], msg_id)
    return ("ok", msg["type"], msg_id)


@dataclass
class Message:
    index: int
    frames: list[bytes]
    how: list[str]
    expected: tuple[str, Any, int] = ("", None, 0)

    @property
    def oversize(self) -> bool:
        """Over the size of a message in all its frames, or over their number: the
        sender's connection is dropped."""
        return sum(map(len, self.frames)) > MAX or len(self.frames) > protocol.MAX_FRAMES

    @property
    def unanswered(self) -> bool:
        """Not one map after at most an empty delimiter (protocol.envelope_ok): dropped
        unread, on a connection that stays."""
        return not self.oversize and not protocol.envelope_ok(list(map(len, self.frames)))

    def describe(self) -> str:
        head = self.frames[-1][:80].hex() if self.frames else ""
        sizes = [len(f) for f in self.frames]
        return f"#{self.index} via {'+'.join(self.how)} frames={sizes} payload[:80]={head}"


class Fuzzer:
    """Messages for one endpoint: ``table`` are its own types, ``foreign`` the other's."""

    def __init__(
        self,
        rng: random.Random,
        table: Mapping[str, type[WireMessage]],
        foreign: Mapping[str, type[WireMessage]],
    ) -> None:
        self.rng = rng
        self.table = table
        self.schemas: dict[str, Schema] = {k: schema(c) for k, c in table.items()}
        self.foreign = foreign
        self.valid_values = {
            (kind, name): [c for c in CANDIDATES if accepts(check, c, Exception)]
            for kind, fields in self.schemas.items()
            for name, (_, check) in fields.items()
        }

    # --- values ------------------------------------------------------------------

    def text(self, n: int) -> str:
        """n characters: printable ASCII, or any code points (a repeated run of at most 64)."""
        rng = self.rng
        if rng.random() < 0.7:
            return rng.randbytes(n).translate(PRINTABLE).decode()
        run = []
        for _ in range(min(n, 64)):
            c = rng.randrange(0x110000)
            run.append(chr(c if not 0xD800 <= c < 0xE000 else c - 0x800))  # no surrogates
        return ("".join(run) * (n // 64 + 1))[:n]

    def scalar(self) -> Any:
        rng = self.rng
        pick = rng.randrange(10)
        if pick == 0:
            return None
        if pick == 1:
            return rng.random() < 0.5
        if pick == 2:
            return rng.choice(INTS)
        if pick == 3:
            return rng.randint(-(1 << 63), (1 << 64) - 1)
        if pick == 4:
            return rng.choice([math.nan, math.inf, -math.inf, -0.0, 1e308, rng.uniform(-1e9, 1e9)])
        if pick in (5, 6):
            return self.text(rng.choice([0, 1, 2, 8, 30, rng.randrange(300)]))
        if pick == 7:
            return rng.randbytes(rng.randrange(40))
        if pick == 8:
            # Extension types (raw bytes add the reserved ones, bad timestamps included).
            if rng.random() < 0.3:
                return msgpack.Timestamp(rng.randrange(-(1 << 33), 1 << 34), rng.randrange(10**9))
            return msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.choice([0, 1, 4, 8, 3])))
        return rng.choice(CANDIDATES)

    def key(self) -> Any:
        rng = self.rng
        if rng.random() < 0.8:
            return rng.choice(
                [
                    self.text(rng.randrange(1, 12)),
                    "v",
                    "type",
                    "id",
                    *sorted({n for s in self.schemas.values() for n in s}),
                ]
            )
        return rng.choice([rng.choice(INTS), b"type", None, True, 1.5])

    def deep(self) -> Any:
        """A chain of lists/maps nested nearly as deep as msgpack allows."""
        depth = self.rng.choice([10, 100, 500, 900, 990, self.rng.randrange(1, 1000)])
        value: Any = self.scalar()
        for b in self.rng.randbytes(depth):
            value = [value] if b < 180 else {"k": value}
        return value

    def obj(self, depth: int = 0) -> Any:
        rng = self.rng
        r = rng.random()
        if depth >= 4 or r < 0.5:
            return self.scalar()
        if r < 0.7:
            return [self.obj(depth + 1) for _ in range(rng.randrange(6))]
        if r < 0.95:
            return {self.key(): self.obj(depth + 1) for _ in range(rng.randrange(6))}
        return self.deep()

    # --- messages ----------------------------------------------------------------

    def valid(self) -> dict[str, Any]:
        rng = self.rng
        kind = rng.choice(sorted(self.schemas))
        msg: dict[str, Any] = {"v": protocol.PROTOCOL_VERSION, "type": kind}
        if rng.random() < 0.8:
            msg["id"] = rng.choice([0, 1, rng.randrange(1 << 32), (1 << 63) - 1])
        for name, (required, _) in self.schemas[kind].items():
            values = self.valid_values[(kind, name)]
            if values and (required or rng.random() < 0.6):
                msg[name] = rng.choice(values)
        if messages.REQUIRED_FEATURES[0] in self.schemas[kind] and not all(
            self.schemas[kind][name][0] for name in messages.REQUIRED_FEATURES
        ):
            # A dry run's features come together (docs/protocol.md): all four and some of
            # the others, or none, as a client sends them.
            keep = rng.random() < 0.6
            for name in messages.FEATURE_FIELDS:
                if keep and name in messages.REQUIRED_FEATURES:
                    msg[name] = rng.choice(self.valid_values[(kind, name)])
                elif not keep:
                    msg.pop(name, None)
        return msg

    def mutate(self, msg: dict[str, Any], how: list[str]) -> None:
        rng = self.rng
        op = rng.randrange(9)
        keys = list(msg)
        if op == 0 and keys:
            how.append("drop")
            del msg[rng.choice(keys)]
        elif op == 1 and keys:
            how.append("retype")
            msg[rng.choice(keys)] = self.obj(rng.randrange(3))
        elif op == 2 and keys:
            how.append("range")
            msg[rng.choice(keys)] = rng.choice(INTS) + rng.choice([0, 0, -1, 1])
        elif op == 3:
            how.append("huge-str")
            n = rng.choice([4097, 10_000, 65_000, rng.randrange(MAX - 64, MAX + 64)])
            s = "x" * n if rng.random() < 0.8 else self.text(n // 4)
            msg[rng.choice([*keys, "command", "type"])] = s
        elif op == 4:
            how.append("version")
            if rng.random() < 0.2:
                msg.pop("v", None)
            else:
                msg["v"] = rng.choice([0, 2, -1, 1.0, True, "1", b"\x01", None, [1], {"v": 1}])
        elif op == 5:
            how.append("type")
            other = sorted(self.foreign) or ["x"]
            own = msg.get("type")
            own = own if isinstance(own, str) else rng.choice(sorted(self.schemas))
            msg["type"] = rng.choice(
                [
                    rng.choice(other),
                    self.text(rng.randrange(20)),
                    "",
                    "error",
                    "grant",
                    own.upper(),
                    f"{own} ",
                    f"{own}\n",
                    b"status",
                    1,
                    None,
                    ["request"],
                ]
            )
        elif op == 6:
            how.append("extra")
            for _ in range(rng.randrange(1, 6)):
                msg[self.key()] = self.obj(1)
        elif op == 7:
            how.append("id")
            msg["id"] = rng.choice([-1, 1 << 63, (1 << 64) - 1, True, "1", 1.5, None, [0]])
        else:
            how.append("deep")
            msg[rng.choice([*keys, "x"])] = self.deep()

    def pack(self, obj: Any, how: list[str]) -> bytes:
        try:
            return msgpack.packb(obj, use_bin_type=self.rng.random() < 0.9)  # type: ignore[no-any-return]
        except (ValueError, OverflowError, TypeError):
            how.append("unpackable")
            return msgpack.packb(None)  # type: ignore[no-any-return]

    def corrupt(self, data: bytes, how: list[str]) -> bytes:
        rng = self.rng
        op = rng.randrange(5)
        b = bytearray(data)
        if op == 0 and b:
            how.append("bitflip")
            for _ in range(rng.randrange(1, 9)):
                i = rng.randrange(len(b))
                b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            how.append("truncate")
            del b[rng.randrange(len(b)) :]
        elif op == 2:
            how.append("append")
            b += rng.randbytes(rng.randrange(1, 16))
        elif op == 3 and b:
            how.append("byte")
            b[rng.randrange(len(b))] = rng.randrange(256)
        else:
            how.append("concat")
            b += data
        return bytes(b)

    def frames(self, payload: bytes, how: list[str]) -> list[bytes]:
        rng = self.rng
        if rng.random() >= 0.1:
            return [payload]
        how.append("frames")
        prefix = [rng.choice([b"", b"", rng.randbytes(rng.randrange(64))]) for _ in range(3)]
        del prefix[rng.randrange(1, 4) :]
        if rng.random() < 0.03:
            prefix.append(b"\x00" * (MAX + 1))
        if rng.random() < 0.2:
            return [*prefix, payload, rng.randbytes(rng.randrange(32))]  # payload in the envelope
        return [*prefix, payload]

    def message(self, index: int) -> Message:
        rng = self.rng
        how: list[str] = []
        r = rng.random()
        if r < 0.2:
            how.append("bytes")
            near_limit = rng.random() < 0.03
            n = rng.randrange(MAX - 32, MAX + 33) if near_limit else rng.randrange(2049)
            payload = rng.randbytes(n)
            if n and rng.random() < 0.3:  # a plausible msgpack header before the junk
                heads = [b"\x80", b"\x81", b"\x83", b"\xde", b"\xdf", b"\x91", b"\xc4"]
                heads += [b"\xd6\xff", b"\xc7\x03\xff", b"\xd4\x80", b"\x91" * 2000]
                payload = rng.choice(heads) + payload
        elif r < 0.4:
            how.append("object")
            payload = self.pack(self.obj(), how)
        else:
            how.append("valid")
            msg = self.valid()
            for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
                self.mutate(msg, how)
            payload = self.pack(msg, how)
            if rng.random() < 0.15:
                payload = self.corrupt(payload, how)
        return Message(index, self.frames(payload, how), how)


def generate(fuzzer: Fuzzer, n: int, admin: bool) -> list[Message]:
    out: list[Message] = []
    while len(out) < n:
        m = fuzzer.message(len(out))
        if not m.oversize and not m.unanswered:
            m.expected = expect(m.frames[-1], fuzzer.table)
            if admin and m.expected[0] == "ok" and m.expected[1] in MUTATING_ADMIN:
                continue  # it could change quotas: never sent
        out.append(m)
    return out


@dataclass
class Lane:
    name: str
    endpoint: str
    messages: list[Message]
    grants_allowed: bool
    sock: zmq.Socket[bytes] | None = None
    sent: int = 0
    outstanding: collections.deque[Message] = field(default_factory=collections.deque)
    replies: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def busy(self) -> bool:
        return self.sent < len(self.messages) or bool(self.outstanding)


def check_reply(lane: Lane, m: Message, frames: list[bytes]) -> str | None:
    """Return what is wrong with ``frames`` as the reply to ``m``, or None."""
    if frames[:-1] != m.frames[:-1]:
        return f"envelope not echoed: sent {m.frames[:-1]!r:.200} got {frames[:-1]!r:.200}"
    try:
        reply = msgpack.unpackb(frames[-1], raw=False)
    except Exception as e:
        return f"reply is not msgpack: {e}"
    if not isinstance(reply, dict):
        return f"reply is not a map: {reply!r:.200}"
    v, kind, rid = reply.get("v"), reply.get("type"), reply.get("id")
    if type(v) is not int or v != protocol.PROTOCOL_VERSION:
        return f"reply v={v!r:.50}"
    if type(rid) is not int or not isinstance(kind, str) or not kind:
        return f"reply id={rid!r:.50} type={kind!r:.50}"
    outcome, what, msg_id = m.expected
    if kind == "error":
        code, text, retryable = reply.get("error"), reply.get("message"), reply.get("retryable")
        lane.replies[f"error:{code}"] += 1
        if code not in ERROR_CODES or not isinstance(text, str):
            return f"bad error reply {reply!r:.300}"
        if retryable is not (code in Err.RETRYABLE):
            return f"retryable={retryable!r} for {code}"
        if code == Err.INTERNAL:
            return f"internal error: {text}"
    else:
        lane.replies[kind] += 1
        if kind == "grant" and not lane.grants_allowed:
            return f"granted on a zero-quota environment: {reply!r:.300}"
    if outcome == "crash":
        return f"gpushare.protocol raised, not ProtocolError, here: {what}"
    if rid != msg_id:
        return f"reply id {rid} for message id {msg_id}"
    if outcome == "error" and (kind != "error" or reply["error"] != what):
        return f"expected error {what}, got {kind} {reply.get('error')}"
    if outcome == "ok" and kind == "error" and reply["error"] in ENVELOPE_CODES:
        return f"valid {what} refused: {reply['error']} {reply['message']}"
    return None


@dataclass
class Throwaway:
    """A socket of its own that sent one oversize message, and a monitor of its
    disconnection.

    It is closed only once nodemgr has dropped its connection: libzmq aborts the whole
    process (an errno_assert in its session's clean-up of a half-sent message) when a
    connection breaks in the middle of a multipart message whose socket is already closed,
    the rest of the message then being gone from under it. Once the disconnection is
    seen, libzmq has discarded the rest of the message, in the same step of its I/O thread
    and before any later close can reach the socket's session, so closing is safe."""

    message: Message
    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def send_oversize(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, m: Message) -> Throwaway:
    """Send ``m`` on a new DEALER socket, watched for its disconnection."""
    s = ctx.socket(zmq.DEALER)
    monitor = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    s.connect(endpoint)
    s.send_multipart(m.frames, zmq.NOBLOCK)
    return Throwaway(m, s, monitor)


def retire(throwaway: collections.deque[Throwaway], problems: list[str], wait_ms: int = 0) -> None:
    """Close the sockets whose connection nodemgr has dropped, waiting up to ``wait_ms``
    for each (so there are never hundreds open); none may have got an answer. Those not
    dropped are kept."""
    kept: collections.deque[Throwaway] = collections.deque()
    while throwaway:
        t = throwaway.popleft()
        if not t.monitor.poll(wait_ms):
            kept.append(t)
            continue
        if t.sock.poll(0):
            problems.append(f"an oversize message was answered: {t.sock.recv_multipart()!r:.200}")
        t.close()
    throwaway.extend(kept)


def blast(lanes: list[Lane]) -> tuple[list[str], int]:
    """Send every lane's messages, WINDOW outstanding at a time; return problems found and
    how many oversize messages went unanswered as they should."""
    problems: list[str] = []
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    throwaway: collections.deque[Throwaway] = collections.deque()
    dropped = 0
    poller = zmq.Poller()
    try:
        for lane in lanes:
            lane.sock = ctx.socket(zmq.DEALER)
            lane.sock.connect(lane.endpoint)
            poller.register(lane.sock, zmq.POLLIN)
        while any(lane.busy for lane in lanes) and len(problems) < 50:
            for lane in lanes:
                assert lane.sock is not None
                while lane.sent < len(lane.messages) and len(lane.outstanding) < WINDOW:
                    m = lane.messages[lane.sent]
                    lane.sent += 1
                    if m.oversize:
                        # nodemgr drops this connection unread: a socket of its own.
                        throwaway.append(send_oversize(ctx, lane.endpoint, m))
                        dropped += 1
                        continue
                    lane.sock.send_multipart(m.frames, zmq.NOBLOCK)
                    if m.unanswered:
                        dropped += 1  # a reply to it would be taken for the next one's
                        continue
                    lane.outstanding.append(m)
            retire(throwaway, problems)
            if not any(lane.outstanding for lane in lanes):
                continue
            events = dict(poller.poll(REPLY_TIMEOUT_MS))
            if not events:
                for lane in lanes:
                    if lane.outstanding:
                        m = lane.outstanding[0]
                        problems.append(f"{lane.name}: no reply to {m.describe()}")
                break
            for lane in lanes:
                if lane.sock is None or lane.sock not in events:
                    continue
                while True:
                    try:
                        frames = lane.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if not lane.outstanding:
                        problems.append(f"{lane.name}: a reply to nothing: {frames!r:.200}")
                        continue
                    m = lane.outstanding.popleft()
                    wrong = check_reply(lane, m, frames)
                    if wrong:
                        problems.append(f"{lane.name} {m.describe()}: {wrong}")
        if problems:
            return problems, dropped
        # Exactly one reply each: nothing more may come, and nothing to the dropped.
        time.sleep(0.2)
        for lane in lanes:
            assert lane.sock is not None
            if lane.sock.poll(0):
                extra = lane.sock.recv_multipart()
                problems.append(f"{lane.name}: a reply too many: {extra!r:.200}")
        retire(throwaway, problems, REPLY_TIMEOUT_MS)
        for t in throwaway:
            problems.append(f"the connection that sent {t.message.describe()} was not dropped")
        return problems, dropped
    finally:
        for t in throwaway:
            t.monitor.poll(REPLY_TIMEOUT_MS)  # a close before the drop could abort (Throwaway)
            t.close()
        for lane in lanes:
            if lane.sock is not None:
                lane.sock.close(linger=0)
        ctx.term()


def snapshot(daemon: Any) -> dict[str, Any]:
    status = daemon.admin("status")
    for volatile in ("uptime", "id"):
        status.pop(volatile, None)
    # Measurements, not state: NVML's utilisation is sampled every few seconds.
    for gpu in status["gpus"]:
        for measured in ("utilization", "memory_utilization"):
            gpu.pop(measured, None)
    # How many audits have run: one every audit.interval, however long the fuzzing took.
    status["bypass"].pop("audits", None)
    return {
        "quotas": daemon.admin("quota_show")["quotas"],
        "tasks": daemon.tasks(),
        "status": status,
    }


def test_fuzz_endpoints_keep_state_and_service(daemon: Any) -> None:
    fz = daemon.env("fz", gpus=0, memory=GiB)
    ok = daemon.env("ok", gpus=1, memory=GiB)
    before = snapshot(daemon)
    print(f"fuzz seed {SEED} (rerun with GPUSHARE_FUZZ_SEED={SEED})")

    rng = random.Random(SEED)
    task_side = Fuzzer(rng, messages.TASK_REQUESTS, messages.ADMIN_REQUESTS)
    admin_side = Fuzzer(rng, messages.ADMIN_REQUESTS, messages.TASK_REQUESTS)
    lanes = [
        Lane("task", fz, generate(task_side, MESSAGES_PER_ENDPOINT, False), False),
        Lane(
            "admin",
            f"ipc://{daemon.run_dir / 'admin.sock'}",
            generate(admin_side, MESSAGES_PER_ENDPOINT, True),
            True,
        ),
    ]
    start = time.monotonic()
    problems, dropped = blast(lanes)
    took = time.monotonic() - start
    total = sum(len(lane.messages) for lane in lanes)
    for lane in lanes:
        print(f"{lane.name}: {sum(lane.replies.values())} replies {dict(lane.replies)}")
    print(f"{total} messages ({dropped} oversize or of stray frames, unanswered) in {took:.1f}s")

    assert not problems, f"seed {SEED}: {len(problems)} problems:\n" + "\n".join(problems[:20])
    for lane in lanes:
        unanswered = sum(m.oversize or m.unanswered for m in lane.messages)
        assert sum(lane.replies.values()) + unanswered == len(lane.messages), f"seed {SEED}"
        # The fuzzer reached past the envelope, not only into bad_request.
        for code in (Err.BAD_REQUEST, Err.UNSUPPORTED_VERSION, Err.UNKNOWN_TYPE):
            assert lane.replies[f"error:{code}"] > 0, f"seed {SEED}: {lane.name} never got {code}"
    assert lanes[0].replies[f"error:{Err.QUOTA_ZERO}"] > 0, f"seed {SEED}"
    assert any(not k.startswith("error:") for k in lanes[1].replies), f"seed {SEED}"

    assert daemon.proc.poll() is None, f"seed {SEED}: nodemgr died:\n{daemon.logtext()[-3000:]}"
    assert "Traceback" not in daemon.logtext(), f"seed {SEED}"
    assert snapshot(daemon) == before, f"seed {SEED}: fuzzing changed the node's state"
    with Connection(ok) as conn:
        grant = conn.call("request", gpus=1)
        assert grant["type"] == "grant"
        assert conn.call("done", task_id=grant["task_id"], exit_code=0)["type"] == "ack"
    assert daemon.tasks() == []


def test_a_message_of_many_frames_is_dropped_unanswered(daemon: Any) -> None:
    """4,000 frames of 64 KiB (each within the frame limit) then a valid map: nodemgr drops
    the message unanswered, with its sender's connection, at the frame that passes the size
    of a message, and serves the sender again once its socket has connected anew (what it
    costs nodemgr in memory: tests/daemon/test_connections.py)."""
    ep = daemon.env("many", gpus=0, memory=GiB)
    ping = msgpack.packb(
        {"v": protocol.PROTOCOL_VERSION, "type": "heartbeat", "id": 7, "task_id": "none"}
    )
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(ep)
        s.send_multipart([b"\x00" * (64 * 1024)] * 4000 + [ping])
        assert not s.poll(1000), "a message of many frames was answered"
        s.send(ping)
        assert s.poll(5000), "the connection was not served after the dropped message"
        assert msgpack.unpackb(s.recv(), raw=False)["id"] == 7
    finally:
        s.close(linger=0)
        ctx.term()


def test_senders_of_oversize_messages_are_closed_only_once_dropped(daemon: Any) -> None:
    """Sockets that sent a message of several frames over the size limit, closed the way
    blast() closes them: at once when nodemgr dropped them, then their context ended. Closed
    before the drop, libzmq aborted this process within a few rounds (Throwaway)."""
    ep = daemon.env("big", gpus=0, memory=GiB)
    ping = msgpack.packb({"v": protocol.PROTOCOL_VERSION, "type": "quota", "id": 1})
    m = Message(0, [b"", b"\x00" * (MAX + 1), ping], ["frames"])
    assert m.oversize
    problems: list[str] = []
    for _ in range(20):
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        throwaway: collections.deque[Throwaway] = collections.deque()
        try:
            throwaway.extend(send_oversize(ctx, ep, m) for _ in range(20))
            retire(throwaway, problems, REPLY_TIMEOUT_MS)
            assert not throwaway, f"{len(throwaway)} connections of 20 were not dropped"
        finally:
            for t in throwaway:
                t.close()
            ctx.term()
    assert not problems, problems[:5]
