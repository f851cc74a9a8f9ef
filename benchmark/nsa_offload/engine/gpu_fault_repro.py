"""The cause of the two GPU faults of the split swap kernels, shown on a GPU.

Cause (named in ``_swap_rank_kernel``, nsa_kv_offload_lru_kernels.py): in
the REORDER_ONLY branch the hit flags are read in the layout of the
vectorised ``lru_order`` load (8 contiguous entries per thread) and cleared
through ``hit_flags[order]`` in another (one entry per thread). Without the
``tl.debug_barrier()`` between them a thread may clear a flag before the
thread that reads it has read it: the hit slot is taken for evictable while
the count kernel counted it as a hit, and ``lru_order`` loses one slot and
holds another twice. Fault 1 (16 warps: the order diverged from the torch
reference) is that misread; fault 2 (2 units + warm units + direct slots:
wrong KV, two positions on one row) its consequence a few swaps later.

Two checks, each on the installed kernels ("barrier") and on the same
source with that one barrier removed ("nobarrier"):

* ``race``: ``_swap_count_kernel`` then ``_swap_rank_kernel(REORDER_ONLY)``
  on fixed warm 4-unit inputs at the served sizes, many trials, against a
  torch reference of the reorder; rows whose new order differs are counted,
  plus a control (the misread planted by hand: must be counted).
* ``chain``: ``LRUCacheState`` with 2-unit warm requests swapped for many
  steps; after each swap every request's ``lru_order`` must be a
  permutation, its page table's entries on distinct rows and every resident
  loc's slot must name it back.

Expected: "barrier" 0 bad rows / 0 events at 4, 8 and 16 warps; "nobarrier"
> 0 somewhere (most at 16 warps); control > 0. Writes ``--out`` (JSON).

    python3 gpu_fault_repro.py --out /tmp/fault.json [--warps 4,8,16] [--repeats 3]
"""

import argparse
import importlib.util
import json
import re
import tempfile
import time

import numpy as np
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BARRIER = re.compile(
    r"(\n\s*if REORDER_ONLY:\n(?:\s*#.*\n)*)\s*tl\.debug_barrier\(\)\n"
)


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def kernel_variants():
    from sglang.srt.mem_cache import nsa_kv_offload_lru_kernels as kmod

    src = open(kmod.__file__).read()
    nob, n = BARRIER.subn(r"\1", src)
    if n != 1:
        raise SystemExit("the barrier before the hit-flag clear is not in the kernels")
    path = tempfile.mkdtemp(prefix="fault_repro_") + "/k_nobarrier.py"
    with open(path, "w") as f:
        f.write(nob)
    spec = importlib.util.spec_from_file_location("k_nobarrier", path)
    alt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(alt)
    return {"barrier": kmod, "nobarrier": alt}


