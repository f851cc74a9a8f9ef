"""The LRU swap with units on the GPU: the swap kernels (select, then the
reorder split by unit) at ``U`` units against one unit, checked against the
torch reference.

A request with ``U`` units has ``U x C`` LRU slots per layer; the swap runs
one select kernel per request (page table and copy list) and spreads the
recency walk over ``U`` programs; on CUDA one more replay under the torch
profiler gives each kernel's time, the select kernel's being what stands
before the miss copy. For each batch size and ``U``, every request holds all
``U`` units and decodes at ``--ctx`` tokens with a top-k that keeps
``--keep`` of the previous step's positions (the rest fresh, uniform).
``--steps`` swaps with distinct top-k inputs are captured in one CUDA graph;
the time per swap is the median over ``--repeats`` replays divided by the
steps. The same steps also run eagerly on a state with the torch reference
(``LRUCacheState(use_triton=False)``), compared after every replay (page
tables, copy plans and the whole LRU state): a mismatch fails the run.

    python benchmark/nsa_offload/engine/bench_swap_units.py --out /tmp/out/swap_units
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
from sglang.srt.mem_cache.lru_cache_state import LRUCacheState
from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import TritonLRUSwap

# Without CUDA (TRITON_INTERPRET=1 set) the same steps run eagerly: a check
# of the script and of kernels = reference, no timing worth reading.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _ints(s: str):
    return [int(x) for x in s.split(",") if x]


def topk_steps(rng, bs: int, ctx: int, k: int, window: int, steps: int, keep: float):
    """(steps, bs, k) int32 top-k positions: each step keeps ``keep`` of the
    previous one, the rest fresh outside the recent window."""
    out = np.empty((steps, bs, k), dtype=np.int32)
    for b in range(bs):
        cur = rng.choice(ctx - window, size=k, replace=False)
        for s in range(steps):
            kept = rng.choice(cur, size=int(keep * k), replace=False)
            pool = np.setdiff1d(np.arange(ctx - window), kept, assume_unique=True)
            fresh = rng.choice(pool, size=k - kept.size, replace=False)
            cur = rng.permutation(np.concatenate([kept, fresh]))
            out[s, b] = cur
    return out


def units_state(
    bs: int, units: int, ctx: int, buffer_size: int, window: int, top_k: int, **kwargs
) -> LRUCacheState:
    """One layer's LRU state with ``bs`` requests of ``ctx`` locs, each holding
    ``units`` units (regions side by side); ``kwargs`` go to LRUCacheState."""
    state = LRUCacheState(
        num_layers=1,
        max_num_reqs=bs,
        num_locs=bs * ctx,
        buffer_size=buffer_size,
        recent_window=window,
        top_k=top_k,
        device=DEVICE,
        max_batch_size=bs,
        max_units=units,
        **kwargs,
    )
    rows = buffer_size + window
    for r in range(bs):
        state.admit_request(r, r * units * rows)
        for u in range(1, units):
            state.grow_request(r, u, (r * units + u) * rows)
    return state


def make_state(args, bs: int, units: int, kernel: str) -> LRUCacheState:
    """``kernel``: "triton" (the swap kernels) or "reference" (torch)."""
    shape = (bs, units, args.ctx, args.buffer_size, args.window, args.top_k)
    if kernel == "reference":
        return units_state(*shape, use_triton=False)
    state = units_state(*shape)
    state.swap_backend = TritonLRUSwap(state, max_batch_size=bs)
    return state


def run_point(args, bs: int, units: int, tops: torch.Tensor) -> dict:
    dev = DEVICE
    req = torch.arange(bs, dtype=torch.int64, device=dev)
    seq_lens = torch.full((bs,), args.ctx, dtype=torch.int32, device=dev)
    req_to_token = (
        torch.arange(bs * args.ctx, dtype=torch.int32, device=dev)
        .view(bs, args.ctx)
        .contiguous()
    )
    state = make_state(args, bs, units, "triton")
    # Compile outside the capture, then undo its effect on the state.
    state.swap_layer(0, tops[0], req, seq_lens, req_to_token)
    state = make_state(args, bs, units, "triton")
    graph = _Steps(state, tops, req, seq_lens, req_to_token)
    ref_state = make_state(args, bs, units, "reference")
    ref = _Steps(ref_state, tops, req, seq_lens, req_to_token, capture=False)
    mismatches, times = 0, []
    for _ in range(args.repeats):
        state.reset_counters()
        ref_state.reset_counters()
        times.append(graph.replay() / tops.shape[0])
        ref.replay()
        mismatches += not _same(ref_state, state, (ref.out, graph.out))
    c = state.counters[0].tolist()
    res = {
        "us_per_swap": statistics.median(times),
        "us_per_swap_min": min(times),
        "misses_per_row": c[2] / (tops.shape[0] * bs),
        "hits_per_row": c[0] / (tops.shape[0] * bs),
        "mismatched_replays": mismatches,
    }
    if DEVICE.type == "cuda":
        res["kernel_us_per_swap"] = kernel_times(graph, tops.shape[0])
    return res


def kernel_times(graph: "_Steps", steps: int) -> dict:
    """GPU time per swap of each kernel in one replay (torch profiler): the
    select kernel is what stands before the miss copy; the reorder's kernels
    (count, rank, copy order) may run beside the attention."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
    out = {}
    for e in prof.key_averages():
        if e.key.startswith("_swap"):
            total = getattr(e, "device_time_total", None)
            if total is None:
                total = e.cuda_time_total
            out[e.key] = round(total / steps, 2)
    return out


