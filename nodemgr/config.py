"""nodemgr's TOML configuration: one place that knows every key and its default."""

from __future__ import annotations

import grp
import os
import pwd
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodemgr.protocol import MAX_WAIT
from nodemgr.sizes import format_size, parse_seconds, parse_size

DEFAULT_CONFIG = Path("/etc/gpushare/nodemgr.toml")
CONFIG_ENV = "GPUSHARE_CONFIG"
# gpus.context_memory on NVML GPUs when the config names none: an estimate of
# what one process's CUDA context takes on a GPU, not yet measured.
NVML_CONTEXT_MEMORY = 512 << 20


class ConfigError(Exception):
    """The configuration file is missing, unreadable or wrong; the message names the key."""


@dataclass(frozen=True)
class Access:
    """Who may reach a socket (and, for an environment, its ledger)."""

    uid: int
    gid: int
    mode: int

    @property
    def dir_mode(self) -> int:
        """The mode of the directory holding an environment's socket and ledger: its owner
        may list it; group and others may only pass through, when the mode lets them in."""
        mode = 0o700
        if self.mode & 0o060:
            mode |= 0o010
        if self.mode & 0o006:
            mode |= 0o001
        return mode


def _own_access(mode: int = 0o600) -> Access:
    return Access(os.geteuid(), os.getegid(), mode)


@dataclass(frozen=True)
class Config:
    path: Path | None
    run_dir: Path
    state_dir: Path = field(default_factory=lambda: default_state_dir())
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    sweep_interval: float = 0.1
    gpu_source: str = "auto"
    sim_count: int = 4
    sim_memory: int = 16 << 30
    sim_name: str = "gpushare Simulated GPU"
    health_interval: float = 5.0
    # Bytes charged per process per GPU for its CUDA context; None: the
    # default for the GPUs found (context_memory_for).
    context_memory: int | None = None
    task_threshold: int = 4
    memory_reserve: int = 0
    queue_max_bypass: int = 8
    max_wait: float = 86400.0
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 0
    admin_access: Access = field(default_factory=_own_access)
    env_default_access: Access = field(default_factory=_own_access)
    env_access: dict[str, Access] = field(default_factory=dict)
    # [timeslice] (docs/timeslicing.md): the GPUs that start time-sliced, by index or
    # UUID as written ("all": every GPU), iterations per turn, the longest a holder keeps
    # the turn without yielding, and the default guard after each persistent slice.
    timeslice_gpus: tuple[str, ...] | str = ()
    quantum: int = 4
    turn_timeout: float = 30.0
    guard: int = 100 << 20

    @property
    def admin_endpoint(self) -> str:
        return f"ipc://{self.run_dir / 'admin.sock'}"

    @property
    def database(self) -> Path:
        return self.state_dir / "nodemgr.db"

    def env_dir(self, env: str) -> Path:
        return self.run_dir / "envs" / env

    def access_for(self, env: str) -> Access:
        return self.env_access.get(env, self.env_default_access)

    def context_memory_for(self, simulated: bool) -> int:
        """gpus.context_memory, or its default: 0 on simulated GPUs (the simulated driver's
        contexts take no memory), NVML_CONTEXT_MEMORY on real ones."""
        if self.context_memory is not None:
            return self.context_memory
        return 0 if simulated else NVML_CONTEXT_MEMORY


def check_gpus(config: Config, memories: dict[int, int], simulated: bool) -> None:
    """The sizes that only the GPUs found can judge (``memories``: bytes per GPU index):
    the reserve and one context must leave room for something on every GPU."""
    context = config.context_memory_for(simulated)
    for index, memory in sorted(memories.items()):
        if config.memory_reserve >= memory:
            raise ConfigError(
                f"scheduler.memory_reserve ({format_size(config.memory_reserve)}) is not "
                f"less than GPU {index}'s memory ({format_size(memory)})"
            )
        room = memory - config.memory_reserve
        if context >= room:
            raise ConfigError(
                f"gpus.context_memory ({format_size(context)}) leaves nothing of GPU "
                f"{index}'s memory ({format_size(memory)}, less "
                f"scheduler.memory_reserve {format_size(config.memory_reserve)})"
            )


def default_run_dir() -> Path:
    """Where sockets and ledgers live when the config names no ``run_dir``.

    /run/gpushare for root; a per-user runtime directory otherwise, so that
    ``make run`` works without privileges.
    """
    if os.geteuid() == 0:
        return Path("/run/gpushare")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.access(xdg, os.W_OK):
        return Path(xdg) / "gpushare"
    return Path(f"/tmp/gpushare-{os.geteuid()}")


def default_state_dir() -> Path:
    """Where the database of quotas and records lives when the config names no ``state_dir``."""
    if os.geteuid() == 0:
        return Path("/var/lib/gpushare")
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "gpushare"
    return Path.home() / ".local" / "state" / "gpushare"


