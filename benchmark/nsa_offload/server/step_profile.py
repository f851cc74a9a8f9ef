"""Where a decode step's time goes: torch-profiler traces of a live server.

``bench_server.py --profile-steps N`` runs each point once more after its
measured runs and, while the requests decode, asks the server to profile N
forward steps (sglang's ``/start_profile``, CPU + GPU activities). This module
reads the chrome trace it writes and sums, per profiled step:

* GPU kernel time by category: the offload's swap (the select and reorder
  kernels, the ``_swap_multi_*`` ones in MTP verify), its miss copy
  (``_gather_rows_kernel``), its new-token backup
  (``_copy_rows_all_layers_kernel``) and window mapping
  (``_map_new_tokens_kernel``), HiSparse's kernels, and everything else
  (the model). The early swap runs on a side stream, but a CUDA-graph replay
  spreads even a single-stream forward over several streams, so streams
  tell nothing;
* GPU busy time (union of all kernel intervals) and the span from the first to
  the last kernel (about the step time while profiled);
* host-side launches (CUDA runtime/driver launch calls, graph launches) and
  the CPU time spent in them: work that runs outside the CUDA graphs;
* the scheduler's host time per step (its ``step[...]`` annotations): with
  the overlap scheduler a step takes max(host, GPU), so at small batches,
  where the GPU idles, this is what the inter-token latency follows.

The profiler slows the server down, so the absolute times are not the
benchmark's ITL; the split between categories is what it is for.
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
import urllib.request
from typing import Dict, Iterable, List, Optional, Tuple

# Kernel name fragments -> category (the first match wins).
KERNEL_CATEGORIES: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    # The select kernel and the three of the reorder (one query token); with
    # several query tokens (MTP verify) the classify and assign ones (and the
    # count and rank kernels).
    (
        "swap",
        (
            "_swap_select_kernel",
            "_swap_count_kernel",
            "_swap_rank_kernel",
            "_swap_copy_order_kernel",
            "_swap_multi_classify_kernel",
            "_swap_multi_assign_kernel",
        ),
    ),
    ("h2d_copy", ("_gather_rows_kernel",)),
    ("backup", ("_copy_rows_all_layers_kernel",)),
    # Once per step: the new tokens' locs mapped to their window rows.
    ("map_new_tokens", ("_map_new_tokens_kernel",)),
    ("hisparse", ("load_cache_to_device_buffer", "hisparse")),
)
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
)


def kernel_category(name: str) -> str:
    for category, fragments in KERNEL_CATEGORIES:
        if any(f in name for f in fragments):
            return category
    return "other"


def _busy_us(intervals: Iterable[Tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def load_trace_events(path: str) -> List[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize_events(events: List[dict], steps: int) -> dict:
    """Per-step sums of one profiled window of ``steps`` forward steps."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not kernels:
        return {"error": "no GPU kernels in the trace"}
    streams = {e.get("args", {}).get("stream") for e in kernels}
    gpu_us: Dict[str, float] = {}
    for e in kernels:
        category = kernel_category(e.get("name", ""))
        gpu_us[category] = gpu_us.get(category, 0.0) + float(e.get("dur", 0))
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    launches = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in ("cuda_runtime", "cuda_driver")
        and e.get("name") in LAUNCH_CALLS
    ]
    graph_launches = sum(e["name"] == "cudaGraphLaunch" for e in launches)
    host_steps = [
        float(e.get("dur", 0))
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and str(e.get("name", "")).startswith("step[")
    ]
    n = max(steps, 1)
    return {
        "steps": steps,
        "span_ms_per_step": span / n / 1e3,
        "gpu_busy_ms_per_step": _busy_us(intervals) / n / 1e3,
        "gpu_us_per_step": {k: v / n for k, v in sorted(gpu_us.items())},
        "kernels_per_step": len(kernels) / n,
        "streams": len(streams),
        # mean over the annotated steps (None: the trace has none)
        "host_step_ms": (
            sum(host_steps) / len(host_steps) / 1e3 if host_steps else None
        ),
        "launches_per_step": (len(launches) - graph_launches) / n,
        "graph_launches_per_step": graph_launches / n,
        "launch_cpu_us_per_step": sum(float(e.get("dur", 0)) for e in launches) / n,
    }


def summarize_trace(path: str, steps: int) -> dict:
    summary = summarize_events(load_trace_events(path), steps)
    summary["trace"] = os.path.basename(path)
    return summary


HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver")


