"""Where the one-token LRU swap's time goes (issue 20's fixed cost): the fused
kernel cut after each phase, timed like gpu_check_lru.py (a CUDA graph of
consecutive swaps, median over replays), at decode batch sizes.

Stages (each includes the ones before; built from the product kernel's own
steps in nsa_kv_offload_lru_kernels, so they time the same code):

  launch   one load and one store per program: the launch floor
  loads    the row's loads, the top-k gather through req_to_token and the
           loc_to_slot gather (the page table gets the slots, to keep them)
  phase1   + the miss ranks, counts and the hit flags' zero / scatter with
           their barriers
  phase2   + the walk of lru_order (flag gather, rank of evictables, new
           positions); victims and the new order go to scratch, not the state
  full     the product kernel (phase 3, the state written)

The cut stages leave the state as it is, so every replay sees the same
workload; "full" moves along the workload's trajectory as the server does.
Prints a table, writes JSON to --out.

    python benchmark/nsa_offload/engine/bench_swap_phases.py --out /tmp/phases.json
"""

import argparse
import json
import sys
from typing import Dict

import gpu_check_lru as check
import torch
import triton
import triton.language as tl
from offload_bench_utils import time_swap_graph
from sglang.srt.mem_cache import nsa_kv_offload_lru_kernels as lk

STAGES = ("launch", "loads", "phase1", "phase2", "full")


@triton.jit
def _swap_stage_kernel(
    topk_ptr,
    topk_stride,
    req_pool_ptr,
    seq_lens_ptr,
    req_to_token_ptr,
    req_to_token_stride,
    num_real_ptr,
    loc_to_slot_ptr,
    slot_loc_ptr,
    lru_ptr,
    unit_base_ptr,
    unit_index_ptr,
    capacity_ptr,
    counters_ptr,
    page_table_ptr,
    page_table_stride,
    miss_src_ptr,
    miss_src_stride,
    miss_dst_ptr,
    miss_dst_stride,
    miss_count_ptr,
    hit_flags_ptr,
    victims_ptr,
    sink_req,
    order_out_ptr,  # (rows, C) int16 scratch: phase 2's new order
    K: tl.constexpr,
    C: tl.constexpr,
    C0: tl.constexpr,
    U: tl.constexpr,
    W: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    STAGE: tl.constexpr,  # 0 launch, 1 loads, 2 phase1, 3 phase2
):
    b = tl.program_id(0)
    num_real = tl.load(num_real_ptr)
    if STAGE == 0:
        tl.store(miss_count_ptr + b, num_real)
        return
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    r = lk._request_row(req_pool_ptr, b, sink_req)
    n = tl.load(seq_lens_ptr + b).to(tl.int32)
    capacity = tl.load(capacity_ptr + r)
    pos = tl.load(topk_ptr + b * topk_stride + offs_k, mask=mask_k, other=-1)
    pos = pos.to(tl.int32)
    held = offs_c < capacity
    order_at = lk._state_offset(unit_index_ptr, r, offs_c, held, C0, U)
    order = tl.load(lru_ptr + order_at, mask=held, other=0).to(tl.int32)
    old_loc = tl.load(
        slot_loc_ptr + lk._state_offset(unit_index_ptr, r, order, held, C0, U),
        mask=held,
        other=-1,
    )
    pt_row = page_table_ptr + b * page_table_stride
    if b >= num_real:
        tl.store(pt_row + offs_k, tl.full([BLOCK_K], -1, tl.int32), mask=mask_k)
        tl.store(miss_count_ptr + b, 0)
        return
    in_window, lookup, loc = lk._classify_topk(
        pos, n, n, mask_k, r, req_to_token_ptr, req_to_token_stride, W
    )
    cur = tl.load(loc_to_slot_ptr + loc, mask=lookup, other=-1).to(tl.int32)
    if STAGE == 1:
        tl.store(pt_row + offs_k, cur, mask=mask_k)
        tl.store(miss_count_ptr + b, tl.sum(old_loc, axis=0))
        return
    flags_row = hit_flags_ptr + b.to(tl.int64) * C
    tl.store(flags_row + offs_c, tl.zeros([BLOCK_C], tl.int8), mask=mask_c)
    hit, miss, miss_rank, num_misses = lk._split_lookups(lookup, cur)
    num_hits = tl.sum(hit.to(tl.int32), axis=0)
    tl.debug_barrier()
    tl.store(flags_row + cur, tl.full([BLOCK_K], 1, tl.int8), mask=hit)
    tl.debug_barrier()
    if STAGE == 2:
        tl.store(pt_row + offs_k, miss_rank, mask=mask_k)
        tl.store(miss_count_ptr + b, num_misses + num_hits)
        return
    ev_rank, new_pos, taken = lk._walk_lru(flags_row, order, held, offs_c, num_misses)
    victims_row = victims_ptr + b.to(tl.int64) * K
    tl.store(victims_row + ev_rank, order, mask=taken)
    tl.store(
        order_out_ptr + b.to(tl.int64) * C + new_pos, order.to(tl.int16), mask=held
    )
    tl.store(pt_row + offs_k, miss_rank, mask=mask_k)
    tl.store(miss_count_ptr + b, num_misses + num_hits + tl.sum(old_loc, axis=0))


