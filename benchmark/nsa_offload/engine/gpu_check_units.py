"""GPU differential check of the LRU swap with units at the served sizes: the
split Triton kernels (what a server runs with units) against the torch
reference, swap by swap, reporting the first difference (step, row, what).

Each of ``bs`` requests holds ``U`` units of ``C`` slots, decodes at
``--ctx`` tokens with a top-k that keeps ``--keep`` of the previous step's
positions; ``--warm full`` first warms every slot as the warm units do
(``warm_request`` of the newest ``U x C`` positions below the window),
``--warm none`` starts from empty units. ``--direct-slots`` builds the states
with direct slots (the kernels' direct variants, as the warm units + direct
slots server runs them: its walkers take the LRU path of those variants);
``--warm direct`` then installs the older half of each context's positions
below its window in slot = position (direct mode's warm-up, ``warm_direct``;
the newer half misses into their own slots): ``--ctx`` must fit the units. The CPU interpreter runs the
kernels one program at a time and with tiny test sizes; this runs them as
the GPU does, at 4,096-row units and top-k 2,048.

    python benchmark/nsa_offload/engine/gpu_check_units.py --out /tmp/units.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

# The workload of the swap-with-units benchmark (same folder).
from bench_swap_units import _ints, topk_steps, units_state

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_state(args, bs, units, triton, req_to_token):
    state = units_state(
        bs,
        units,
        args.ctx,
        args.C,
        args.W,
        args.K,
        use_triton=triton,
        num_warps=args.num_warps if triton else None,
        direct_slots=args.direct_slots,
    )
    if args.warm == "direct":
        below = args.ctx - args.W
        for r in range(bs):
            state.warm_direct(0, r, req_to_token[r, : below // 2])
    elif args.warm == "full":
        below = args.ctx - args.W
        for r in range(bs):
            locs = req_to_token[r, below - units * args.C : below].long()
            state.warm_request(0, r, locs)
    return state


def first_difference(a, b, plan_a=None, plan_b=None):
    """What differs between the two swaps' outputs and states (None: all
    equal), with the rows and entries that differ."""
    checks = []
    if plan_a is not None:
        checks += [
            ("page_table", plan_a.page_table, plan_b.page_table),
            ("miss_count", plan_a.miss_count, plan_b.miss_count),
        ]
    for row in range(plan_a.miss_count.shape[0] if plan_a is not None else 0):
        m = int(plan_a.miss_count[row])
        checks.append(
            (
                f"miss_src_loc[{row}]",
                plan_a.miss_src_loc[row, :m],
                plan_b.miss_src_loc[row, :m],
            )
        )
        checks.append(
            (
                f"miss_dst_row[{row}]",
                plan_a.miss_dst_row[row, :m],
                plan_b.miss_dst_row[row, :m],
            )
        )
    checks += [
        ("lru_order", a.lru_order, b.lru_order),
        ("slot_loc", a.slot_loc, b.slot_loc),
        ("loc_to_slot", a.loc_to_slot, b.loc_to_slot),
        ("counters", a.counters, b.counters),
        ("direct", a.direct, b.direct),
    ]
    for name, x, y in checks:
        if x.shape != y.shape:
            return {"what": name, "shapes": [list(x.shape), list(y.shape)]}
        diff = x != y
        if bool(diff.any()):
            idx = diff.nonzero()[:8].tolist()
            return {
                "what": name,
                "entries": int(diff.sum()),
                "first": idx,
                "triton": [x[tuple(i)].item() for i in idx],
                "reference": [y[tuple(i)].item() for i in idx],
            }
    return None


def run_point(args, bs, units, seed):
    rng = np.random.default_rng(seed)
    tops = torch.from_numpy(
        topk_steps(rng, bs, args.ctx, args.K, args.W, args.steps, args.keep)
    ).to(DEVICE)
    req = torch.arange(bs, dtype=torch.int64, device=DEVICE)
    seq_lens = torch.full((bs,), args.ctx, dtype=torch.int32, device=DEVICE)
    # Shuffled locs: neighbours in a request are not neighbours in memory.
    perm = torch.from_numpy(rng.permutation(bs * args.ctx).astype(np.int32))
    req_to_token = perm.view(bs, args.ctx).to(DEVICE).contiguous()
    tri = make_state(args, bs, units, True, req_to_token)
    ref = make_state(args, bs, units, False, req_to_token)
    diff = first_difference(tri, ref)  # after the warm-ups
    if diff is not None:
        return {"bs": bs, "units": units, "step": -1, "diff": diff}
    for s in range(args.steps):
        plan_t = tri.swap_layer(0, tops[s], req, seq_lens, req_to_token)
        plan_r = ref.swap_layer(0, tops[s], req, seq_lens, req_to_token)
        diff = first_difference(tri, ref, plan_t, plan_r)
        if diff is not None:
            return {"bs": bs, "units": units, "step": s, "diff": diff}
    return {"bs": bs, "units": units, "step": None, "diff": None}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--units", default="2,4", help="comma-separated units per request")
    p.add_argument("--C", type=int, default=4096, help="LRU rows per unit")
    p.add_argument("--K", type=int, default=2048, help="top-k width")
    p.add_argument("--W", type=int, default=64, help="recent-window rows")
    p.add_argument("--ctx", type=int, default=32768, help="request length")
    p.add_argument("--steps", type=int, default=12, help="swaps per point")
    p.add_argument("--keep", type=float, default=0.44, help="top-k kept per step")
    p.add_argument(
        "--warm",
        choices=("full", "none", "direct"),
        default="full",
        help="full: every slot warmed first (as warm units do); none: cold units; "
        "direct: direct mode, the older half of each context installed "
        "(implies --direct-slots; --ctx must fit the units)",
    )
    p.add_argument(
        "--direct-slots",
        action="store_true",
        help="states with direct slots (the kernels' direct variants)",
    )
    p.add_argument("--seeds", default="0", help="comma-separated random seeds")
    p.add_argument(
        "--num-warps", type=int, help="the Triton kernels' warps (default: theirs)"
    )
    p.add_argument(
        "--reorder-warps",
        type=int,
        help="warps of the count / rank / copy-back kernels only (the select "
        "kernel keeps --num-warps)",
    )
    args = p.parse_args()
    if args.warm == "direct":
        args.direct_slots = True
        if args.ctx - args.W > min(_ints(args.units)) * args.C:
            p.error(f"--warm direct: --ctx {args.ctx} does not fit the units")
    if args.reorder_warps:
        from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import TritonLRUSwap

        chunk_shape = TritonLRUSwap._chunk_shape

        def reorder_shape(self):
            return dict(chunk_shape(self), num_warps=args.reorder_warps)

        TritonLRUSwap._chunk_shape = reorder_shape
    results = []
    for seed in _ints(args.seeds):
        for bs in _ints(args.batch_sizes):
            for units in _ints(args.units):
                res = run_point(args, bs, units, seed)
                res.update(
                    warm=args.warm,
                    direct_slots=args.direct_slots,
                    seed=seed,
                    num_warps=args.num_warps,
                    reorder_warps=args.reorder_warps,
                )
                print(json.dumps(res), flush=True)
                results.append(res)
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "results": results}, f, indent=1)
    ok = all(r["diff"] is None for r in results)
    print("SPLIT TRITON == REFERENCE:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