def race(mods, warps, trials, bs=132, U=4, C0=4096, misses=600, seed=0, K=2048):
    dev = DEVICE
    C, block = U * C0, 1 << (C0 - 1).bit_length()
    g = torch.Generator().manual_seed(seed)
    unit_index = torch.arange(bs * U, dtype=torch.int32).view(bs, U)
    unit_index = torch.cat([unit_index, torch.full((1, U), bs * U, dtype=torch.int32)])
    unit_index = unit_index.to(dev)

    def warm_order():  # older chunks ascending runs, the newest in no order
        q = torch.randperm(C, generator=g)
        return torch.cat([q[: C - C0].sort().values, q[C - C0 :]])

    order = torch.stack([warm_order() for _ in range(bs)])
    lru = torch.zeros((bs * U + 1, C0), dtype=torch.int16)
    lru[: bs * U] = order.view(bs * U, C0).to(torch.int16)
    lru = lru.to(dev)
    hp = torch.full((bs, C), 0.035)
    hp.scatter_(1, order[:, C - C0 :], 0.25)
    flags0 = (torch.rand((bs, C), generator=g) < hp).to(torch.int8).to(dev)
    capacity = torch.full((bs + 1,), C, dtype=torch.int32, device=dev)
    capacity[bs] = 0
    req_pool = torch.arange(bs, dtype=torch.int64, device=dev)
    num_real = torch.tensor([bs], dtype=torch.int32, device=dev)
    miss_count = torch.full((bs,), misses, dtype=torch.int32, device=dev)
    row_direct = torch.zeros((bs,), dtype=torch.int8, device=dev)
    loc_to_slot = torch.full((16,), -1, dtype=torch.int16, device=dev)
    slot_loc = torch.full((bs * U + 1, C0), -1, dtype=torch.int32, device=dev)
    victims = torch.zeros((bs, K), dtype=torch.int32, device=dev)
    ev_count = torch.zeros((bs, U), dtype=torch.int32, device=dev)
    new_lru = torch.zeros((bs, C), dtype=torch.int16, device=dev)
    hit_flags = torch.empty_like(flags0)
    # The reorder's rule: evictables first (the victims rotate to the end),
    # then the hits in their old order.
    o = order.to(dev).long()
    ev = flags0.gather(1, o) == 0
    evi = ev.long()
    rank = evi.cumsum(1) - evi
    E = evi.sum(1, keepdim=True)
    m = miss_count.long()[:, None]
    pos = torch.arange(C, device=dev)[None, :]
    new_pos = torch.where(
        ev, torch.where(rank >= m, rank - m, E - m + rank), E + pos - rank
    )
    ref = torch.empty_like(o).scatter_(1, new_pos, o).to(torch.int16)
    hit_pos = (~ev[:, C0 : 2 * C0]).float().argmax(1) + C0
    planted = o.gather(1, hit_pos[:, None]).flatten()
    rows = torch.arange(bs, device=dev)

    def run(mod, nw, control):
        hit_flags.copy_(flags0)
        mod._swap_count_kernel[(bs, U)](
            req_pool, num_real, lru, unit_index, capacity, hit_flags, ev_count,
            bs, row_direct, C=C, C0=C0, U=U, BLOCK_C0=block, num_warps=nw,
        )  # fmt: skip
        if control:
            hit_flags[rows, planted] = 0
        mod._swap_rank_kernel[(bs, U)](
            req_pool, num_real, loc_to_slot, slot_loc, lru, unit_index,
            capacity, miss_count, hit_flags, ev_count, victims, new_lru, bs,
            row_direct, K=K, C=C, C0=C0, U=U,
            BLOCK_U=1 << (U - 1).bit_length(), BLOCK_C0=block,
            REORDER_ONLY=True, num_warps=nw,
        )  # fmt: skip

    out = []
    configs = [(n, mods[n], w, False) for n in ("nobarrier", "barrier") for w in warps]
    configs.append(("control", mods["barrier"], warps[0], True))
    for name, mod, nw, control in configs:
        run(mod, nw, control)
        _sync()
        bad, t0 = 0, time.time()
        for _ in range(trials):
            new_lru.zero_()
            run(mod, nw, control)
            bad += int((new_lru != ref).any(1).sum())
        _sync()
        out.append(dict(check="race", variant=name, warps=nw, bad_rows=bad,
                        rows_run=bs * trials, seconds=round(time.time() - t0, 1)))  # fmt: skip
        print(json.dumps(out[-1]), flush=True)
    return out