def launch_stage(
    stage: str, state, topk, rpi, seq, req_to_token, num_real, out, order_out
):
    """One swap of layer 0 cut after ``stage`` (not "full"): the product
    kernel's launch arguments, plus the scratch for phase 2's new order."""
    tri = state.swap_backend
    bs = topk.shape[0]
    plan = state.plan_view(bs, out, 1)
    loc_to_slot, slot_loc, lru, counters = state._layer_views[0]
    batch, plan_rows = tri.launch_rows(topk, rpi, seq, req_to_token, num_real, plan)
    args = tri._fused_args(
        state, batch, plan_rows, loc_to_slot, slot_loc, lru, counters, plan
    )
    _swap_stage_kernel[(bs,)](
        *args,
        order_out,
        K=state.top_k,
        C=state.num_slots,
        C0=state.buffer_size,
        U=state.max_units,
        W=state.recent_window,
        BLOCK_K=tri.block_k,
        BLOCK_C=tri.block_c,
        STAGE=STAGES.index(stage),
        num_warps=tri.num_warps,
    )
    return plan


def time_stage(stage: str, state, wl, topks, seqs, rpi, num_real, reps: int):
    """Per-swap microseconds of one stage (a graph of len(topks) swaps)."""
    if stage == "full":
        return check.time_graph(state, wl, topks, seqs, rpi, num_real, reps)[0]
    T, bs = len(topks), topks[0].shape[0]
    outs = [check.make_out(bs, state.top_k) for _ in range(2)]
    order_out = torch.zeros((bs, state.num_slots), dtype=torch.int16, device="cuda")

    def body():
        for t in range(T):
            launch_stage(
                stage,
                state,
                topks[t],
                rpi,
                seqs[t],
                wl.req_to_token,
                num_real,
                outs[t % 2],
                order_out,
            )

    return time_swap_graph(body, state.counters[0], T, reps)[0]


def run(args, bs: int, keep: float, seed: int) -> Dict:
    wl, (state,), rpi, num_real, topks, seqs = check.timing_workload(
        args, bs, keep, seed, kinds=(True,)
    )
    snap = check.snapshot(state)
    res = {"bs": bs, "keep": keep, "num_warps": state.swap_backend.num_warps}
    for stage in STAGES:
        check.restore(state, snap)
        res[stage] = round(
            time_stage(stage, state, wl, topks, seqs, rpi, num_real, args.reps), 2
        )
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    check.add_workload_args(p, [1, 16, 64])
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    rows = []
    for i, bs in enumerate(args.batch_sizes):
        rows.append(run(args, bs, 0.45, args.seed + i))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'bs':>4} " + " ".join(f"{s:>8}" for s in STAGES) + "  (us per swap)")
    for r in rows:
        print(f"{r['bs']:>4} " + " ".join(f"{r[s]:8.2f}" for s in STAGES))
    with open(args.out, "w") as f:
        json.dump(
            {
                "config": vars(args),
                "device": torch.cuda.get_device_name(),
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
