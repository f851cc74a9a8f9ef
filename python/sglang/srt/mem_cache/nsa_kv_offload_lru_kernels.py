"""Triton kernels of the LRU swap of ``LRUCacheState`` (launched by
``nsa_kv_offload_lru_triton.TritonLRUSwap``; on CPU the tests run them under
``TRITON_INTERPRET=1``). Semantics: ``docs/ENGINE.md``.
"""

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships with every CUDA build
    _HAS_TRITON = False


def swap_kernel_is_interpreted() -> bool:
    # triton.jit picks the interpreter from TRITON_INTERPRET at decoration time.
    return _HAS_TRITON and not isinstance(_swap_select_kernel, triton.JITFunction)


# The swap of one layer, one token per request, in two launches' worth of
# kernels (docs/ENGINE.md, "Per-layer swap semantics"):
#   _swap_select_kernel (bs,): classify the top-k entries (padding / window /
#     hit / miss), choose the victims by scanning lru_order from its least
#     recent end a block at a time, write the page table in top-k order and
#     the copy list. The attention needs nothing more.
#   the reorder, which only lru_order and the hit flags feel, so it may run
#   after the miss copy (TritonLRUSwap's defer_reorder), before the next swap:
#   _swap_count_kernel (bs, U): evictable slots per unit chunk of lru_order;
#   _swap_rank_kernel (bs, U): each chunk's new positions, to scratch; clears
#     the chunk's hit flags for the next select;
#   _swap_copy_order_kernel (bs, U): the new order back into lru_order.
# A scatter followed by a gather of the same scratch in another thread
# mapping goes through global memory with tl.debug_barrier() between them
# (bar.sync orders the CTA's global memory accesses).
if _HAS_TRITON:

    # Steps shared by the one-token kernels and the multi-token ones
    # (nsa_kv_offload_lru_multi_kernels).
    @triton.jit
    def _request_row(req_pool_ptr, b, sink_req):
        # The batch row's request pool index, clamped into the state (padding
        # rows may hold stale indices).
        r = tl.load(req_pool_ptr + b).to(tl.int64)
        return tl.minimum(tl.maximum(r, 0), sink_req)

    @triton.jit
    def _state_offset(unit_index_ptr, r, idx, mask, C0: tl.constexpr, U: tl.constexpr):
        # Offset in a layer's per-unit state (slot_loc, lru_order: C0 entries
        # per unit chunk) of entry idx (a slot id or an order position) of
        # request r: chunk unit_index[r, idx // C0], entry idx % C0. Callers
        # mask entries the request does not hold (idx >= its capacity).
        # int32 offsets: LRUCacheState checks that (num_units + 1) x C0 fits.
        if U == 1:
            chunk = tl.load(unit_index_ptr + r)
            return chunk * C0 + idx
        chunk = tl.load(unit_index_ptr + r * U + idx // C0, mask=mask, other=0)
        return chunk * C0 + idx % C0

    @triton.jit
    def _add_counters(counters_ptr, num_hits, num_window, num_misses):
        # The layer's (LRU hits, window hits, misses) counters.
        tl.atomic_add(counters_ptr + 0, num_hits.to(tl.int64))
        tl.atomic_add(counters_ptr + 1, num_window.to(tl.int64))
        tl.atomic_add(counters_ptr + 2, num_misses.to(tl.int64))

    @triton.jit
    def _classify_topk(
        pos,
        kv_len,
        n,
        mask_k,
        r,
        req_to_token_ptr,
        req_to_token_stride,
        W: tl.constexpr,
    ):
        # Top-k entries in the recent window, to look up (with their token
        # loc), or neither (padding / beyond the sequence). The query token
        # sees positions < kv_len; the window is the newest W of n (kv_len = n
        # with one query token).
        valid = mask_k & (pos >= 0) & (pos < kv_len)
        in_window = valid & (pos >= n - W)
        lookup = valid & (pos < n - W)
        loc = tl.load(
            req_to_token_ptr + r * req_to_token_stride + pos, mask=lookup, other=0
        )
        return in_window, lookup, loc

    @triton.jit
    def _split_lookups(lookup, cur):
        # Looked-up entries with a slot (hits) or none (misses); each miss's
        # rank among the misses in top-k order.
        hit = lookup & (cur >= 0)
        miss = lookup & (cur < 0)
        miss_i = miss.to(tl.int32)
        miss_rank = tl.cumsum(miss_i, axis=0) - miss_i
        return hit, miss, miss_rank, tl.sum(miss_i, axis=0)

    @triton.jit
    def _zero_flags_by_unit(
        flags_row, C0: tl.constexpr, U: tl.constexpr, BLOCK_C0: tl.constexpr
    ):
        # Zeroes the row's hit flags a unit at a time: the split kernels'
        # blocks are one unit wide.
        offs_c0 = tl.arange(0, BLOCK_C0)
        for u in tl.static_range(U):
            tl.store(
                flags_row + u * C0 + offs_c0,
                tl.zeros([BLOCK_C0], tl.int8),
                mask=offs_c0 < C0,
            )

    @triton.jit
    def _lru_new_positions(evictable, ev_rank, p, num_misses, num_evictable):
        # The recency rule: [untaken evictables, victims, hits], each in its
        # old order; p is the old position (below the capacity).
        new_pos = tl.where(
            evictable,
            tl.where(
                ev_rank >= num_misses,
                ev_rank - num_misses,
                num_evictable - num_misses + ev_rank,
            ),
            num_evictable + p - ev_rank,
        )
        return new_pos, evictable & (ev_rank < num_misses)

    @triton.jit
    def _evict_victims(
        loc_to_slot_ptr,
        old_loc,
        taken,
        victims_row,
        ev_rank,
        order,
        BLOCK: tl.constexpr,
    ):
        # Victims' old locs leave the map (phase 1 has read it already); the
        # victims go to scratch by rank, for the misses of phase 3 (a scatter
        # -> gather across threads).
        tl.store(
            loc_to_slot_ptr + old_loc,
            tl.full([BLOCK], -1, loc_to_slot_ptr.dtype.element_ty),
            mask=taken & (old_loc >= 0),
        )
        tl.store(victims_row + ev_rank, order, mask=taken)

    @triton.jit
    def _take_victims(
        victims_row,
        rank,
        miss,
        loc,
        loc_to_slot_ptr,
        slot_loc_ptr,
        unit_index_ptr,
        r,
        C0: tl.constexpr,
        U: tl.constexpr,
    ):
        # Phase 3: each miss takes the victim of its rank (both maps).
        victim = tl.load(victims_row + rank, mask=miss, other=0)
        tl.store(
            loc_to_slot_ptr + loc,
            victim.to(loc_to_slot_ptr.dtype.element_ty),
            mask=miss,
        )
        at = _state_offset(unit_index_ptr, r, victim, miss, C0, U)
        tl.store(slot_loc_ptr + at, loc, mask=miss)
        return victim

    @triton.jit
    def _entry_rows(
        slot,
        lookup,
        in_window,
        pos,
        base,
        unit_base_ptr,
        r,
        C0: tl.constexpr,
        U: tl.constexpr,
        W: tl.constexpr,
    ):
        # Page-table rows in top-k order: window ring, the slot's row in its
        # unit, or -1; and the slot rows (the copy destinations of misses).
        if U == 1:
            slot_row = base + slot
        else:
            unit_base = tl.load(
                unit_base_ptr + r * U + slot // C0, mask=lookup, other=0
            )
            slot_row = unit_base + slot % C0
        rows = tl.where(in_window, base + C0 + pos % W, tl.where(lookup, slot_row, -1))
        return slot_row, rows

    @triton.jit
    def _copy_back_order(
        new_lru_ptr,
        lru_ptr,
        unit_index_ptr,
        b,
        r,
        u,
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        BLOCK_C0: tl.constexpr,
    ):
        # Split assign: chunk u of the permuted lru_order, from scratch (the
        # caller skips chunks the request does not hold).
        offs_c0 = tl.arange(0, BLOCK_C0)
        mask = offs_c0 < C0
        new_order = tl.load(
            new_lru_ptr + b.to(tl.int64) * C + u * C0 + offs_c0, mask=mask
        )
        chunk = tl.load(unit_index_ptr + r * U + u)
        tl.store(lru_ptr + chunk * C0 + offs_c0, new_order, mask=mask)

    @triton.jit
    def _direct_fits(direct_ptr, r, n, capacity, real, W: tl.constexpr):
        # Whether the row swaps in direct mode: its request is in it and its
        # positions below the window fit its slots; a request in direct mode
        # that no longer fits leaves it for good.
        direct = real & (tl.load(direct_ptr + r) != 0)
        fits = direct & (n - W <= capacity)
        # Every thread reads the flag before one clears it (a late reader
        # would compute the same, but ordered, no argument is needed).
        tl.debug_barrier()
        tl.store(direct_ptr + r, 0, mask=direct & (fits == 0))
        return fits

    @triton.jit
    def _direct_row(
        pos,
        n,
        offs_k,
        mask_k,
        r,
        base,
        req_to_token_ptr,
        req_to_token_stride,
        loc_to_slot_ptr,
        slot_loc_ptr,
        unit_base_ptr,
        unit_index_ptr,
        counters_ptr,
        pt_row,
        miss_src_row,
        miss_dst_row,
        miss_count_at,
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        W: tl.constexpr,
    ):
        # The swap of a row in direct mode (slot = position): hits as always,
        # a miss of position p goes to slot p (empty: every resident position
        # is in its own slot), lru_order is not touched.
        in_window, lookup, loc = _classify_topk(
            pos, n, n, mask_k, r, req_to_token_ptr, req_to_token_stride, W
        )
        cur = tl.load(loc_to_slot_ptr + loc, mask=lookup, other=-1).to(tl.int32)
        hit, miss, miss_rank, num_misses = _split_lookups(lookup, cur)
        slot = tl.where(hit, cur, pos)
        # A top-k block smaller than the threads sits in several of them, all
        # of which load it; only one stores: every load before any store.
        tl.debug_barrier()
        tl.store(
            loc_to_slot_ptr + loc, pos.to(loc_to_slot_ptr.dtype.element_ty), mask=miss
        )
        at = _state_offset(unit_index_ptr, r, pos, miss, C0, U)
        tl.store(slot_loc_ptr + at, loc, mask=miss)
        slot_row, rows = _entry_rows(
            slot, lookup, in_window, pos, base, unit_base_ptr, r, C0, U, W
        )
        tl.store(pt_row + offs_k, rows, mask=mask_k)
        tl.store(miss_src_row + miss_rank, loc.to(tl.int64), mask=miss)
        tl.store(miss_dst_row + miss_rank, slot_row, mask=miss)
        tl.store(miss_count_at, num_misses)
        _add_counters(
            counters_ptr,
            tl.sum(hit.to(tl.int32), axis=0),
            tl.sum(in_window.to(tl.int32), axis=0),
            num_misses,
        )

    @triton.jit(
        do_not_specialize_on_alignment=[
            "req_pool_ptr",
            "seq_lens_ptr",
            "num_real_ptr",
            "loc_to_slot_ptr",
            "unit_base_ptr",
            "capacity_ptr",
            "counters_ptr",
            "miss_count_ptr",
            "direct_ptr",
        ]
    )
    def _swap_select_kernel(
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
        hit_flags_ptr,  # (rows, C) int8 scratch, zero on entry (the reorder clears it)
        victims_ptr,  # (rows, K) int32 scratch
        sink_req,
        direct_ptr,  # (max_reqs + 1,) int8: requests in direct mode
        row_direct_ptr,  # (rows,) int8 scratch: rows swapped in direct mode
        K: tl.constexpr,
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        W: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_S: tl.constexpr,  # lru positions scanned per step of the victim scan
        DIRECT: tl.constexpr = False,
    ):
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
        go_direct = False
        if DIRECT:
            go_direct = _direct_fits(direct_ptr, r, n, capacity, True, W)
            # The reorder kernels skip the row.
            tl.store(row_direct_ptr + b, go_direct.to(tl.int8))
        if go_direct:
            _direct_row(
                pos,
                n,
                offs_k,
                mask_k,
                r,
                base,
                req_to_token_ptr,
                req_to_token_stride,
                loc_to_slot_ptr,
                slot_loc_ptr,
                unit_base_ptr,
                unit_index_ptr,
                counters_ptr,
                pt_row,
                miss_src_ptr + b * miss_src_stride,
                miss_dst_ptr + b * miss_dst_stride,
                miss_count_ptr + b,
                C,
                C0,
                U,
                W,
            )
            return
        flags_row = hit_flags_ptr + b.to(tl.int64) * C
        victims_row = victims_ptr + b.to(tl.int64) * K

        # Phase 1: classify; hit flags by slot for the scan (and the reorder).
        in_window, lookup, loc = _classify_topk(
            pos, n, n, mask_k, r, req_to_token_ptr, req_to_token_stride, W
        )
        cur = tl.load(loc_to_slot_ptr + loc, mask=lookup, other=-1).to(tl.int32)
        hit, miss, miss_rank, num_misses = _split_lookups(lookup, cur)
        tl.store(flags_row + cur, tl.full([BLOCK_K], 1, tl.int8), mask=hit)
        tl.debug_barrier()

        # Phase 2, victims only: the first num_misses evictable slots.
        _scan_victims(
            lru_ptr,
            slot_loc_ptr,
            unit_index_ptr,
            r,
            flags_row,
            loc_to_slot_ptr,
            victims_row,
            capacity,
            num_misses,
            C0,
            U,
            BLOCK_S,
        )
        tl.debug_barrier()

        # Phase 3: misses take their victims; page table in top-k order.
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

    @triton.jit
    def _scan_victims(
        lru_ptr,
        slot_loc_ptr,
        unit_index_ptr,
        r,
        flags_row,
        loc_to_slot_ptr,
        victims_row,
        capacity,
        num_misses,
        C0: tl.constexpr,
        U: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        # Walks request r's lru_order from position 0 a block at a time until
        # num_misses evictable (not hit) slots are ranked or its held
        # positions end; the taken ones are evicted and go to scratch by rank.
        offs = tl.arange(0, BLOCK_S)
        found = num_misses * 0
        start = num_misses * 0
        while (found < num_misses) & (start < capacity):
            p = start + offs
            mask = p < capacity
            at = _state_offset(unit_index_ptr, r, p, mask, C0, U)
            order = tl.load(lru_ptr + at, mask=mask, other=0).to(tl.int32)
            flag = tl.load(flags_row + order, mask=mask, other=1)
            evictable = mask & (flag == 0)
            ev_i = evictable.to(tl.int32)
            ev_rank = found + tl.cumsum(ev_i, axis=0) - ev_i
            taken = evictable & (ev_rank < num_misses)
            old_loc = tl.load(
                slot_loc_ptr + _state_offset(unit_index_ptr, r, order, taken, C0, U),
                mask=taken,
                other=-1,
            )
            _evict_victims(
                loc_to_slot_ptr, old_loc, taken, victims_row, ev_rank, order, BLOCK_S
            )
            found += tl.sum(ev_i, axis=0)
            start += BLOCK_S

    @triton.jit
    def _chunk_evictable(
        b,
        r,
        u,
        lru_ptr,
        unit_index_ptr,
        hit_flags_ptr,
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        BLOCK_C0: tl.constexpr,
    ):
        # The lru_order entries of unit chunk u of request r (which it holds)
        # and which of them are evictable: not hit this step.
        chunk = tl.load(unit_index_ptr + r * U + u)
        offs_c0 = tl.arange(0, BLOCK_C0)
        mask = offs_c0 < C0
        order = tl.load(lru_ptr + chunk * C0 + offs_c0, mask=mask, other=0)
        order = order.to(tl.int32)
        hit = tl.load(hit_flags_ptr + b.to(tl.int64) * C + order, mask=mask, other=1)
        return order, mask & (hit == 0)

    @triton.jit
    def _reorder_program(
        req_pool_ptr,
        num_real_ptr,
        capacity_ptr,
        row_direct_ptr,
        sink_req,
        C0: tl.constexpr,
        DIRECT: tl.constexpr,
    ):
        # Program (b, u) of a reorder kernel: its request, whether it walks
        # row b (a real row, not one the select kernel swapped in direct
        # mode) and whether the request holds chunk u.
        b = tl.program_id(0)
        u = tl.program_id(1)
        walked = b < tl.load(num_real_ptr)
        if DIRECT:
            walked = walked & (tl.load(row_direct_ptr + b) == 0)
        r = _request_row(req_pool_ptr, b, sink_req)
        return b, u, r, walked, u * C0 < tl.load(capacity_ptr + r)

    @triton.jit(
        do_not_specialize_on_alignment=[
            "req_pool_ptr",
            "num_real_ptr",
            "capacity_ptr",
            "ev_count_ptr",
        ]
    )
    def _swap_count_kernel(
        req_pool_ptr,
        num_real_ptr,
        lru_ptr,
        unit_index_ptr,
        capacity_ptr,
        hit_flags_ptr,
        ev_count_ptr,  # (rows, U) int32 scratch
        sink_req,
        row_direct_ptr,  # (rows,) int8 scratch: rows swapped in direct mode
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        BLOCK_C0: tl.constexpr,
        DIRECT: tl.constexpr = False,
    ):
        b, u, r, walked, held = _reorder_program(
            req_pool_ptr,
            num_real_ptr,
            capacity_ptr,
            row_direct_ptr,
            sink_req,
            C0,
            DIRECT,
        )
        if not walked:
            return
        count = tl.zeros((), tl.int32)
        # Chunks past the request's units count none (the rank kernel sums
        # every chunk's count).
        if held:
            _, evictable = _chunk_evictable(
                b, r, u, lru_ptr, unit_index_ptr, hit_flags_ptr, C, C0, U, BLOCK_C0
            )
            count = tl.sum(evictable.to(tl.int32), axis=0)
        tl.store(ev_count_ptr + b * U + u, count)

    @triton.jit(
        do_not_specialize_on_alignment=[
            "req_pool_ptr",
            "num_real_ptr",
            "loc_to_slot_ptr",
            "capacity_ptr",
            "miss_count_ptr",
            "ev_count_ptr",
        ]
    )
    def _swap_rank_kernel(
        req_pool_ptr,
        num_real_ptr,
        loc_to_slot_ptr,
        slot_loc_ptr,
        lru_ptr,
        unit_index_ptr,
        capacity_ptr,
        miss_count_ptr,
        hit_flags_ptr,
        ev_count_ptr,
        victims_ptr,  # (rows, K) int32 scratch
        new_lru_ptr,  # (rows, C) scratch, lru_ptr's dtype
        sink_req,
        row_direct_ptr,  # (rows,) int8 scratch: rows swapped in direct mode
        K: tl.constexpr,
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        BLOCK_U: tl.constexpr,
        BLOCK_C0: tl.constexpr,
        DIRECT: tl.constexpr = False,
        # The multi-token swap evicts here. REORDER_ONLY: the one-token
        # select kernel has evicted already; the reorder leaves the hit flags
        # zero for the next select.
        REORDER_ONLY: tl.constexpr = False,
    ):
        b, u, r, walked, held = _reorder_program(
            req_pool_ptr,
            num_real_ptr,
            capacity_ptr,
            row_direct_ptr,
            sink_req,
            C0,
            DIRECT,
        )
        if not (walked & held):
            return
        offs_c0 = tl.arange(0, BLOCK_C0)
        mask = offs_c0 < C0
        p = u * C0 + offs_c0  # positions of this chunk in lru_order
        order, evictable = _chunk_evictable(
            b, r, u, lru_ptr, unit_index_ptr, hit_flags_ptr, C, C0, U, BLOCK_C0
        )
        if REORDER_ONLY:
            # Every slot is in one chunk's order: the row ends all zero (after
            # every replica of a chunk smaller than the threads has loaded).
            tl.debug_barrier()
            tl.store(
                hit_flags_ptr + b.to(tl.int64) * C + order,
                tl.zeros([BLOCK_C0], tl.int8),
                mask=mask,
            )
        offs_u = tl.arange(0, BLOCK_U)
        counts = tl.load(ev_count_ptr + b * U + offs_u, mask=offs_u < U, other=0)
        _rank_chunk(
            order,
            evictable,
            p,
            tl.sum(tl.where(offs_u < u, counts, 0), axis=0),
            tl.load(miss_count_ptr + b),
            tl.sum(counts, axis=0),
            r,
            loc_to_slot_ptr,
            slot_loc_ptr,
            unit_index_ptr,
            victims_ptr + b.to(tl.int64) * K,
            new_lru_ptr + b.to(tl.int64) * C,
            mask,
            C0,
            U,
            BLOCK_C0,
            not REORDER_ONLY,
        )

    @triton.jit
    def _rank_chunk(
        order,
        evictable,
        p,
        before,
        num_misses,
        num_evictable,
        r,
        loc_to_slot_ptr,
        slot_loc_ptr,
        unit_index_ptr,
        victims_row,
        new_lru_row,
        mask,
        C0: tl.constexpr,
        U: tl.constexpr,
        BLOCK_C0: tl.constexpr,
        EVICT: tl.constexpr = True,
    ):
        # Phase 2 of a split walk on one chunk (lru positions p), ``before``
        # evictable slots ahead of it: the chunk's new order to scratch and,
        # with EVICT, its victims by rank; returns the chunk's evictable count.
        ev_i = evictable.to(tl.int32)
        ev_rank = before + tl.cumsum(ev_i, axis=0) - ev_i
        new_pos, taken = _lru_new_positions(
            evictable, ev_rank, p, num_misses, num_evictable
        )
        if EVICT:
            old_loc = tl.load(
                slot_loc_ptr + _state_offset(unit_index_ptr, r, order, taken, C0, U),
                mask=taken,
                other=-1,
            )
            _evict_victims(
                loc_to_slot_ptr, old_loc, taken, victims_row, ev_rank, order, BLOCK_C0
            )
        tl.store(
            new_lru_row + new_pos, order.to(new_lru_row.dtype.element_ty), mask=mask
        )
        return tl.sum(ev_i, axis=0)

    @triton.jit(do_not_specialize_on_alignment=["req_pool_ptr", "num_real_ptr"])
    def _swap_copy_order_kernel(
        req_pool_ptr,
        num_real_ptr,
        lru_ptr,
        new_lru_ptr,
        unit_index_ptr,
        capacity_ptr,
        sink_req,
        row_direct_ptr,  # (rows,) int8 scratch: rows swapped in direct mode
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        BLOCK_C0: tl.constexpr,
        DIRECT: tl.constexpr = False,
    ):
        b, u, r, walked, held = _reorder_program(
            req_pool_ptr,
            num_real_ptr,
            capacity_ptr,
            row_direct_ptr,
            sink_req,
            C0,
            DIRECT,
        )
        if walked & held:
            _copy_back_order(
                new_lru_ptr, lru_ptr, unit_index_ptr, b, r, u, C, C0, U, BLOCK_C0
            )

    # One variant for every batch size and slice offset (see above).
    @triton.jit(
        do_not_specialize=["bs"],
        do_not_specialize_on_alignment=["req_pool_ptr", "seq_lens_ptr", "locs_ptr"],
    )
    def _map_new_tokens_kernel(
        req_pool_ptr,
        seq_lens_ptr,
        locs_ptr,
        unit_base_ptr,  # (max_reqs + 1, U) int32, unit 0 = the region
        loc_to_row_ptr,  # int64
        bs,
        C: tl.constexpr,
        W: tl.constexpr,
        U: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < bs
        r = tl.load(req_pool_ptr + offs, mask=mask, other=0)
        pos = tl.load(seq_lens_ptr + offs, mask=mask, other=1).to(tl.int64) - 1
        loc = tl.load(locs_ptr + offs, mask=mask, other=0)
        base = tl.load(unit_base_ptr + r * U, mask=mask, other=0).to(tl.int64)
        tl.store(loc_to_row_ptr + loc, base + C + pos % W, mask=mask)