class _Steps:
    """The swaps of every step, captured in one CUDA graph (eager on CPU)."""

    def __init__(self, state, tops, req, seq_lens, req_to_token, capture=True):
        def run():
            return [
                state.swap_layer(0, tops[s], req, seq_lens, req_to_token)
                for s in range(tops.shape[0])
            ]

        self.run, self.graph = run, None
        if capture and DEVICE.type == "cuda":
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = run()
        else:
            self.out = None

    def replay(self) -> float:
        """Run every step once; microseconds."""
        if self.graph is None:
            tic = time.perf_counter()
            self.out = self.run()
            return (time.perf_counter() - tic) * 1e6
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        self.graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000


def _same(a: LRUCacheState, b: LRUCacheState, plans) -> bool:
    state_equal = all(
        torch.equal(x, y)
        for x, y in (
            (a.lru_order, b.lru_order),
            (a.slot_loc, b.slot_loc),
            (a.loc_to_slot, b.loc_to_slot),
            (a.counters, b.counters),
        )
    )
    plans_equal = True
    for pa, pb in zip(*plans):
        n = pa.miss_count
        plans_equal &= torch.equal(pa.page_table, pb.page_table)
        plans_equal &= torch.equal(n, pb.miss_count)
        for row in range(n.shape[0]):
            m = int(n[row])
            plans_equal &= torch.equal(
                pa.miss_src_loc[row, :m], pb.miss_src_loc[row, :m]
            )
            plans_equal &= torch.equal(
                pa.miss_dst_row[row, :m], pb.miss_dst_row[row, :m]
            )
    return bool(state_equal and plans_equal)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        required=True,
        help="output directory (created) for the JSON/markdown results",
    )
    p.add_argument(
        "--batch-sizes",
        type=_ints,
        default=[1, 8, 32],
        help="comma-separated decode batch sizes",
    )
    p.add_argument(
        "--units",
        type=_ints,
        default=[1, 2, 4],
        help="comma-separated LRU units per request to compare (1 = fixed buffer)",
    )
    p.add_argument(
        "--ctx",
        type=int,
        default=32768,
        help="context length of every request (tokens)",
    )
    p.add_argument(
        "--buffer-size",
        type=int,
        default=4096,
        help="LRU rows per request and layer (C)",
    )
    p.add_argument(
        "--window", type=int, default=64, help="recent-window rows per request (W)"
    )
    p.add_argument("--top-k", type=int, default=2048, help="indexer top-k width K")
    p.add_argument(
        "--keep",
        type=float,
        default=0.44,
        help="share of the top-k kept from one step to the next",
    )
    p.add_argument(
        "--steps", type=int, default=32, help="swap steps captured in the CUDA graph"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=30,
        help="timed repetitions per point (median reported)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    rows, ok = [], True
    for bs in args.batch_sizes:
        tops = torch.from_numpy(
            topk_steps(
                rng, bs, args.ctx, args.top_k, args.window, args.steps, args.keep
            )
        ).to(DEVICE)
        for units in args.units:
            res = run_point(args, bs, units, tops)
            ok &= res["mismatched_replays"] == 0
            rows.append({"batch": bs, "units": units, **res})
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "bench_swap_units.json"), "w") as f:
        json.dump(
            {"config": vars(args), "rows": rows, "equals_reference": ok}, f, indent=1
        )
    lines = [
        f"LRU swap per layer, CUDA graph of {args.steps} swaps, median of "
        f"{args.repeats} replays; {args.ctx}-token requests holding every unit, "
        f"top-k {args.top_k} keeping {args.keep:.0%} of the previous step.",
        "",
        "| batch | units (LRU rows) | us | of it: select us (before the copy) "
        "| misses per row | = reference |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        same = "yes" if r["mismatched_replays"] == 0 else "NO"
        if not r["misses_per_row"]:
            same += " (no misses: hits only)"
        select = r.get("kernel_us_per_swap", {}).get("_swap_select_kernel")
        lines.append(
            f"| {r['batch']} | {r['units']} ({r['units'] * args.buffer_size}) "
            f"| {r['us_per_swap']:.1f} | {'-' if select is None else f'{select:.1f}'} "
            f"| {r['misses_per_row']:.0f} | {same} |"
        )
    with open(os.path.join(args.out, "bench_swap_units.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("KERNELS == REFERENCE:", "PASS" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
