"""Pure modules, case by case: sizes, wire validation, GPU selection, config."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import msgpack
import pytest

from gpushare import messages, protocol
from gpushare.messages import ErrorReply
from gpushare.protocol import Err, ProtocolError
from gpushare.sizes import format_clock, format_size, parse_seconds, parse_size
from nodemgr import config


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 << 30),
        ("512MiB", 512 << 20),
        ("1.5G", 1_500_000_000),
        ("1048576", 1 << 20),
        ("2 gib", 2 << 30),
        ("1TB", 10**12),
        ("0", 0),
        (1234, 1234),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "1.5.2G", "-1", "12XB", "1e9", "9" * 30])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(8 << 30) == "8GiB"
    assert format_size(1536 << 20) == "1.50GiB"
    assert format_size(12) == "12B"


def test_format_clock() -> None:
    assert format_clock(59.9) == "59s"
    assert format_clock(187) == "3m07s"
    assert format_clock(2 * 3600 + 5 * 60 + 59) == "2h05m"


def frame(**msg: object) -> bytes:
    return bytes(msgpack.packb(msg))


def test_decode_validates_envelope() -> None:
    assert protocol.decode(frame(v=1, type="status", id=3))["id"] == 3
    for bad, code in [
        (b"\xc1", Err.BAD_REQUEST),
        (msgpack.packb([1, 2]), Err.BAD_REQUEST),
        (frame(v=2, type="status"), Err.UNSUPPORTED_VERSION),
        (frame(type="status"), Err.UNSUPPORTED_VERSION),
        (frame(v=1, type=5), Err.BAD_REQUEST),
        (frame(v=1, type="x", id=-1), Err.BAD_REQUEST),
        (b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1), Err.BAD_REQUEST),
    ]:
        with pytest.raises(ProtocolError) as e:
            protocol.decode(bad)
        assert e.value.code == code


def test_validate_types_ranges_and_unknowns() -> None:
    ok = messages.parse(
        {"v": 1, "type": "request", "id": 1, "gpus": 2, "extra": "ignored"},
        messages.TASK_REQUESTS,
    )
    assert dataclasses.asdict(ok) == {
        "gpus": 2,
        "memory": None,
        "command": None,
        "wait": None,
        "devices": None,
        "persistent": None,
        "temporary": None,
        "guard": None,
        "compute": None,
        "waited": None,
        "wrapper": None,
        "task_class": None,
        "step_target": None,
        "deadline": None,
        "steps": None,
        "predicted": None,
        "kernels_per_step": None,
        "host_bytes_per_step": None,
        "device_bytes_per_step": None,
        "host_step": None,
        "waves_per_step": None,
        "flops_per_step": None,
        "half_flops_per_step": None,
        "op_bytes_per_step": None,
    }
    cases: list[tuple[dict[str, Any], str]] = [
        ({"type": "request", "gpus": 1, "task_class": "latency-sensitive"}, Err.BAD_REQUEST),
        ({"type": "request", "gpus": 1, "wrapper": "yes"}, Err.BAD_REQUEST),
        ({"type": "request"}, Err.BAD_REQUEST),
        ({"type": "request", "gpus": 1, "persistent": -1}, Err.BAD_REQUEST),
        ({"type": "request", "gpus": 1, "temporary": "1GiB"}, Err.BAD_REQUEST),
        ({"type": "request", "gpus": 1, "guard": (1 << 40) + 1}, Err.BAD_REQUEST),
        ({"type": "yield"}, Err.BAD_REQUEST),
        ({"type": "yield", "task_id": "../x"}, Err.BAD_REQUEST),
        ({"type": "request", "gpus": 0}, Err.BAD_REQUEST),
        ({"type": "request", "gpus": True}, Err.BAD_REQUEST),
        ({"type": "request", "gpus": 1, "memory": -5}, Err.BAD_REQUEST),
        ({"type": "heartbeat", "task_id": "../x"}, Err.BAD_REQUEST),
        ({"type": "quota_set"}, Err.UNKNOWN_TYPE),  # admin message on a task endpoint
        ({"type": "launch_missiles"}, Err.UNKNOWN_TYPE),
    ]
    for msg, code in cases:
        with pytest.raises(ProtocolError) as e:
            messages.parse(msg, messages.TASK_REQUESTS)
        assert e.value.code == code


def test_error_reply_shape() -> None:
    e = messages.to_map(ErrorReply.of(Err.NO_RESOURCES, "busy"), 9)
    assert e == {
        "v": 1,
        "type": "error",
        "id": 9,
        "error": "no_resources",
        "message": "busy",
        "retryable": True,
    }
    assert ErrorReply.of(Err.QUOTA_ZERO, "zero").retryable is False


def test_config_defaults_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(
        '[node]\nrun_dir = "run"\n[gpus]\nsource = "simulated"\nsimulated_memory = "2GiB"\n'
    )
    c = config.load(f)
    assert c.run_dir == tmp_path / "run"
    assert c.heartbeat_timeout == 5.0
    assert c.sim_memory == 2 << 30
    assert c.task_threshold == 4
    # The context charge is measured at start ("auto", None) unless a size is given.
    assert c.context_memory is None
    assert c.sim_context == 0
    assert config.CONTEXT_FALLBACK == 512 << 20
    f.write_text('[gpus]\ncontext_memory = "1GiB"\nsimulated_context_memory = "96MiB"\n')
    assert config.load(f).context_memory == 1 << 30
    assert config.load(f).sim_context == 96 << 20
    f.write_text("[gpus]\ncontext_memory = 0\n")
    assert config.load(f).context_memory == 0
    f.write_text('[gpus]\ncontext_memory = "auto"\n')
    assert config.load(f).context_memory is None
    for text, needle in [
        ("[nodes]\n", "unknown section [nodes]"),
        ("[gpus]\nsource = 'cloud'\n", "gpus.source"),
        ("[node]\nheartbeat_timeout = 0.5\nheartbeat_interval = 1\n", "longer than"),
        ("[gpus]\nsimulated_memory = 'big'\n", "gpus.simulated_memory"),
        ("[scheduler]\ntask_threshold = 0\n", "task_threshold"),
        ("[gpus]\ncontext_memory = '-1'\n", "gpus.context_memory"),
        ("[gpus]\ncontext_memory = 'Auto'\n", "gpus.context_memory"),
        ("[gpus]\nsimulated_context_memory = 'auto'\n", "gpus.simulated_context_memory"),
        ("not toml [", "not valid TOML"),
    ]:
        f.write_text(text)
        with pytest.raises(config.ConfigError, match=needle.replace("[", r"\[")):
            config.load(f)
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.load(tmp_path / "missing.toml")


def test_timeslice_config_defaults_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[node]\n")
    c = config.load(f)
    assert (c.timeslice_gpus, c.quantum, c.turn_timeout, c.guard) == ((), 4, 30.0, 100 << 20)
    f.write_text(
        '[timeslice]\ngpus = [0, "2", "GPU-8e2c1234"]\nquantum = 2\nturn_timeout = 3\n'
        'guard = "1GiB"\n'
    )
    c = config.load(f)
    assert c.timeslice_gpus == ("0", "2", "GPU-8e2c1234")
    assert (c.quantum, c.turn_timeout, c.guard) == (2, 3.0, 1 << 30)
    f.write_text('[timeslice]\ngpus = "all"\n')
    assert config.load(f).timeslice_gpus == "all"
    for text, needle in [
        ('[timeslice]\ngpus = "some"\n', "timeslice.gpus"),
        ("[timeslice]\ngpus = [-1]\n", "timeslice.gpus"),
        ('[timeslice]\ngpus = ["MIG-1234"]\n', "timeslice.gpus"),
        ("[timeslice]\ngpus = [true]\n", "timeslice.gpus"),
        ("[timeslice]\nquantum = 0\n", "timeslice.quantum"),
        ("[timeslice]\nquantum = 1.5\n", "timeslice.quantum"),
        ("[timeslice]\nturn_timeout = 0\n", "timeslice.turn_timeout"),
        ("[timeslice]\nturn_timeout = 'x'\n", "timeslice.turn_timeout"),
        ("[timeslice]\nguard = 'lots'\n", "timeslice.guard"),
        ("[timeslice]\nslices = 3\n", "unknown key timeslice.slices"),
    ]:
        f.write_text(text)
        with pytest.raises(config.ConfigError, match=needle):
            config.load(f)


def test_sim_timeline_config_defaults_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[node]\n")
    c = config.load(f)
    assert (c.sim_timeline, c.sim_timeline_params) == (False, None)
    f.write_text("[gpus]\nsimulated_timeline = true\n")
    assert config.load(f).sim_timeline_params == {}  # on, with the simulator's defaults
    f.write_text(
        "[gpus]\nsimulated_timeline = true\nsimulated_wave_ns = 0\nsimulated_launch_ns = 1500\n"
        "simulated_host_gbps = 12.5\nsimulated_device_gbps = 900\nsimulated_time_scale = 0.5\n"
    )
    assert config.load(f).sim_timeline_params == {
        "launch_ns": 1500.0,
        "wave_ns": 0.0,
        "host_gbps": 12.5,
        "device_gbps": 900.0,
        "time_scale": 0.5,
    }
    for text, needle in [
        ('[gpus]\nsimulated_timeline = "yes"\n', "gpus.simulated_timeline must be true or false"),
        ("[gpus]\nsimulated_wave_ns = -1\n", "gpus.simulated_wave_ns must be a number >= 0"),
        ("[gpus]\nsimulated_host_gbps = 0\n", "gpus.simulated_host_gbps must be a number above"),
        ("[gpus]\nsimulated_time_scale = nan\n", "gpus.simulated_time_scale must be"),
        ("[gpus]\nsimulated_device_gbps = true\n", "gpus.simulated_device_gbps must be"),
    ]:
        f.write_text(text)
        with pytest.raises(config.ConfigError, match=needle):
            config.load(f)


def test_access_config_names_ids_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[admin]\nowner = "root"\ngroup = 0\nmode = "0660"\n[env."a"]\nmode = "0666"\n')
    c = config.load(f)
    assert (c.admin_access.uid, c.admin_access.gid, c.admin_access.mode) == (0, 0, 0o660)
    assert c.access_for("a").mode == 0o666 and c.access_for("b").mode == 0o600
    assert c.access_for("a").dir_mode == 0o711
    for text, needle in [
        ('[admin]\nowner = "no-such-user-x"\n', "admin.owner: no user named"),
        ('[env."a"]\ngroup = "no-such-group-x"\n', "env.a.group: no group named"),
        ('[admin]\nmode = "0755"\n', "execute bits"),
        ("[admin]\nmode = 660\n", "octal string"),
        ('[env."a"]\ncolour = "red"\n', "unknown key env.a.colour"),
    ]:
        f.write_text(text)
        with pytest.raises(config.ConfigError, match=needle):
            config.load(f)


@pytest.mark.parametrize(
    "text",
    [
        "1" + "0" * 400 + ".5",  # float() makes it inf
        "\uff18GiB",  # full-width 8
        "\uff11\uff12",
        "1\u0661",  # an Arabic-Indic digit
        1.5,
        None,
    ],
)
def test_parse_size_takes_only_ascii_numbers_in_range(text: object) -> None:
    with pytest.raises(ValueError, match=r"not a size|out of range") as e:
        parse_size(text)  # type: ignore[arg-type]
    assert len(str(e.value)) < 200


@pytest.mark.parametrize(
    "value", ["nan", "inf", "-1", "1e400", "\uff11", "1_0", "", float("nan"), float("inf"), True]
)
def test_parse_seconds_is_finite_and_in_range(value: object) -> None:
    with pytest.raises(ValueError, match="not a number of seconds from 0 to 60"):
        parse_seconds(value, 0, 60)


def test_parse_seconds_accepts_numbers_and_ascii_strings() -> None:
    assert parse_seconds(2, 0, 60) == 2.0
    assert parse_seconds(" 0.5 ", 0, 60) == 0.5
    assert parse_seconds("5e-1", 0, 60) == 0.5
    assert parse_seconds(60, 0, 60) == 60.0


@pytest.mark.parametrize(
    "key",
    [
        "node.heartbeat_interval",
        "node.heartbeat_timeout",
        "node.sweep_interval",
        "gpus.health_interval",
        "scheduler.max_wait",
        "timeslice.turn_timeout",
    ],
)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300"])
def test_every_duration_is_finite_and_bounded(tmp_path: Path, key: str, value: str) -> None:
    section, name = key.split(".")
    f = tmp_path / "c.toml"
    f.write_text(f"[{section}]\n{name} = {value}\n")
    with pytest.raises(config.ConfigError, match=f"^{key}: .* is not a number of seconds"):
        config.load(f)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[admin]\nowner = -1\n", "admin.owner: -1 is not a user id"),
        ("[env_defaults]\ngroup = 4294967295\n", "env_defaults.group: 4294967295 is not a group"),
        ('[admin]\nowner = "ro\\u0000ot"\n', "admin.owner: no user named"),
        ("[admin]\nowner = 1.5\n", "admin.owner must be a user name or id"),
        ('[env."a"]\nowner = ""\n', "env.a.owner must be a user name or id"),
        ("[gpus]\ncontext_memory = 1.5\n", "gpus.context_memory: not a size"),
        ('[scheduler]\nmemory_reserve = "\uff11GiB"\n', "scheduler.memory_reserve: not a size"),
    ],
)
def test_owners_and_sizes_are_checked(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(config.ConfigError, match=re.escape(needle)):
        config.load(f)


def test_context_memory_and_reserve_must_fit_every_gpu(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[gpus]\ncontext_memory = "16GiB"\n')
    c = config.load(f)
    with pytest.raises(config.ConfigError, match=r"gpus.context_memory \(16GiB\) .* GPU 1"):
        config.check_gpus(c, {0: 32 << 30, 1: 16 << 30}, {0: 16 << 30, 1: 16 << 30})
    f.write_text('[scheduler]\nmemory_reserve = "8GiB"\n[gpus]\ncontext_memory = "8GiB"\n')
    c = config.load(f)
    with pytest.raises(config.ConfigError, match=r"gpus.context_memory .*GPU 0"):
        config.check_gpus(c, {0: 16 << 30}, {0: 8 << 30})
    f.write_text('[scheduler]\nmemory_reserve = "16GiB"\n')
    with pytest.raises(config.ConfigError, match=r"scheduler.memory_reserve \(16GiB\) .*GPU 0"):
        config.check_gpus(config.load(f), {0: 16 << 30}, {0: 0})
    f.write_text('[scheduler]\nmemory_reserve = "1GiB"\n[gpus]\ncontext_memory = "14GiB"\n')
    config.check_gpus(config.load(f), {0: 16 << 30}, {0: 14 << 30})


def test_a_suggested_quota_is_never_more_than_the_gpu_can_give() -> None:
    """What admin.unservable tells an operator to give instead is accepted as given."""
    from gpushare.sizes import parse_size
    from nodemgr.endpoints.admin import unservable

    for capacity in (16 << 30, (16 << 30) - 1, 15_996_000_000, 80 * 10**9):
        why = unservable(1, capacity + 1, [(0, "G", capacity, capacity, 0)])
        assert why is not None
        suggested = why.split("give --memory ")[1].split()[0]
        assert parse_size(suggested) <= capacity, why
        assert unservable(1, parse_size(suggested), [(0, "G", capacity, capacity, 0)]) is None


def test_a_quota_must_fit_on_as_many_gpus_as_it_names() -> None:
    """On GPUs of different models a quota's memory must fit, with a context, on each of
    its GPUs: the largest GPU alone is not enough for a quota of two."""
    from nodemgr.endpoints.admin import unservable

    GiB = 1 << 30
    node = [(0, "Big", 80 * GiB, 80 * GiB, GiB), (1, "Small", 16 * GiB, 16 * GiB, GiB // 2)]
    assert unservable(1, 40 * GiB, node) is None
    assert unservable(2, 16 * GiB, node) is None
    why = unservable(2, 40 * GiB, node)
    assert why is not None and "only GPU 0 of this node can give 40GiB" in why, why
    assert "give --gpus 1 or fewer" in why, why
    # Room for the context is needed where the memory is: 768MiB fits a context only on 1.
    why = unservable(2, 768 << 20, node)
    assert why is not None and "only GPU 1 of this node" in why, why
    assert unservable(1, 768 << 20, node) is None
