"""The cases of the real-PyTorch tier (test_torch_sim.py), run by the pinned torch
venv's Python on the simulated driver, without gpushare.

    python torch_cases.py --versions      one JSON line: torch's and its CUDA's versions
    python torch_cases.py CASE [CASE...]  runs the cases in order, in this one process

Each case prints one line, ``@@case `` and a JSON object: ``case``, ``ok`` (it returned
rather than raised), ``value`` (what it observed), ``error`` and ``traceback`` (when it
raised) and ``seconds``. The cases observe; the test file holds the expectations. A case
that hangs has its stacks dumped to stderr and the process exits (``CASE_TIMEOUT``).

The simulated node comes from GPUSHARE_SIM_GPUS (``NAME|UUID|BYTES;...``), the allocator
from PYTORCH_CUDA_ALLOC_CONF, both set by the test. The simulated driver runs no kernels:
memory a kernel would have written reads back as it was, so only what copies and memsets
put in memory is compared here, never a kernel's result.

Runs under the torch venv, not the project's: torch is looked up at run time (``Any``),
so the module type-checks without torch or its stubs.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

# The venv has no numpy; torch says so on import, and nothing here needs it.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
torch: Any = importlib.import_module("torch")

MARK = "@@case "
CASE_TIMEOUT = float(os.environ.get("TORCH_CASES_TIMEOUT", "30"))
CHILD_TIMEOUT = CASE_TIMEOUT / 2  # a spawned child's result
MIB = 1 << 20

Case = Callable[[], dict[str, Any]]
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


def node() -> list[tuple[str, str, int]]:
    """The simulated node's devices: name, UUID, bytes."""
    out = []
    for entry in os.environ["GPUSHARE_SIM_GPUS"].split(";"):
        name, uuid, size = entry.split("|")
        out.append((name, uuid, int(size)))
    return out


def random_bytes(n: int, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def first_mismatch(got: Any, want: Any) -> int | None:
    """The first index where two same-shaped CPU tensors differ, or None."""
    if got.shape != want.shape:
        return -1
    diff = (got.reshape(-1) != want.reshape(-1)).nonzero()
    return int(diff[0, 0]) if len(diff) else None


def compared(got: Any, want: Any) -> dict[str, Any]:
    return {"equal": bool(torch.equal(got, want)), "first_mismatch": first_mismatch(got, want)}


# Device discovery ---------------------------------------------------------------------


@case
def case_device() -> dict[str, Any]:
    # Before CUDA is initialised torch counts devices through NVML (the simulated
    # libnvidia-ml.so.1); is_available() asks cudaGetDeviceCount; after init, the runtime.
    nvml_count = int(torch.cuda._device_count_nvml())
    available = bool(torch.cuda.is_available())
    torch.cuda.init()
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "name": p.name,
                "total_memory": int(p.total_memory),
                "major": int(p.major),
                "minor": int(p.minor),
                "uuid": str(p.uuid),
                "capability": list(torch.cuda.get_device_capability(i)),
            }
        )
    return {
        "nvml_count": nvml_count,
        "available": available,
        "count": torch.cuda.device_count(),
        "devices": devices,
    }


# Copies: only memcpy paths (a copy that needs a kernel on the GPU would read back zeros) --


@case
def case_copy_roundtrip() -> dict[str, Any]:
    # Sizes that land in the small pool (< 1 MiB), the large pool, and across segments.
    out = {}
    for n in (1, 4097, 3 * MIB + 123, 64 * MIB):
        src = random_bytes(n, n)
        out[str(n)] = compared(src.to("cuda:0").cpu(), src)
    f = torch.randn(1000, 37, generator=torch.Generator().manual_seed(2))
    out["float32"] = compared(f.cuda().cpu(), f)
    return out


@case
def case_copy_d2d() -> dict[str, Any]:
    src = random_bytes(5 * MIB + 7, 3)
    a = src.cuda()
    b = a.clone()  # same device, same dtype, contiguous: a device-to-device memcpy
    c = torch.empty_like(a)
    c.copy_(b)
    part = a[1000 : 2 * MIB].clone()  # from an offset into the allocation
    return {
        "clone": compared(b.cpu(), src),
        "copy_": compared(c.cpu(), src),
        "offset": compared(part.cpu(), src[1000 : 2 * MIB]),
    }


