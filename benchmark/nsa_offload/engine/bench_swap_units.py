"""The LRU swap with units on the GPU: the one-program (fused) kernel vs the
kernels split by unit, and both against one unit.

A request with ``U`` units has ``U x C`` LRU slots per layer; the fused kernel
walks them all in one program per request, the split swap runs one select
kernel per request (page table and copy list) and spreads the recency walk
over ``U`` programs (``TritonLRUSwap(split_by_unit=...)``); on CUDA one more
replay under the torch profiler gives each split kernel's time, the select
kernel's being what stands before the miss copy. For each batch size and
``U``, every request holds all ``U`` units and decodes at ``--ctx`` tokens
with a top-k that keeps ``--keep`` of the previous step's positions (the rest
fresh, uniform). ``--steps`` swaps with distinct top-k inputs are captured in
one CUDA graph; the time per swap is the median over ``--repeats`` replays
divided by the steps. The split and fused states are also compared after
every replay (page tables, copy plans and the whole LRU state): a mismatch
fails the run.

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
# of the script and of split = fused, no timing worth reading.
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
    state = units_state(bs, units, args.ctx, args.buffer_size, args.window, args.top_k)
    state.swap_backend = TritonLRUSwap(
        state,
        max_batch_size=bs,
        split_by_unit=kernel != "fused",
    )
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
    variants = ["fused"] if units == 1 else ["fused", "split"]
    res = {}
    graphs, states = {}, {}
    for name in variants:
        state = make_state(args, bs, units, name)
        # Compile outside the capture, then undo its effect on the state.
        state.swap_layer(0, tops[0], req, seq_lens, req_to_token)
        state = make_state(args, bs, units, name)
        g = _Steps(state, tops, req, seq_lens, req_to_token)
        graphs[name], states[name] = g, state
    mismatches = 0
    times = {name: [] for name in variants}
    for rep in range(args.repeats):
        for name, g in graphs.items():
            states[name].reset_counters()
            times[name].append(g.replay() / tops.shape[0])
        for name in variants[1:]:
            plans = (graphs["fused"].out, graphs[name].out)
            mismatches += not _same(states["fused"], states[name], plans)
    for name in variants:
        c = states[name].counters[0].tolist()
        res[name] = {
            "us_per_swap": statistics.median(times[name]),
            "us_per_swap_min": min(times[name]),
            "misses_per_row": c[2] / (tops.shape[0] * bs),
            "hits_per_row": c[0] / (tops.shape[0] * bs),
        }
    res["mismatched_replays"] = mismatches
    if "split" in graphs and DEVICE.type == "cuda":
        res["split"]["kernel_us_per_swap"] = kernel_times(
            graphs["split"], tops.shape[0]
        )
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

    def __init__(self, state, tops, req, seq_lens, req_to_token):
        def run():
            return [
                state.swap_layer(0, tops[s], req, seq_lens, req_to_token)
                for s in range(tops.shape[0])
            ]

        self.run, self.graph = run, None
        if DEVICE.type == "cuda":
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
            {"config": vars(args), "rows": rows, "split_equals_fused": ok}, f, indent=1
        )
    lines = [
        f"LRU swap per layer, CUDA graph of {args.steps} swaps, median of "
        f"{args.repeats} replays; {args.ctx}-token requests holding every unit, "
        f"top-k {args.top_k} keeping {args.keep:.0%} of the previous step.",
        "",
        "| batch | units (LRU rows) | fused us | split us | of it: select us "
        "(before the copy) | misses per row | split = fused |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        split = r.get("split")
        us = [
            f"{r[k]['us_per_swap']:.1f}" if k in r else "-" for k in ("fused", "split")
        ]
        same = "-" if not split else ("yes" if r["mismatched_replays"] == 0 else "NO")
        if split and not split["misses_per_row"]:
            same += " (no misses: hits only)"
        select = (split or {}).get("kernel_us_per_swap", {}).get("_swap_select_kernel")
        lines.append(
            f"| {r['batch']} | {r['units']} ({r['units'] * args.buffer_size}) "
            f"| {' | '.join(us)} | {'-' if select is None else f'{select:.1f}'} "
            f"| {r['fused']['misses_per_row']:.0f} | {same} |"
        )
    with open(os.path.join(args.out, "bench_swap_units.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("SPLIT == CHUNKED == FUSED:", "PASS" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