def host_ops(events: List[dict]) -> Dict[str, Tuple[int, float]]:
    """Host-side torch ops and CUDA API calls: name -> (calls, CPU us)."""
    ops: Dict[str, Tuple[int, float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES:
            n, us = ops.get(e["name"], (0, 0.0))
            ops[e["name"]] = (n + 1, us + float(e.get("dur", 0)))
    return ops


def host_op_diff(base_events: List[dict], other_events: List[dict], steps: int):
    """Per step, the host ops whose call count differs between two profiled
    windows of ``steps`` steps (e.g. no offload vs the offload at one point):
    what the other server adds to, or removes from, every step's host work.
    Rows ``(name, calls per step base, other, CPU us per step base, other)``."""
    a, b = host_ops(base_events), host_ops(other_events)
    n = max(steps, 1)
    rows = []
    for name in sorted(set(a) | set(b)):
        (calls_a, us_a), (calls_b, us_b) = a.get(name, (0, 0.0)), b.get(name, (0, 0.0))
        if calls_a != calls_b:
            rows.append((name, calls_a / n, calls_b / n, us_a / n, us_b / n))
    return rows


def shared_host_time(base_events: List[dict], other_events: List[dict], steps: int):
    """CPU us per step of the host ops both windows call equally often:
    ``(base, other)``; their ratio is how much faster or slower the host ran
    the same work (noise, frequency), apart from what one server adds."""
    a, b = host_ops(base_events), host_ops(other_events)
    same = [k for k in a if k in b and a[k][0] == b[k][0]]
    n = max(steps, 1)
    return sum(a[k][1] for k in same) / n, sum(b[k][1] for k in same) / n


# The last kernel before a layer's swap (the indexer's top-k, or the
# benchmark's override of it) and the sparse decode attention that reads the
# swapped rows.
TOPK_KERNELS = ("_topk_override_kernel", "topk_kernel")
ATTENTION_KERNEL = "flash_fwd_splitkv_mla"


def layer_profile(events: List[dict], layers_per_step: int) -> dict:
    """Per layer: GPU us by kernel name (the offload's own and the largest
    others), and the median gap from the end of the layer's top-k to the
    start of its attention: what the swap adds to the layer when it does not
    hide behind the query side's kernels."""
    kernels = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"),
        key=lambda e: float(e["ts"]),
    )
    attention = [
        i for i, e in enumerate(kernels) if ATTENTION_KERNEL in e.get("name", "")
    ]
    if not attention:
        return {"error": "no sparse decode attention kernels in the trace"}
    per_name: Dict[str, float] = {}
    for e in kernels:
        name = e.get("name", "")
        per_name[name] = per_name.get(name, 0.0) + float(e.get("dur", 0))
    # Layers profiled: attention launches (one per layer, MTP verify aside).
    n = len(attention)
    gaps = []
    # Kernels that start between the top-k's end and the attention's start,
    # by name: their durations (the offload's own run on its side stream).
    window: Dict[str, List[float]] = {}
    start = 0
    for i in attention:
        topk_end = None
        for e in kernels[start:i]:
            if any(t in e.get("name", "") for t in TOPK_KERNELS):
                topk_end = float(e["ts"]) + float(e["dur"])
        if topk_end is not None:
            gaps.append(float(kernels[i]["ts"]) - topk_end)
            for e in kernels[start:i]:
                if float(e["ts"]) >= topk_end:
                    name = e.get("name", "")[:60]
                    window.setdefault(name, []).append(float(e["dur"]))
        start = i + 1
    gaps.sort()
    top = sorted(per_name.items(), key=lambda kv: -kv[1])
    offload = {k: v for k, v in top if kernel_category(k) != "other"}
    return {
        "layers": n,
        "steps": round(n / max(layers_per_step, 1), 2),
        "topk_to_attention_us": {
            "median": round(gaps[len(gaps) // 2], 2) if gaps else None,
            "p10": round(gaps[len(gaps) // 10], 2) if gaps else None,
            "p90": round(gaps[9 * len(gaps) // 10], 2) if gaps else None,
        },
        "offload_us_per_layer": {k: round(v / n, 2) for k, v in offload.items()},
        # Median duration over the layers that ran it (in at least half of
        # them): a forward kernel slowed beside the offload's shows against
        # the no-offload server's.
        "topk_to_attention_kernels_us": {
            k: round(sorted(v)[len(v) // 2], 2)
            for k, v in window.items()
            if len(v) * 2 >= len(gaps)
        },
        "top_kernels_us_per_layer": {k[:80]: round(v / n, 2) for k, v in top[:12]},
    }


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    summ = sub.add_parser("summary", help="per-step summary of one trace")
    summ.add_argument("trace", help="torch profiler trace (.json) of a server")
    summ.add_argument(
        "--steps", type=int, required=True, help="decode steps the trace covers"
    )
    diff = sub.add_parser(
        "diff", help="host ops whose calls per step differ between two traces"
    )
    diff.add_argument("base", help="profiler trace of the reference server")
    diff.add_argument("other", help="profiler trace of the server compared")
    diff.add_argument(
        "--steps", type=int, required=True, help="decode steps the trace covers"
    )
    per_layer = sub.add_parser(
        "layers", help="per-layer kernel times and the top-k -> attention gap"
    )
    per_layer.add_argument("trace", help="torch profiler trace of a server")
    per_layer.add_argument(
        "--layers", type=int, default=61, help="model layers (for steps profiled)"
    )
    args = p.parse_args(argv)
    if args.cmd == "layers":
        result = layer_profile(load_trace_events(args.trace), args.layers)
        print(json.dumps({"trace": os.path.basename(args.trace), **result}, indent=1))
        return
    if args.cmd == "summary":
        print(json.dumps(summarize_trace(args.trace, args.steps), indent=1))
        return
    base_events, other_events = (load_trace_events(p) for p in (args.base, args.other))
    rows = host_op_diff(base_events, other_events, args.steps)
    same_a, same_b = shared_host_time(base_events, other_events, args.steps)
    print(f"base: {os.path.basename(args.base)}")
    print(f"other: {os.path.basename(args.other)}")
    print()
    print("| host op | calls/step base | calls/step other | CPU us/step base | other |")
    print("|---|---:|---:|---:|---:|")
    for name, ca, cb, ua, ub in rows:
        print(f"| `{name}` | {ca:.2f} | {cb:.2f} | {ua:.1f} | {ub:.1f} |")
    if not rows:
        print("| (none: the same host ops every step) | | | | |")
    print()
    print(
        f"Ops called equally often in both: {same_a:.0f} -> {same_b:.0f} CPU us "
        f"per step ({same_b / max(same_a, 1e-9):.2f}x)."
    )


def _newest_trace(directory: str, since: float) -> Optional[str]:
    if not os.path.isdir(directory):
        return None
    found = [
        os.path.join(directory, f)
        for f in os.listdir(directory)
        if f.endswith(".trace.json.gz")
    ]
    found = [p for p in found if os.path.getmtime(p) >= since]
    return max(found, key=os.path.getmtime) if found else None


def _wait_for_decode(log_path: str, offset: int, batch: int, timeout: float) -> bool:
    """True once the log shows a decode line with ``batch`` running requests
    after ``offset``."""
    needle = f"#running-req: {batch},"
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open(log_path, errors="replace") as f:
            f.seek(offset)
            if any("Decode batch" in line and needle in line for line in f.readlines()):
                return True
        time.sleep(0.05)
    return False


def start_profile(url: str, output_dir: str, steps: int, prefix: str) -> None:
    body = json.dumps(
        {
            "output_dir": output_dir,
            "num_steps": steps,
            "activities": ["CPU", "GPU"],
            "profile_prefix": prefix,
            # Python stacks and shapes would multiply the trace's size.
            "with_stack": False,
            "record_shapes": False,
        }
    ).encode()
    req = urllib.request.Request(
        url + "/start_profile", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def profile_point(server, run_requests, batch: int, steps: int, out_dir: str, label):
    """Run ``run_requests()`` (one point's requests) in a thread and profile
    ``steps`` forward steps once all ``batch`` requests decode together.
    Returns the trace summary, or ``{"error": ...}``."""
    offset = os.path.getsize(server.log_path)
    done: dict = {}
    worker = threading.Thread(target=lambda: done.update(result=run_requests()))
    tic = time.time()
    worker.start()
    try:
        if not _wait_for_decode(server.log_path, offset, batch, timeout=120):
            return {"error": f"no decode line with {batch} running requests"}
        trace_dir = os.path.join(out_dir, "profiles")
        start_profile(server.url, trace_dir, steps, label)
    except Exception as e:  # the point itself still completes
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        worker.join()
    summary = None
    for _ in range(120):  # the trace is written after the last step
        path = _newest_trace(trace_dir, tic)
        try:
            summary = summarize_trace(path, steps) if path else None
        except (OSError, EOFError, ValueError):  # still being written
            summary = None
        if summary is not None:
            break
        time.sleep(0.5)
    if summary is None:
        return {"error": "the server wrote no readable trace"}
    summary["requests_errors"] = done.get("result", {}).get("num_errors")
    return summary


if __name__ == "__main__":
    main()