def chain(mods, variant, warps, steps, bs=64, U=2, C0=4096, K=2048, W=64, seed=0):
    from sglang.srt.mem_cache import nsa_kv_offload_lru_triton as tmod
    from sglang.srt.mem_cache.lru_cache_state import LRUCacheState

    dev = DEVICE
    tmod._swap_rank_kernel = mods[variant]._swap_rank_kernel
    try:
        C, ctx = U * C0, 2 * U * C0 + W
        rng = np.random.default_rng(seed)
        state = LRUCacheState(
            num_layers=1, max_num_reqs=bs, num_locs=bs * ctx, buffer_size=C0,
            recent_window=W, top_k=K, device=dev, use_triton=True,
            max_batch_size=bs, max_units=U, num_warps=warps,
        )  # fmt: skip
        rows = C0 + W
        for r in range(bs):
            state.admit_request(r, r * U * rows)
            for u in range(1, U):
                state.grow_request(r, u, (r * U + u) * rows)
        perm = rng.permutation(bs * ctx).astype(np.int32)
        r2t = torch.from_numpy(perm).view(bs, ctx).to(dev).contiguous()
        below = ctx - W
        for r in range(bs):
            state.warm_request(0, r, r2t[r, below - C : below].long())
        req = torch.arange(bs, dtype=torch.int64, device=dev)
        seq = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
        gen = torch.Generator(device=dev).manual_seed(seed)
        topk = torch.rand((bs, below), generator=gen, device=dev).topk(K).indices
        ar = torch.arange(C, device=dev)
        broken, shared, stale = set(), set(), 0
        for _ in range(steps):
            # Keep 44% of the last top-k, the rest fresh, in random order.
            score = torch.rand((bs, below), generator=gen, device=dev)
            keep = torch.rand((bs, K), generator=gen, device=dev) < 0.44
            score.scatter_(1, topk, torch.where(keep, 2.0, -1.0))
            topk = score.topk(K).indices
            topk = topk.gather(1, torch.rand((bs, K), device=dev).argsort(1))
            plan = state.swap_layer(0, topk.to(torch.int32), req, seq, r2t)
            lo = state.lru_order[0].long()
            broken |= set(
                torch.nonzero((lo.sort(1).values != ar).any(1)).flatten().tolist()
            )
            pt = plan.page_table.long().sort(1).values
            dup = ((pt[:, 1:] == pt[:, :-1]) & (pt[:, 1:] >= 0)).any(1)
            shared |= set(torch.nonzero(dup).flatten().tolist())
            slot = state.loc_to_slot[0].long()[r2t.long()]
            back = state.slot_loc[0].long().gather(1, slot.clamp(min=0))
            stale += int(((slot >= 0) & (back != r2t.long())).sum())
    finally:
        tmod._swap_rank_kernel = mods["barrier"]._swap_rank_kernel
    res = dict(check="chain", variant=variant, warps=warps, steps=steps, requests=bs,
               rows_broken_order=len(broken), rows_shared_gpu_row=len(shared),
               stale_maps=stale)  # fmt: skip
    print(json.dumps(res), flush=True)
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--warps", default="4,8,16", help="comma-separated num_warps to run")
    p.add_argument(
        "--trials", type=int, default=300, help="race check: launches per setting"
    )
    p.add_argument("--steps", type=int, default=150, help="chain check: swaps per run")
    p.add_argument(
        "--repeats", type=int, default=3, help="runs of each check per setting"
    )
    p.add_argument(
        "--small",
        action="store_true",
        help="tiny sizes: a plumbing check on CPU (TRITON_INTERPRET=1 cannot race)",
    )
    args = p.parse_args()
    warps = [int(w) for w in args.warps.split(",")]
    mods = kernel_variants()
    sizes = dict(C0=256, K=64) if args.small else {}
    race_sizes = dict(sizes, bs=4, misses=16) if args.small else {}
    chain_sizes = dict(sizes, bs=4) if args.small else {}
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    results = dict(device=name, runs=[])
    for repeat in range(args.repeats):
        for r in race(mods, warps, args.trials, seed=repeat, **race_sizes):
            results["runs"].append(dict(r, repeat=repeat))
        for variant in ("nobarrier", "barrier"):
            for w in (8, 16) if variant == "barrier" else (16,):
                r = chain(mods, variant, w, args.steps, seed=repeat, **chain_sizes)
                results["runs"].append(dict(r, repeat=repeat))
    runs = results["runs"]
    results["barrier_clean"] = all(
        r.get("bad_rows", 0) == 0 and r.get("rows_broken_order", 0) == 0
        and r.get("rows_shared_gpu_row", 0) == 0 and r.get("stale_maps", 0) == 0
        for r in runs if r["variant"] == "barrier"
    )  # fmt: skip
    results["nobarrier_faults"] = sum(
        r.get("bad_rows", 0) + r.get("rows_broken_order", 0)
        for r in runs if r["variant"] == "nobarrier"
    )  # fmt: skip
    results["control_counted"] = all(
        r["bad_rows"] > 0 for r in runs if r["variant"] == "control"
    )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}))


if __name__ == "__main__":
    main()
