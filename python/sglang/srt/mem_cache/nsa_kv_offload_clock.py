"""CLOCK replacement of the decode NSA KV offload's slots (experimental).

``SGLANG_NSA_KV_OFFLOAD_POLICY=clock`` replaces the LRU order by CLOCK with
second chance: a reference bit per slot and a hand per (layer, request). A
swap's hits set their slots' bits; its misses take the first slots from the
hand on, in slot order over the slots the request holds, whose bit is clear
and that this step did not hit; a set bit passed over is cleared (its second
chance) instead. When a whole revolution finds too few, the second one takes
the slots it cleared. Loaded slots start with a clear bit; the hand stops
after the last one taken. Replayed through this engine on the synthetic
trace it misses about what LRU misses (``results/policy_study/engine_clock/``:
0.989-0.999x HiSparse's LRU at 2,560-8,256 rows, the engine's LRU
0.999-1.000x).

The bits live in the LRU order's storage (per unit chunk, like
``slot_loc``): the state costs what it costs with LRU. What it saves is the
LRU order's upkeep: no recency update walks the whole order every step (the split swap's count, rank and copy-back kernels, the
fused kernel's permutation). One kernel per layer looks up the top-k, sweeps
from the hand only as far as the misses need, and writes the page table.

One query token per swap only (no MTP verify) and no direct slots
(``LRUCacheState`` refuses both). Grown units' empty slots come first: the
hand moves to a new unit's first slot (``LRUCacheState.grow_request``).

:func:`clock_assign_slots` is the torch reference (CPU tests, warm-ups),
``_clock_swap_kernel`` the Triton swap; they agree bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from sglang.srt.mem_cache.nsa_kv_offload_lru_kernels import _HAS_TRITON
from sglang.srt.mem_cache.nsa_kv_offload_lru_reference import (
    LayerSwapWork,
    move_in,
    new_work,
    slot_rows,
    state_index,
)

if TYPE_CHECKING:
    from sglang.srt.mem_cache.lru_cache_state import LRUCacheState

LRU_POLICY = "lru"
CLOCK_POLICY = "clock"
POLICIES = (LRU_POLICY, CLOCK_POLICY)

# Reference bit values. Inside a swap the kernel also marks this step's hits
# and victims with 2: the sweep neither takes nor clears them.
REF_CLEAR, REF_SET = 0, 1


def clock_assign_slots(
    state: LRUCacheState,
    layer: int,
    req: torch.Tensor,
    base: torch.Tensor,
    lookup: torch.Tensor,
    loc: torch.Tensor,
    real: Optional[torch.Tensor] = None,
    pos: Optional[torch.Tensor] = None,
    in_window: Optional[torch.Tensor] = None,
) -> LayerSwapWork:
    """Hits, misses and CLOCK victims of looked-up locs (``(bs, k)``, one
    query token); updates residency, reference bits and hands."""
    bs, k = loc.shape
    C, N = state.num_slots, state.num_locs
    dev = state.device
    l2s = state._loc_to_slot_buf[layer]
    ref = state._ref_buf[layer].view(-1)
    hands = state._hand_buf[layer]
    cur = l2s[torch.where(lookup, loc, N)].long()
    hit = lookup & (cur >= 0)
    miss = lookup & (cur < 0)
    hit_flags = torch.zeros((bs, C + 1), dtype=torch.bool, device=dev)
    hit_flags.scatter_(1, torch.where(hit, cur, C), True)
    mi = miss.long()
    miss_rank = mi.cumsum(1) - mi
    num_misses = mi.sum(1)

    # The sweep: positions p of two revolutions from the hand, slot
    # (hand + p) % capacity. The first takes clear bits, the second the bits
    # the first cleared (it only runs when the first took every clear one).
    cap = state._capacity_buf[req].long()
    modulus = cap.clamp(min=1)  # padding rows hold no slot
    hand = hands[req].long()
    p = torch.arange(2 * C, device=dev).expand(bs, -1)
    valid = p < 2 * cap[:, None]
    slot_at_p = torch.where(valid, (hand[:, None] + p) % modulus[:, None], -1)
    at = state_index(state, req, slot_at_p)
    bit = ref[at].long()
    hit_at_p = hit_flags.gather(1, torch.where(valid, slot_at_p, C))
    first_rev = p < cap[:, None]
    wanted = torch.where(first_rev, REF_CLEAR, REF_SET)
    evictable = valid & ~hit_at_p & (bit == wanted)
    ev = evictable.long()
    ev_rank = ev.cumsum(1) - ev
    taken = evictable & (ev_rank < num_misses[:, None])
    passed = valid & (ev_rank < num_misses[:, None])
    victim_by_rank = torch.zeros((bs, k + 1), dtype=torch.int64, device=dev)
    victim_by_rank.scatter_(1, torch.where(taken, ev_rank, k), slot_at_p)
    victim = victim_by_rank.gather(1, torch.where(miss, miss_rank, k))
    slot = torch.where(hit, cur, torch.where(miss, victim, -1))
    row = slot_rows(state, req, slot)
    last = torch.where(taken, p, -1).amax(1)
    new_hand = torch.where(num_misses > 0, (hand + last + 1) % modulus, hand)
    hands.index_put_((req,), new_hand.to(hands.dtype))

    addr = move_in(state, layer, req, miss, victim, loc, slot)
    # Bits: set ones passed over in the first revolution are cleared (every
    # one of them when a second ran), hits set, loaded slots clear. Entries
    # that are none of these go to the sink chunk.
    cleared = passed & first_rev & ~hit_at_p & (bit == REF_SET)
    sink = state._sink_unit * state.buffer_size
    ref.index_put_((torch.where(cleared, at, sink),), ref.new_full((), REF_CLEAR))
    ref.index_put_((addr,), ref.new_full((), REF_CLEAR))
    hit_addr = state_index(state, req, torch.where(hit, cur, -1))
    ref.index_put_((hit_addr,), ref.new_full((), REF_SET))

    # No order: the LRU fields stay empty (post_process skips the reorder).
    empty = torch.zeros((bs, 0), dtype=torch.int64, device=dev)
    return new_work(
        layer,
        req,
        base,
        lookup,
        loc,
        real,
        pos,
        in_window,
        hit=hit,
        miss=miss,
        first_miss=miss,
        slot=slot,
        row=row,
        miss_rank=miss_rank,
        num_misses=num_misses,
        order=empty,
        order_evictable=empty.bool(),
        evict_rank=empty,
    )


if _HAS_TRITON:
    import triton
    import triton.language as tl
    from sglang.srt.mem_cache.nsa_kv_offload_lru_kernels import (
        _add_counters,
        _classify_topk,
        _entry_rows,
        _evict_victims,
        _request_row,
        _split_lookups,
        _state_offset,
        _take_victims,
    )

    @triton.jit
    def _clock_sweep(
        ref_ptr,
        slot_loc_ptr,
        unit_index_ptr,
        loc_to_slot_ptr,
        victims_row,
        r,
        hand,
        capacity,
        num_misses,
        C0: tl.constexpr,
        U: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        # Phase 2: from the hand, a block of positions at a time, until
        # num_misses victims are taken (two revolutions at most: the slots
        # not hit this step outnumber its misses). Taken slots are marked
        # (not taken again in the second revolution), set bits passed over
        # cleared; the barrier at the end of a block makes both visible to
        # the next (a revolution spans at least one block: BLOCK_S <= C0).
        # Returns the last position taken (-1: none).
        offs = tl.arange(0, BLOCK_S)
        cap = tl.maximum(capacity, 1)
        found = num_misses * 0
        start = num_misses * 0
        last = num_misses * 0 - 1
        while (found < num_misses) & (start < 2 * capacity):
            p = start + offs
            valid = p < 2 * capacity
            s = (hand + p) % cap
            at = _state_offset(unit_index_ptr, r, s, valid, C0, U)
            bit = tl.load(ref_ptr + at, mask=valid, other=2).to(tl.int32)
            evictable = valid & (bit == 0)
            ev_i = evictable.to(tl.int32)
            ev_rank = found + tl.cumsum(ev_i, axis=0) - ev_i
            taken = evictable & (ev_rank < num_misses)
            passed = valid & (ev_rank < num_misses)
            tl.debug_barrier()  # every replica's load before the bits change
            tl.store(
                ref_ptr + at,
                tl.where(taken, 2, 0).to(ref_ptr.dtype.element_ty),
                mask=taken | (passed & (bit == 1)),
            )
            old_loc = tl.load(slot_loc_ptr + at, mask=taken, other=-1)
            _evict_victims(
                loc_to_slot_ptr, old_loc, taken, victims_row, ev_rank, s, BLOCK_S
            )
            last = tl.maximum(last, tl.max(tl.where(taken, p, -1), axis=0))
            found += tl.sum(ev_i, axis=0)
            start += BLOCK_S
            tl.debug_barrier()
        return last

    @triton.jit(
        do_not_specialize_on_alignment=[
            "req_pool_ptr",
            "seq_lens_ptr",
            "num_real_ptr",
            "loc_to_slot_ptr",
            "hand_ptr",
            "unit_base_ptr",
            "capacity_ptr",
            "counters_ptr",
            "miss_count_ptr",
        ]
    )
    def _clock_swap_kernel(
        topk_ptr,
        topk_stride,
        req_pool_ptr,
        seq_lens_ptr,
        req_to_token_ptr,
        req_to_token_stride,
        num_real_ptr,
        loc_to_slot_ptr,  # (N + 1,) this layer
        slot_loc_ptr,  # (num_units + 1, C0) int32, this layer
        ref_ptr,  # (num_units + 1, C0) reference bits (lru_order's storage)
        hand_ptr,  # (max_reqs + 1,) int32 hands, this layer
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
        victims_ptr,  # (rows, K) int32 scratch
        sink_req,
        K: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        W: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        # One program per batch row: look up, sweep, assign (three phases,
        # a barrier between each: the marks, bits and victims written by some
        # threads are read by others).
        b = tl.program_id(0)
        offs_k = tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        pt_row = page_table_ptr + b * page_table_stride
        if b >= tl.load(num_real_ptr):
            tl.store(pt_row + offs_k, tl.full([BLOCK_K], -1, tl.int32), mask=mask_k)
            tl.store(miss_count_ptr + b, 0)
            return
        r = _request_row(req_pool_ptr, b, sink_req)
        n = tl.load(seq_lens_ptr + b).to(tl.int32)
        base = tl.load(unit_base_ptr + r * U)
        capacity = tl.load(capacity_ptr + r)
        pos = tl.load(topk_ptr + b * topk_stride + offs_k, mask=mask_k, other=-1)
        pos = pos.to(tl.int32)

        # Phase 1: classify; this step's hits are marked for the sweep.
        in_window, lookup, loc = _classify_topk(
            pos, n, n, mask_k, r, req_to_token_ptr, req_to_token_stride, W
        )
        cur = tl.load(loc_to_slot_ptr + loc, mask=lookup, other=-1).to(tl.int32)
        hit, miss, miss_rank, num_misses = _split_lookups(lookup, cur)
        hit_at = _state_offset(unit_index_ptr, r, cur, hit, C0, U)
        bit_ty = ref_ptr.dtype.element_ty
        tl.store(ref_ptr + hit_at, tl.full([BLOCK_K], 2, bit_ty), mask=hit)
        tl.debug_barrier()

        # Phase 2: the victims, from the hand on.
        victims_row = victims_ptr + b.to(tl.int64) * K
        hand = tl.load(hand_ptr + r)
        last = _clock_sweep(
            ref_ptr,
            slot_loc_ptr,
            unit_index_ptr,
            loc_to_slot_ptr,
            victims_row,
            r,
            hand,
            capacity,
            num_misses,
            C0,
            U,
            BLOCK_S,
        )
        cap = tl.maximum(capacity, 1)
        tl.store(hand_ptr + r, (hand + last + 1) % cap, mask=num_misses > 0)
        tl.debug_barrier()

        # Phase 3: misses take their victims; hits' bits set, loaded clear.
        victim = _take_victims(
            victims_row,
            miss_rank,
            miss,
            loc,
            loc_to_slot_ptr,
            slot_loc_ptr,
            unit_index_ptr,
            r,
            C0,
            U,
        )
        slot = tl.where(hit, cur, victim)
        ref_at = _state_offset(unit_index_ptr, r, slot, lookup, C0, U)
        tl.store(ref_ptr + ref_at, hit.to(bit_ty), mask=lookup)
        slot_row, rows = _entry_rows(
            slot, lookup, in_window, pos, base, unit_base_ptr, r, C0, U, W
        )
        tl.store(pt_row + offs_k, rows, mask=mask_k)
        tl.store(
            miss_src_ptr + b * miss_src_stride + miss_rank, loc.to(tl.int64), mask=miss
        )
        tl.store(miss_dst_ptr + b * miss_dst_stride + miss_rank, slot_row, mask=miss)
        tl.store(miss_count_ptr + b, num_misses)
        _add_counters(
            counters_ptr,
            tl.sum(hit.to(tl.int32), axis=0),
            tl.sum(in_window.to(tl.int32), axis=0),
            num_misses,
        )
