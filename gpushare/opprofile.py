"""A dry run's operator profile (docs/prediction.md#the-operator-profile): what one
iteration's PyTorch operators compute and move on the GPU, for the step time estimate.

gpushare.iterations starts it after a dry run's release, for the one iteration it runs
then, and reads it at that iteration's boundary: the iterations whose host time and
launches the dry run measures run without it (a Python dispatch mode slows every
operator's dispatch). It only counts: it allocates no device memory of its own.

For each ATen operator with a tensor in device memory it counts the calls; the
floating-point operations (PyTorch's own formulas, ``torch.utils.flop_counter``: matrix
products, convolutions, attention; other operators count none), 16-bit and narrower apart
from the rest, and TF32 (fp32 matrix products and convolutions PyTorch lets the tensor
cores do) as two 16-bit operations each, a tensor core doing them at half the 16-bit rate;
the bytes of the distinct device tensors it reads and of those it writes (a roofline's
traffic: operators that only make views move nothing, and copies are the copy counters',
gpushare.iterations); and its largest input's elements. The batch is the leading dimension
of the first tensor the iteration copies to the device, else of the first operator's first
device tensor that is not a parameter. Steps PyTorch does not dispatch operator by
operator (a replayed CUDA graph) are not counted.

A process that has compiled anything with TorchDynamo (``torch.compile``; PyTorch's eager
``flex_attention`` and ``torch.cond`` compile too) gets no profile: TorchDynamo refuses to
compile under a dispatch mode of this kind, and a compilation in full-graph mode would
fail the step. Higher-order operators that reach the mode run uncounted.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

# Element types whose arithmetic a GPU does on its tensor cores (16 bits or fewer).
HALF_TYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
# Operators that are copies: what they move is the copy counters'.
COPIES = frozenset({"copy_", "_to_copy", "clone", "_copy_from", "_copy_from_and_resize"})
# Operators whose fp32 arithmetic may run as TF32: matrix products (with a float32 matmul
# precision other than "highest") and convolutions (cudnn.allow_tf32).
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm"})


@dataclass
class OpFigures:
    calls: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    largest: int = 0  # the largest input's elements


@dataclass
class Profile:
    ops: dict[str, OpFigures] = field(default_factory=dict)
    flops: float = 0.0  # in 32 bits or wider
    half_flops: float = 0.0  # in 16 bits or narrower, TF32 counted twice
    bytes: float = 0.0
    batch: int | None = None
    batch_copied: bool = False  # the batch is a copy's to the device

    def as_json(self) -> dict[str, Any]:
        return {
            "flops": self.flops,
            "half_flops": self.half_flops,
            "bytes": self.bytes,
            "batch": self.batch,
            "ops": {
                name: [f.calls, f.flops, f.bytes, f.largest] for name, f in sorted(self.ops.items())
            },
        }


@dataclass
class Started:
    """A profile being counted: its mode, and the thread that entered it."""

    mode: Any
    profile: Profile
    thread: int
    current_mode: Any  # torch's _get_current_dispatch_mode


def compiled(torch: ModuleType) -> bool:
    """Whether this process has had TorchDynamo compile a frame (torch.compile)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    counters = getattr(dynamo, "counters", None)
    if counters is None:
        return False  # never imported: nothing compiled
    try:
        return bool(counters["stats"]["unique_graphs"] or counters["frames"]["total"])
    except (KeyError, TypeError):
        return True  # a TorchDynamo of another shape: not known to be safe


def start(torch: ModuleType) -> Started:
    """Start counting this thread's iteration's operators (the backward pass's too, which
    autograd runs with this thread's modes on)."""
    # Through importlib, as Any: the package does not depend on torch.
    dispatch = importlib.import_module("torch.utils._python_dispatch")
    tree_leaves = importlib.import_module("torch.utils._pytree").tree_leaves
    flop_registry = importlib.import_module("torch.utils.flop_counter").flop_registry
    overload = importlib.import_module("torch._ops").OpOverload
    parameter = torch.nn.Parameter

    half = {getattr(torch, name) for name in HALF_TYPES if hasattr(torch, name)}
    tf32_mm = torch.get_float32_matmul_precision() != "highest"
    tf32_conv = bool(torch.backends.cudnn.allow_tf32)
    profile = Profile()
    lock = threading.Lock()  # the backward pass runs on autograd's own threads

    def written(func: Any, args: Any, kwargs: Any) -> list[Any]:
        """The tensors among the arguments the operator's schema says it writes."""
        out = []
        for i, arg in enumerate(func._schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        return out

    def nbytes(tensors: list[Any]) -> int:
        distinct = {id(t): t for t in tensors if t.is_cuda}
        return sum(t.numel() * t.element_size() for t in distinct.values())

    def count(func: Any, args: Any, kwargs: Any, out: Any) -> None:
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not any(t.is_cuda for t in inputs + outputs):
            return
        name = getattr(func.overloadpacket, "__name__", str(func.overloadpacket))
        to_device = bool(inputs and outputs) and not inputs[0].is_cuda and outputs[0].is_cuda
        moved = 0
        if not func.is_view and name not in COPIES:
            moved = nbytes(inputs) + nbytes(outputs + written(func, args, kwargs))
        with lock:
            f = profile.ops.setdefault(name, OpFigures())
            f.calls += 1
            f.bytes += moved
            f.largest = max([f.largest, *(t.numel() for t in inputs)])
            profile.bytes += moved
            if to_device and not profile.batch_copied and inputs[0].dim() >= 1:
                profile.batch, profile.batch_copied = int(inputs[0].shape[0]), True
            elif profile.batch is None:
                data = [t for t in inputs if t.is_cuda and t.dim() >= 1]
                data = [t for t in data if not isinstance(t, parameter)]
                if data:
                    profile.batch = int(data[0].shape[0])
        formula = flop_registry.get(func.overloadpacket)
        if formula is None:
            return
        flops = float(formula(*args, **kwargs, out_val=out))
        floats = [t.dtype for t in inputs if t.is_floating_point()]
        allowed = (name in MATMULS and tf32_mm) or ("convolution" in name and tf32_conv)
        tf32 = allowed and bool(floats) and floats[0] == torch.float32
        with lock:
            f.flops += flops
            if any(d in half for d in floats):
                profile.half_flops += flops
            elif tf32:
                profile.half_flops += 2 * flops
            else:
                profile.flops += flops

    base: Any = dispatch.TorchDispatchMode

    class Counting(base):  # type: ignore[misc]
        # Higher-order operators come here too (the mode refuses them otherwise): run as
        # they are, uncounted.
        supports_higher_order_operators = True

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if isinstance(func, overload):
                # A profile must never break the step: what fails to count counts none.
                with contextlib.suppress(Exception):
                    count(func, args, kwargs, out)
            return out

    mode = Counting()
    mode.__enter__()
    return Started(mode, profile, threading.get_ident(), dispatch._get_current_dispatch_mode)


def stop(started: Started) -> dict[str, Any] | None:
    """Stop counting; the profile (Profile.as_json), or None where it counted no operator
    (a replayed graph, a compiled step) or cannot be stopped as it was started: on another
    thread, or with another mode entered after it still on (it is then left on)."""
    if threading.get_ident() != started.thread or started.current_mode() is not started.mode:
        return None
    try:
        started.mode.__exit__(None, None, None)
    except Exception:
        return None
    if not started.profile.ops:
        return None
    return started.profile.as_json()
