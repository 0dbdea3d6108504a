"""nodemgr's TOML configuration: one place that knows every key and its default."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodemgr.sizes import parse_size

DEFAULT_CONFIG = Path("/etc/gpushare/nodemgr.toml")
CONFIG_ENV = "GPUSHARE_CONFIG"


class ConfigError(Exception):
    """The configuration file is missing, unreadable or wrong; the message names the key."""


@dataclass(frozen=True)
class Config:
    path: Path | None
    run_dir: Path
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    sweep_interval: float = 0.1
    gpu_source: str = "auto"
    sim_count: int = 4
    sim_memory: int = 16 << 30
    sim_name: str = "gpushare Simulated GPU"
    task_threshold: int = 4
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def admin_endpoint(self) -> str:
        return f"ipc://{self.run_dir / 'admin.sock'}"

    def env_dir(self, env: str) -> Path:
        return self.run_dir / "envs" / env


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


_KEYS: dict[str, set[str]] = {
    "node": {"run_dir", "heartbeat_interval", "heartbeat_timeout", "sweep_interval"},
    "gpus": {"source", "simulated_count", "simulated_memory", "simulated_name"},
    "scheduler": {"task_threshold"},
}


def _number(table: dict[str, Any], section: str, key: str, default: float, lo: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < lo:
        raise ConfigError(f"{section}.{key} must be a number >= {lo}, not {value!r}")
    return float(value)


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
        if section not in _KEYS or not isinstance(table, dict):
            raise ConfigError(f"unknown section [{section}] in {file}")
        for key in table:
            if key not in _KEYS[section]:
                raise ConfigError(f"unknown key {section}.{key} in {file}")
    node = data.get("node", {})
    gpus = data.get("gpus", {})
    sched = data.get("scheduler", {})

    run_dir = node.get("run_dir")
    if run_dir is not None and (not isinstance(run_dir, str) or not run_dir):
        raise ConfigError(f"node.run_dir must be a path, not {run_dir!r}")
    if run_dir and file is not None and not os.path.isabs(run_dir):
        run_dir = str(file.parent / run_dir)

    source = gpus.get("source", "auto")
    if source not in ("auto", "nvml", "simulated"):
        raise ConfigError(f"gpus.source must be auto, nvml or simulated, not {source!r}")
    count = gpus.get("simulated_count", 4)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 16:
        raise ConfigError(f"gpus.simulated_count must be an integer 1..16, not {count!r}")
    try:
        memory = parse_size(gpus.get("simulated_memory", "16GiB"))
    except ValueError as e:
        raise ConfigError(f"gpus.simulated_memory: {e}") from None
    if memory <= 0:
        raise ConfigError("gpus.simulated_memory must be positive")
    name = gpus.get("simulated_name", "gpushare Simulated GPU")
    if not isinstance(name, str) or not name or any(c in name for c in "|;\n"):
        raise ConfigError("gpus.simulated_name must be a non-empty string without | ; or newlines")
    threshold = sched.get("task_threshold", 4)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ConfigError(f"scheduler.task_threshold must be an integer >= 1, not {threshold!r}")

    interval = _number(node, "node", "heartbeat_interval", 1.0, 0.01)
    timeout = _number(node, "node", "heartbeat_timeout", 5.0, 0.05)
    if timeout <= interval:
        raise ConfigError(
            f"node.heartbeat_timeout ({timeout}) must be longer than "
            f"node.heartbeat_interval ({interval})"
        )
    return Config(
        path=file,
        run_dir=Path(run_dir) if run_dir else default_run_dir(),
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        sweep_interval=_number(node, "node", "sweep_interval", 0.1, 0.01),
        gpu_source=source,
        sim_count=count,
        sim_memory=memory,
        sim_name=name,
        task_threshold=threshold,
    )