@case
def case_copy_peer() -> dict[str, Any]:
    src = random_bytes(3 * MIB + 5, 4)
    on0 = src.to("cuda:0")
    on1 = on0.to("cuda:1")
    back0 = on1.to("cuda:0")
    return {
        "devices": [str(on0.device), str(on1.device), str(back0.device)],
        "to_1": compared(on1.cpu(), src),
        "back_to_0": compared(back0.cpu(), src),
    }


@case
def case_copy_noncontiguous() -> dict[str, Any]:
    m = random_bytes(512 * 300, 5).reshape(512, 300)
    # A non-contiguous CPU source is made contiguous on the CPU, then copied.
    t = m.t()
    rows = m[::2]
    on_gpu = m.cuda()
    return {
        "transposed": compared(t.cuda().cpu(), t.contiguous()),
        "strided_rows": compared(rows.cuda().cpu(), rows.contiguous()),
        # A contiguous range of a GPU tensor (a row slice) is a plain memcpy back.
        "row_slice": compared(on_gpu[100:200].cpu(), m[100:200]),
        "source_contiguous": [bool(t.is_contiguous()), bool(rows.is_contiguous())],
    }


@case
def case_copy_pinned() -> dict[str, Any]:
    src = random_bytes(2 * MIB + 11, 6).pin_memory()
    d = src.to("cuda:0", non_blocking=True)
    out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    out.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        d2 = src.to("cuda:0", non_blocking=True)
        out2 = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        out2.copy_(d2, non_blocking=True)
    side.synchronize()
    return {
        "pinned": [bool(src.is_pinned()), bool(out.is_pinned())],
        "default_stream": compared(out, src),
        "side_stream": compared(out2, src),
    }


# Memory -------------------------------------------------------------------------------


@case
def case_mem_get_info() -> dict[str, Any]:
    torch.cuda.init()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0, total0 = torch.cuda.mem_get_info(0)
    reserved0 = torch.cuda.memory_reserved(0)
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    free1, total1 = torch.cuda.mem_get_info(0)
    reserved1 = torch.cuda.memory_reserved(0)
    del x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free2, _ = torch.cuda.mem_get_info(0)
    free_dev1, total_dev1 = torch.cuda.mem_get_info(1)
    return {
        "before": [free0, total0, reserved0],
        "holding_1gib": [free1, total1, reserved1],
        "after_free": free2,
        "device1": [free_dev1, total_dev1],
    }


