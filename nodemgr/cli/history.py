"""``nodemgr history``: the allocation records of ended and running tasks."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import click

from gpushare.messages import History
from gpushare.params import EnvNameType
from gpushare.sizes import format_size
from nodemgr.cli._common import admin_call, config_option, json_option, print_json, print_table

_AGO = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$", re.ASCII)
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class SinceType(click.ParamType):  # type: ignore[type-arg]
    """A point in time: a duration ago (90s, 30m, 12h, 7d, 2w) or an ISO date/time."""

    name = "WHEN"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, float):
            return value
        text = str(value).strip()
        m = _AGO.match(text)
        if m:
            ago = float(m.group(1)) * _UNIT[m.group(2)]
            if ago <= time.time():  # a number so long it is inf, or before 1970
                return time.time() - ago
        try:
            if not text.isascii():
                raise ValueError(text)
            return datetime.fromisoformat(text).timestamp()
        except (ValueError, OverflowError, OSError):
            self.fail(
                f"{text!r} is neither a duration (90s, 30m, 12h, 7d, 2w) nor an ISO date "
                "(2026-11-22 or 2026-11-22T08:00)",
                param,
                ctx,
            )


def _predicted(r: Mapping[str, Any]) -> str:
    """PREDICTED: a task's predicted peak per GPU, with its top-ups (docs/prediction.md)."""
    predicted = r.get("predicted")
    if not isinstance(predicted, int):
        return "-"
    topups = r.get("topups") or 0
    return format_size(predicted) + (
        f" +{topups} top-up{'s' if topups != 1 else ''}" if topups else ""
    )


def _step(r: Mapping[str, Any]) -> str:
    """STEP: its measured seconds per iteration, and nodemgr's estimate before it ran
    (docs/prediction.md#step-time)."""
    step, predicted = r.get("step"), r.get("predicted_step")
    shown = "-" if step is None else f"{step * 1000:.1f}ms"
    if predicted is not None:
        shown += f" (est {predicted * 1000:.1f}ms)"
    return shown


def _when(t: float | None) -> str:
    return "-" if t is None else datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


@click.command()
@click.argument("env", type=EnvNameType(), required=False)
@click.option("--since", type=SinceType(), default=None, help="Only tasks started since WHEN.")
@click.option(
    "--limit", type=click.IntRange(1, 10000), default=100, show_default=True, help="At most N."
)
@config_option
@json_option
def history(
    env: str | None, since: float | None, limit: int, config_path: str | None, as_json: bool
) -> None:
    """Allocation records, newest first: ENV's, or every environment's.

    Each record: the task, its environment and GPUs, the per-GPU memory
    granted, the peak its processes used, and for a task sent with a
    prediction (gpushare-run --shape predicted) its predicted peak per GPU and
    how often its grant was topped up, its measured time per iteration (with
    nodemgr's estimate), when it started and ended, and why it ended (done,
    killed, exited, timeout, admin, idle, undelivered, preempted).
    """
    records = admin_call(config_path, History(env=env, since=since, limit=limit)).records
    if as_json:
        print_json(records)
        return
    print_table(
        [
            "TASK",
            "ENV",
            "CLASS",
            "GPU",
            "MEMORY/GPU",
            "PEAK",
            "PREDICTED",
            "STEP",
            "STARTED",
            "ENDED",
            "REASON",
            "EXIT",
        ],
        [
            [
                r["task_id"],
                r["env"],
                r.get("task_class") or "-",
                ",".join(map(str, r["gpus"])),
                format_size(r["memory"]),
                format_size(r["peak"]),
                _predicted(r),
                _step(r),
                _when(r["started"]),
                _when(r["ended"]),
                r["reason"] or "running",
                "-" if r["exit_code"] is None else str(r["exit_code"]),
            ]
            for r in records
        ],
    )
