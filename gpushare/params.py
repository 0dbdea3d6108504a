"""Click parameter types shared by ``nodemgr`` and ``gpushare-run``: each refuses a bad
value with exit 2 and the accepted form, through the one parser of its kind."""

from __future__ import annotations

import re
import reprlib

import click

from gpushare.protocol import DEVICE_NAME, ENV_NAME, MAX_GPUS_PER_REQUEST, task_class
from gpushare.sizes import parse_seconds, parse_size, unitless

_COUNT = re.compile(r"^\s*[0-9]+\s*$")


class SizeType(click.ParamType):  # type: ignore[type-arg]
    """Bytes, or a number with a unit: 512MiB, 8GiB, 1.5G. With ``warn_unitless``, a bare
    number other than 0 is still bytes but warned of on stderr (``--memory 12`` is seldom
    meant as 12 bytes)."""

    name = "SIZE"

    def __init__(self, warn_unitless: bool = False) -> None:
        self.warn_unitless = warn_unitless

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int:
        try:
            n = parse_size(value if isinstance(value, int) else str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if self.warn_unitless and n and isinstance(value, str) and unitless(value):
            option = param.opts[0] if param is not None and param.opts else "the size"
            click.echo(
                f"warning: {option} {value.strip()} has no unit, so it is {value.strip()} "
                f"bytes; write a unit for more ({value.strip()}GiB, {value.strip()}MiB)",
                err=True,
            )
        return n


class SecondsType(click.ParamType):  # type: ignore[type-arg]
    """A finite number of seconds from ``low`` to ``high`` (click's FloatRange lets nan in)."""

    name = "SECONDS"

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            return parse_seconds(value, self.low, self.high)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class CountType(click.ParamType):  # type: ignore[type-arg]
    """A whole number from ``low`` to ``high``, in ASCII digits (int() takes others too)."""

    name = "N"

    def __init__(self, low: int, high: int | None = None) -> None:
        self.low, self.high = low, high

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
        elif isinstance(value, str) and _COUNT.match(value):
            n = int(value)
        else:
            n = -1
        if n < self.low or (self.high is not None and n > self.high):
            upto = f"{self.high}" if self.high is not None else "more"
            self.fail(f"{value!r} is not a whole number from {self.low} to {upto}", param, ctx)
        return n


class ComputeCapType(CountType):
    """A compute share in percent, ``low`` to 100, or ``none``: 0 (docs/compute.md)."""

    name = "PERCENT|none"

    def __init__(self, low: int = 0) -> None:
        super().__init__(low, 100)

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int:
        if isinstance(value, str) and value.strip().lower() == "none":
            return 0
        return super().convert(value, param, ctx)


class EnvNameType(click.ParamType):  # type: ignore[type-arg]
    """An environment's name as nodemgr accepts it (protocol.ENV_NAME)."""

    name = "ENV"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> str:
        text = str(value)
        if not ENV_NAME.fullmatch(text):
            self.fail(
                f"{text!r} is not an environment name: 1 to 64 characters, letters, digits, "
                "'_', '.' and '-', starting with a letter or digit",
                param,
                ctx,
            )
        return text


class ClassType(click.ParamType):  # type: ignore[type-arg]
    """A task class (docs/scheduling.md, "Classes"): ls or be, or their long forms
    latency-sensitive and best-effort, any case; normalised to ls or be."""

    name = "ls|be"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> str:
        try:
            return task_class(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


ALL_GPUS = "all"


class GpuType(click.ParamType):  # type: ignore[type-arg]
    """A GPU as the admin commands name it: an index as `nodemgr status` numbers them (an
    int), a GPU UUID or a prefix of one (a str, as nodemgr resolves it), or "all"."""

    name = "GPU"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | str:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        text = str(value)
        if text == ALL_GPUS:
            return text
        if DEVICE_NAME.fullmatch(text):
            if not text.isdigit():
                return text
            if int(text) < MAX_GPUS_PER_REQUEST:
                return int(text)
        self.fail(
            f"{reprlib.repr(text)} is not a GPU: an index from 0 to {MAX_GPUS_PER_REQUEST - 1} "
            "as `nodemgr status` numbers them, a GPU UUID (GPU-...) or a prefix of one of at "
            'least 8 characters, or "all"',
            param,
            ctx,
        )