@case
def case_oom() -> dict[str, Any]:
    size = node()[0][2]
    torch.cuda.init()
    torch.cuda.empty_cache()
    a = torch.empty(size * 3 // 4, dtype=torch.uint8, device="cuda:0")
    b = None
    error: dict[str, Any] | None = None
    try:
        b = torch.empty(size // 2, dtype=torch.uint8, device="cuda:0")
    except Exception as e:
        error = {
            "type": type(e).__name__,
            "is_oom": isinstance(e, torch.OutOfMemoryError),
            "message": str(e)[:500],
        }
    free_at_oom, _ = torch.cuda.mem_get_info(0)
    del a, b
    # No empty_cache: the caching allocator must reuse what was freed by itself.
    c = torch.empty(size // 2, dtype=torch.uint8, device="cuda:0")
    data = random_bytes(4096, 7)
    c[: data.numel()].copy_(data)
    readback = compared(c[: data.numel()].cpu(), data)
    del c
    torch.cuda.empty_cache()
    return {"size": size, "error": error, "free_at_oom": free_at_oom, "after_free": readback}


# Graphs and events --------------------------------------------------------------------


@case
def case_graph() -> dict[str, Any]:
    static_in = torch.zeros(4096, device="cuda:0")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up torch asks for before a capture
        for _ in range(2):
            static_in * 2 + 1
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = static_in * 2 + 1
        static_sum = static_out.sum()
    data = torch.randn(4096, generator=torch.Generator().manual_seed(8))
    static_in.copy_(data)  # a real copy into the static input, outside the graph
    replays = 0
    for _ in range(3):
        graph.replay()
        replays += 1
    torch.cuda.synchronize()
    # static_out and static_sum hold whatever the (unexecuted) kernels left: not compared.
    result = {
        "replays": replays,
        "static_in": compared(static_in.cpu(), data),
        "out_shape": list(static_out.shape),
        "sum_shape": list(static_sum.shape),
        "out_device": str(static_out.device),
    }
    graph.reset()
    return result


@case
def case_events() -> dict[str, Any]:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    x = random_bytes(MIB, 9)
    start.record()
    y = x.cuda()
    end.record()
    end.synchronize()
    elapsed = start.elapsed_time(end)
    plain = torch.cuda.Event()
    plain.record()
    other = torch.cuda.Stream()
    plain.wait(other)  # the other stream waits for it
    other.synchronize()
    plain.synchronize()
    return {
        "elapsed_ms": elapsed,
        "elapsed_type": type(elapsed).__name__,
        "end_query": bool(end.query()),
        "plain_query": bool(plain.query()),
        "stream_query": bool(torch.cuda.current_stream().query()),
        "copy": compared(y.cpu(), x),
    }


# Data loading and processes ------------------------------------------------------------


@case
def case_dataloader() -> dict[str, Any]:
    data = torch.utils.data
    xs = torch.randn(96, 5, generator=torch.Generator().manual_seed(10))
    ys = torch.arange(96)
    loader = data.DataLoader(
        data.TensorDataset(xs, ys), batch_size=8, num_workers=2, pin_memory=True
    )
    got_x, got_y, pinned = [], [], []
    for bx, by in loader:
        pinned.append(bool(bx.is_pinned() and by.is_pinned()))
        gx, gy = bx.cuda(non_blocking=True), by.cuda(non_blocking=True)
        got_x.append(gx)
        got_y.append(gy)
    torch.cuda.synchronize()
    # Back to the CPU before concatenating: torch.cat on the GPU is a kernel.
    back_x = torch.cat([t.cpu() for t in got_x])
    back_y = torch.cat([t.cpu() for t in got_y])
    return {
        "batches": len(got_x),
        "all_pinned": all(pinned),
        "on_cuda": all(t.is_cuda for t in got_x + got_y),
        "x": compared(back_x, xs),
        "y": compared(back_y, ys),
    }


def collect(queue: Any, proc: Any) -> dict[str, Any]:
    """A spawned child's result, or why there is none (it died, or it took too long)."""
    deadline = time.monotonic() + CHILD_TIMEOUT
    while time.monotonic() < deadline:
        try:
            result: dict[str, Any] = queue.get(timeout=0.5)
            proc.join(CHILD_TIMEOUT)
            return result
        except Exception:  # queue.Empty
            if not proc.is_alive():
                try:
                    late: dict[str, Any] = queue.get(timeout=1)
                    return late
                except Exception:
                    return {"ok": False, "error": f"child exited {proc.exitcode} with no result"}
    proc.kill()
    return {"ok": False, "error": f"no result from the child in {CHILD_TIMEOUT}s"}


def spawn_child(queue: Any, values: list[float]) -> None:
    try:
        x = torch.tensor(values).cuda()
        queue.put(
            {
                "ok": True,
                "values": x.cpu().tolist(),
                "count": torch.cuda.device_count(),
                "name": torch.cuda.get_device_name(0),
                "pid": os.getpid(),
            }
        )
    except BaseException as e:
        queue.put({"ok": False, "error": f"{type(e).__name__}: {e}"})


@case
def case_spawn() -> dict[str, Any]:
    parent = random_bytes(1000, 11)
    parent_copy = compared(parent.cuda().cpu(), parent)  # CUDA in use before the spawn
    values = [float(v) for v in range(17)]
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=spawn_child, args=(queue, values))
    proc.start()
    child = collect(queue, proc)
    proc.join(CHILD_TIMEOUT)
    return {
        "parent": parent_copy,
        "child": child,
        "values": values,
        "exitcode": proc.exitcode,
        "parent_pid": os.getpid(),
    }


def ipc_child(tensor: Any, queue: Any) -> None:
    try:
        queue.put({"ok": True, "values": tensor.cpu().tolist(), "device": str(tensor.device)})
    except BaseException as e:
        queue.put({"ok": False, "error": f"{type(e).__name__}: {e}"})


@case
def case_ipc() -> dict[str, Any]:
    src = torch.randint(0, 1 << 40, (4096,), generator=torch.Generator().manual_seed(12))
    t = src.cuda()
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=ipc_child, args=(t, queue))
    try:
        proc.start()  # pickles the arguments: the tensor's IPC handle is made here
    except Exception as e:
        return {"refused": {"type": type(e).__name__, "message": str(e)[:500]}}
    child = collect(queue, proc)
    proc.join(CHILD_TIMEOUT)
    values = child.pop("values", None)
    return {
        "refused": None,
        "child": child,
        "equal": values == src.tolist(),
        "exitcode": proc.exitcode,
    }


# Training and cuBLAS ------------------------------------------------------------------


@case
def case_train() -> dict[str, Any]:
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 32).cuda()
    target = torch.randn(16, 8).cuda()
    losses = []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    params = list(model.parameters())
    return {
        "steps": len(losses),
        "losses": losses,
        "params_on_cuda": all(p.is_cuda for p in params),
        "grad_shapes_match": all(
            p.grad is not None and p.grad.shape == p.shape and p.grad.is_cuda for p in params
        ),
    }


