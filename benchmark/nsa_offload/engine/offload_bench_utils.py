"""Shared helpers of the NSA KV-offload GPU scripts (timing, outputs, imports).

Timing: each measured call is preceded by a GPU sleep kernel long enough to
cover the host-side launch cost, so the CUDA events around the call measure
GPU time only (no idle gaps while Python enqueues kernels). Results are
medians over many repeats.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch

# CPU smoke mode (development only): run a script's logic on the CPU under the
# Triton interpreter with tiny sizes; timings are meaningless.
SMOKE = os.environ.get("NSA_OFFLOAD_BENCH_CPU_SMOKE") == "1"
# Needs the CPU venv of scripts/setup_cpu_env.sh (``import sglang`` works there).
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

PATCH_HINT = (
    "the offload modules are not importable from the installed sglang; apply the "
    "patch set first: python scripts/apply_patch.py --sglang-dir <site-packages "
    "holding sglang, e.g. /tmp/site>"
)


def import_offload_modules():
    """Import our engine modules from the installed (patched) sglang, or exit."""
    try:
        from sglang.srt.mem_cache import (
            lru_cache_state,
            nsa_kv_offload_copy,
            nsa_kv_only_host_pool,
            sparse_cache_controller,
        )
    except Exception as e:  # pragma: no cover - environment problem
        print(f"FATAL: {PATCH_HINT}\n  ({type(e).__name__}: {e})", flush=True)
        sys.exit(2)
    return (
        lru_cache_state,
        nsa_kv_offload_copy,
        nsa_kv_only_host_pool,
        sparse_cache_controller,
    )


def bench_device() -> torch.device:
    return torch.device("cpu" if SMOKE else "cuda")


def sync() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


def require_cuda() -> None:
    if SMOKE:
        print("CPU SMOKE MODE: timings are meaningless", flush=True)
        return
    if not torch.cuda.is_available():
        print("FATAL: this script needs a CUDA GPU", flush=True)
        sys.exit(2)


def env_info() -> Dict[str, object]:
    info: Dict[str, object] = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "argv": sys.argv,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        pass
    try:
        import sglang

        info["sglang"] = getattr(sglang, "__version__", "?")
    except Exception:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["sm_count"] = props.multi_processor_count
    return info


def gpu_sleep_cycles(us: float) -> int:
    """Cycles of ``torch.cuda._sleep`` for about ``us`` microseconds."""
    try:
        clock_mhz = torch.cuda.get_device_properties(0).clock_rate / 1000.0
    except Exception:
        clock_mhz = 0
    if not clock_mhz:
        clock_mhz = 1980.0
    return int(us * clock_mhz)


def time_gpu(
    fn: Callable[[int], None],
    iters: int,
    setup: Optional[Callable[[int], None]] = None,
    warmup: int = 3,
    sleep_us: float = 500.0,
) -> Dict[str, float]:
    """GPU time of ``fn(i)`` in microseconds over ``iters`` calls.

    ``setup(i)`` runs before call ``i`` outside the timed region (e.g. to load
    fresh inputs). Returns median, p10, p90, min and the sample count.
    """
    if SMOKE:
        samples = []
        for i in range(2):
            if setup is not None:
                setup(i)
            t0 = time.perf_counter()
            fn(i)
            samples.append((time.perf_counter() - t0) * 1e6)
        return summarize(samples)
    for i in range(warmup):
        if setup is not None:
            setup(i)
        fn(i)
    torch.cuda.synchronize()
    cycles = gpu_sleep_cycles(sleep_us)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if setup is not None:
            setup(warmup + i)
        torch.cuda._sleep(cycles)
        starts[i].record()
        fn(warmup + i)
        ends[i].record()
    torch.cuda.synchronize()
    samples = sorted(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends))
    return summarize(samples)


def time_swap_graph(
    body: Callable[[], None], counters: torch.Tensor, calls: int, reps: int
) -> "tuple[float, float]":
    """(median GPU microseconds per call, miss rate) of ``body`` (``calls``
    consecutive LRU swaps) captured in a CUDA graph and replayed ``reps``
    times; ``counters`` is the swapped layer's (hits, window hits, misses)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # JIT + reach a steady state on this trajectory
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    before = counters.clone()
    events = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    c = (counters - before).tolist()
    per_call_us = [a.elapsed_time(b) * 1000.0 / calls for a, b in events]
    lookups = c[0] + c[2]
    return statistics.median(per_call_us), (c[2] / lookups if lookups else 0.0)


def finish_check(result: Dict, failures: List[str], out: str) -> int:
    """Write a GPU check's JSON (with its failures), say OK / FAILED; the
    process exit code."""
    result["failures"], result["ok"] = failures, not failures
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{'OK' if not failures else f'FAILED ({len(failures)})'}; wrote {out}")
    return 0 if not failures else 1


def summarize(samples_us: List[float]) -> Dict[str, float]:
    n = len(samples_us)
    s = sorted(samples_us)
    return {
        "median_us": statistics.median(s),
        "p10_us": s[max(0, int(0.1 * (n - 1)))],
        "p90_us": s[min(n - 1, int(round(0.9 * (n - 1))))],
        "min_us": s[0],
        "n": n,
    }


def gbps(num_bytes: float, us: float) -> float:
    return num_bytes / (us * 1e-6) / 1e9 if us > 0 else float("nan")


def try_call(what: str, fn: Callable[[], object], errors: Dict[str, str]):
    """Run ``fn``; on failure print the reason, record it and return None."""
    try:
        return fn()
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
        print(f"[skip] {what}: {msg}", flush=True)
        traceback.print_exc(limit=3)
        errors[what] = msg
        return None


def write_json(out_dir: str, name: str, data) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    print(f"wrote {path}", flush=True)
    return path


def write_text(out_dir: str, name: str, text: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", flush=True)
    return path


def markdown_table(header: List[str], rows: List[List[object]]) -> str:
    def fmt(x):
        if isinstance(x, float):
            if x != x:
                return "n/a"
            return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
        return "n/a" if x is None else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(x) for x in row) + " |")
    return "\n".join(lines) + "\n"


def get_pyplot():
    """matplotlib.pyplot with a file backend, or None (plots are then skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except Exception as e:
        print(f"[skip] PNG plot: matplotlib unavailable ({e})", flush=True)
        return None