_KEYS: dict[str, set[str]] = {
    "node": {"run_dir", "state_dir", "heartbeat_interval", "heartbeat_timeout", "sweep_interval"},
    "gpus": {
        "source",
        "simulated_count",
        "simulated_memory",
        "simulated_name",
        "health_interval",
        "context_memory",
    },
    "scheduler": {"task_threshold", "memory_reserve", "queue_max_bypass", "max_wait"},
    "metrics": {"address", "port"},
    "timeslice": {"gpus", "quantum", "turn_timeout", "guard"},
    "admin": {"owner", "group", "mode"},
    "env_defaults": {"owner", "group", "mode"},
}
_ACCESS_KEYS = {"owner", "group", "mode"}
MAX_ID = (1 << 32) - 1
_MODE = re.compile(r"^0?[0-7]{3}$")


def _path(table: dict[str, Any], key: str, file: Path | None) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"node.{key} must be a path, not {value!r}")
    if file is not None and not os.path.isabs(value):
        value = str(file.parent / value)
    return value


def _account(
    table: dict[str, Any], where: str, key: str, lookup: Any, what: str, default: int
) -> int:
    """A user or group given by name or id; KeyError from ``lookup`` means no such name."""
    value = table.get(key)
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool):
        # An id need not have an account here (a container's user seldom has one), but it
        # must be one: -1 and 2^32-1 mean "leave as it is" to chown.
        if not 0 <= value < MAX_ID:
            raise ConfigError(f"{where}.{key}: {value} is not a {what} id (0 to {MAX_ID - 1})")
        return value
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}.{key} must be a {what} name or id, not {value!r}")
    try:
        return int(lookup(value))
    except (KeyError, ValueError):  # ValueError: a NUL in the name
        raise ConfigError(f"{where}.{key}: no {what} named {value!r} on this node") from None


def _access(table: dict[str, Any], where: str, base: Access) -> Access:
    """owner/group/mode of a [where] table: names or ids, and an octal mode string."""
    uid, gid, mode = base.uid, base.gid, base.mode
    uid = _account(table, where, "owner", lambda n: pwd.getpwnam(n).pw_uid, "user", uid)
    gid = _account(table, where, "group", lambda n: grp.getgrnam(n).gr_gid, "group", gid)
    raw = table.get("mode")
    if raw is not None:
        if not isinstance(raw, str) or not _MODE.match(raw):
            raise ConfigError(f'{where}.mode must be an octal string like "0660", not {raw!r}')
        mode = int(raw, 8)
        if mode & 0o111:
            raise ConfigError(f"{where}.mode {raw}: execute bits make no sense for a socket")
        if not mode & 0o600 == 0o600:
            raise ConfigError(f"{where}.mode {raw}: the owner needs read and write")
    return Access(uid, gid, mode)


# The longest any interval or timeout may be: a day. TOML takes nan and inf, and a
# timeout that never expires (a NaN heartbeat timeout) or a sweep that never comes
# would stop nodemgr from reclaiming anything.
DAY = 86400.0


def _seconds(
    table: dict[str, Any], section: str, key: str, default: float, lo: float, hi: float = DAY
) -> float:
    """A duration key: finite, from ``lo`` to ``hi`` seconds."""
    try:
        return parse_seconds(table.get(key, default), lo, hi)
    except ValueError as e:
        raise ConfigError(f"{section}.{key}: {e}") from None


def _size(table: dict[str, Any], section: str, key: str, default: str | int) -> int:
    try:
        return parse_size(table.get(key, default))
    except ValueError as e:
        raise ConfigError(f"{section}.{key}: {e}") from None


_GPU_NAME = re.compile(r"^(?:[0-9]{1,9}|GPU-[0-9A-Fa-f-]{4,60})$")