@case
def case_matmul() -> dict[str, Any]:
    g = torch.Generator().manual_seed(13)
    a, b = torch.randn(128, 64, generator=g).cuda(), torch.randn(64, 32, generator=g).cuda()
    c = torch.matmul(a, b)
    h = torch.matmul(a.half(), b.half())
    batched = torch.bmm(a.reshape(4, 32, 64), b.expand(4, 64, 32).contiguous())
    torch.cuda.synchronize()
    return {
        "shapes": [list(c.shape), list(h.shape), list(batched.shape)],
        "dtypes": [str(c.dtype), str(h.dtype), str(batched.dtype)],
        "devices": [str(c.device), str(h.device), str(batched.device)],
    }


@case
def case_linear() -> dict[str, Any]:
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 32).cuda()
    x = torch.randn(16, 64).cuda().requires_grad_()
    y = lin(x)
    y.sum().backward()
    torch.cuda.synchronize()
    grads = [lin.weight.grad, lin.bias.grad, x.grad]
    return {
        "y_shape": list(y.shape),
        "grad_shapes": [None if g is None else list(g.shape) for g in grads],
        "grads_on_cuda": all(g is not None and g.is_cuda for g in grads),
    }


# Running ------------------------------------------------------------------------------


def run(name: str) -> dict[str, Any]:
    started = time.monotonic()
    faulthandler.dump_traceback_later(CASE_TIMEOUT, exit=True)
    try:
        value = CASES[name]()
        out: dict[str, Any] = {"case": name, "ok": True, "value": value}
    except BaseException as e:
        out = {
            "case": name,
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-3000:],
        }
    finally:
        faulthandler.cancel_dump_traceback_later()
    out["seconds"] = round(time.monotonic() - started, 3)
    gc.collect()
    try:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception as e:
        out["cleanup_error"] = f"{type(e).__name__}: {e}"
    return out


def main(argv: list[str]) -> int:
    if argv == ["--versions"]:
        print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda}))
        return 0
    unknown = [a for a in argv if a not in CASES]
    if not argv or unknown:
        print(f"usage: torch_cases.py --versions | CASE...; unknown: {unknown}", file=sys.stderr)
        print(f"cases: {' '.join(CASES)}", file=sys.stderr)
        return 2
    for name in argv:
        print(MARK + json.dumps(run(name)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