def _timeslice_gpus(value: Any) -> tuple[str, ...] | str:
    """timeslice.gpus: "all", or a list of GPU indices (integers or digit strings) and
    UUIDs (or unique prefixes of them); which GPUs they name is checked at start-up."""
    if value == "all":
        return "all"
    if not isinstance(value, list):
        raise ConfigError(
            f'timeslice.gpus must be "all" or a list of GPU indices or UUIDs, not {value!r}'
        )
    names = []
    for v in value:
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            names.append(str(v))
        elif isinstance(v, str) and _GPU_NAME.match(v):
            names.append(v)
        else:
            raise ConfigError(
                f"timeslice.gpus: {v!r} is neither a GPU index nor a GPU UUID (GPU-...)"
            )
    return tuple(names)


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Load ``path``, or $GPUSHARE_CONFIG, or /etc/gpushare/nodemgr.toml if present.

    With no file at all the defaults apply: NVML GPUs when a driver is
    present, simulated ones otherwise.
    """
    explicit = path if path is not None else os.environ.get(CONFIG_ENV)
    file: Path | None = Path(explicit) if explicit else None
    if file is None and DEFAULT_CONFIG.exists():
        file = DEFAULT_CONFIG
    data: dict[str, Any] = {}
    if file is not None:
        try:
            with open(file, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        except OSError as e:
            raise ConfigError(f"cannot read config file {file}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {file} is not valid TOML: {e}") from None
    for section, table in data.items():
        if section == "env" and isinstance(table, dict):
            for name, sub in table.items():
                if not isinstance(sub, dict):
                    raise ConfigError(f"[env.{name}] must be a table of owner, group, mode")
                for key in sub:
                    if key not in _ACCESS_KEYS:
                        raise ConfigError(f"unknown key env.{name}.{key} in {file}")
            continue
        if section not in _KEYS or not isinstance(table, dict):
            raise ConfigError(f"unknown section [{section}] in {file}")
        for key in table:
            if key not in _KEYS[section]:
                raise ConfigError(f"unknown key {section}.{key} in {file}")
    node = data.get("node", {})
    gpus = data.get("gpus", {})
    sched = data.get("scheduler", {})
    metrics = data.get("metrics", {})
    ts = data.get("timeslice", {})

    run_dir = _path(node, "run_dir", file)
    state_dir = _path(node, "state_dir", file)

    source = gpus.get("source", "auto")
    if source not in ("auto", "nvml", "simulated"):
        raise ConfigError(f"gpus.source must be auto, nvml or simulated, not {source!r}")
    count = gpus.get("simulated_count", 4)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 16:
        raise ConfigError(f"gpus.simulated_count must be an integer 1..16, not {count!r}")
    memory = _size(gpus, "gpus", "simulated_memory", "16GiB")
    if memory <= 0:
        raise ConfigError("gpus.simulated_memory must be positive")
    name = gpus.get("simulated_name", "gpushare Simulated GPU")
    if not isinstance(name, str) or not name or any(c in name for c in "|;\n"):
        raise ConfigError("gpus.simulated_name must be a non-empty string without | ; or newlines")
    context_memory = None
    if "context_memory" in gpus:
        context_memory = _size(gpus, "gpus", "context_memory", 0)
    threshold = sched.get("task_threshold", 4)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ConfigError(f"scheduler.task_threshold must be an integer >= 1, not {threshold!r}")

    reserve = _size(sched, "scheduler", "memory_reserve", 0)
    bypass = sched.get("queue_max_bypass", 8)
    if isinstance(bypass, bool) or not isinstance(bypass, int) or bypass < 0:
        raise ConfigError(f"scheduler.queue_max_bypass must be an integer >= 0, not {bypass!r}")
    port = metrics.get("port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"metrics.port must be an integer 0..65535 (0: off), not {port!r}")
    address = metrics.get("address", "127.0.0.1")
    if not isinstance(address, str) or not address:
        raise ConfigError(f"metrics.address must be an address to listen on, not {address!r}")
    env_default = _access(data.get("env_defaults", {}), "env_defaults", _own_access())
    env_access = {}
    for name, sub in data.get("env", {}).items():
        env_access[name] = _access(sub, f"env.{name}", env_default)

    ts_gpus = _timeslice_gpus(ts.get("gpus", []))
    quantum = ts.get("quantum", 4)
    if isinstance(quantum, bool) or not isinstance(quantum, int) or quantum < 1:
        raise ConfigError(f"timeslice.quantum must be an integer >= 1, not {quantum!r}")
    turn_timeout = _seconds(ts, "timeslice", "turn_timeout", 30.0, 0.01)
    guard = _size(ts, "timeslice", "guard", "100MiB")

    interval = _seconds(node, "node", "heartbeat_interval", 1.0, 0.01, 3600.0)
    timeout = _seconds(node, "node", "heartbeat_timeout", 5.0, 0.05)
    if timeout <= interval:
        raise ConfigError(
            f"node.heartbeat_timeout ({timeout}) must be longer than "
            f"node.heartbeat_interval ({interval})"
        )
    return Config(
        path=file,
        run_dir=Path(run_dir) if run_dir else default_run_dir(),
        state_dir=Path(state_dir) if state_dir else default_state_dir(),
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        sweep_interval=_seconds(node, "node", "sweep_interval", 0.1, 0.01, 60.0),
        gpu_source=source,
        sim_count=count,
        sim_memory=memory,
        sim_name=name,
        health_interval=_seconds(gpus, "gpus", "health_interval", 5.0, 0.1, 3600.0),
        context_memory=context_memory,
        task_threshold=threshold,
        memory_reserve=reserve,
        queue_max_bypass=bypass,
        max_wait=_seconds(sched, "scheduler", "max_wait", 86400.0, 0.0, MAX_WAIT),
        metrics_address=address,
        metrics_port=port,
        admin_access=_access(data.get("admin", {}), "admin", _own_access()),
        env_default_access=env_default,
        env_access=env_access,
        timeslice_gpus=ts_gpus,
        quantum=quantum,
        turn_timeout=turn_timeout,
        guard=guard,
    )
