"""Triton kernels of the LRU swap of ``LRUCacheState``, launched by
``nsa_kv_offload_lru_triton.TritonLRUSwap`` (CPU tests: ``TRITON_INTERPRET=1``).

One layer, one token per request (``docs/ENGINE.md``, "Per-layer swap
semantics"): ``_swap_select_kernel`` (bs,) writes the page table and the copy
list; the reorder, which only ``lru_order`` and the hit flags feel (deferrable
until the next swap), is ``_swap_count_kernel``, ``_swap_rank_kernel`` and
``_swap_copy_order_kernel`` (bs, U). A scatter then a gather of the same
scratch in another thread mapping has a ``tl.debug_barrier()`` between them.
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


if _HAS_TRITON:

    # Steps shared with nsa_kv_offload_lru_multi_kernels.
    @triton.jit
    def _request_row(req_pool_ptr, b, sink_req):
        # The batch row's request pool index, clamped into the state.
        r = tl.load(req_pool_ptr + b).to(tl.int64)
        return tl.minimum(tl.maximum(r, 0), sink_req)

    @triton.jit
    def _state_offset(unit_index_ptr, r, idx, mask, C0: tl.constexpr, U: tl.constexpr):
        # Offset of entry idx (slot id or order position) of request r in a
        # layer's per-unit state; callers mask idx >= capacity (int32 fits).
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
    def _classify_topk(pos, kv_len, n, mask_k, token_row, W: tl.constexpr):
        # Entries in the window (the newest W of n), to look up (with their
        # loc), or neither; the query token sees positions < kv_len.
        valid = mask_k & (pos >= 0) & (pos < kv_len)
        in_window = valid & (pos >= n - W)
        lookup = valid & (pos < n - W)
        loc = tl.load(token_row + pos, mask=lookup, other=0)
        return in_window, lookup, loc

    @triton.jit
    def _split_lookups(lookup, cur):
        # Hits, misses, each miss's rank in top-k order, the miss count.
        hit = lookup & (cur >= 0)
        miss = lookup & (cur < 0)
        miss_i = miss.to(tl.int32)
        miss_rank = tl.cumsum(miss_i, axis=0) - miss_i
        return hit, miss, miss_rank, tl.sum(miss_i, axis=0)

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
        # Victims' old locs leave the map; the victims go to scratch by rank.
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
        # Each miss takes the victim of its rank (both maps).
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
        # Slot rows (copy destinations); page-table rows (ring, slot, -1).
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
    def _store_row(
        slot, hit, miss, lookup, in_window, pos, loc, miss_rank, num_misses,
        base, unit_base_ptr, r, pt_row, offs_k, mask_k, miss_src_row,
        miss_dst_row, miss_count_at, counters_ptr,
        C0: tl.constexpr, U: tl.constexpr, W: tl.constexpr,
    ):  # fmt: skip
        # The row's page table (top-k order), copy list and counters.
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
        # Chunk u (held) of the new lru_order, from scratch.
        offs_c0 = tl.arange(0, BLOCK_C0)
        mask = offs_c0 < C0
        new_order = tl.load(
            new_lru_ptr + b.to(tl.int64) * C + u * C0 + offs_c0, mask=mask
        )
        chunk = tl.load(unit_index_ptr + r * U + u)
        tl.store(lru_ptr + chunk * C0 + offs_c0, new_order, mask=mask)

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
            # Direct while positions below the window fit; else for good off.
            direct = tl.load(direct_ptr + r) != 0
            go_direct = direct & (n - W <= capacity)
            tl.debug_barrier()  # every thread reads the flag before the clear
            tl.store(direct_ptr + r, 0, mask=direct & (go_direct == 0))
            tl.store(row_direct_ptr + b, go_direct.to(tl.int8))  # reorder skips
        flags_row = hit_flags_ptr + b.to(tl.int64) * C
        victims_row = victims_ptr + b.to(tl.int64) * K
        token_row = req_to_token_ptr + r * req_to_token_stride
        in_window, lookup, loc = _classify_topk(pos, n, n, mask_k, token_row, W)
        cur = tl.load(loc_to_slot_ptr + loc, mask=lookup, other=-1).to(tl.int32)
        hit, miss, miss_rank, num_misses = _split_lookups(lookup, cur)
        if go_direct:
            # A miss of position p takes slot p (empty); lru_order untouched.
            slot = tl.where(hit, cur, pos)
            tl.debug_barrier()  # replicas of a small block: loads before stores
            tl.store(
                loc_to_slot_ptr + loc,
                pos.to(loc_to_slot_ptr.dtype.element_ty),
                mask=miss,
            )
            at = _state_offset(unit_index_ptr, r, pos, miss, C0, U)
            tl.store(slot_loc_ptr + at, loc, mask=miss)
            # Its own epilogue and return: one shared by both paths spills.
            _store_row(
                slot, hit, miss, lookup, in_window, pos, loc, miss_rank, num_misses,
                base, unit_base_ptr, r, pt_row, offs_k, mask_k,
                miss_src_ptr + b * miss_src_stride, miss_dst_ptr + b * miss_dst_stride,
                miss_count_ptr + b, counters_ptr, C0, U, W,
            )  # fmt: skip
            return
        # Victims: the first num_misses unflagged slots of lru_order.
        tl.store(flags_row + cur, tl.full([BLOCK_K], 1, tl.int8), mask=hit)
        tl.debug_barrier()
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
            at = _state_offset(unit_index_ptr, r, order, taken, C0, U)
            old_loc = tl.load(slot_loc_ptr + at, mask=taken, other=-1)
            _evict_victims(
                loc_to_slot_ptr,
                old_loc,
                taken,
                victims_row,
                ev_rank,
                order,
                BLOCK_S,
            )
            found += tl.sum(ev_i, axis=0)
            start += BLOCK_S
        tl.debug_barrier()
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
        _store_row(
            slot, hit, miss, lookup, in_window, pos, loc, miss_rank, num_misses,
            base, unit_base_ptr, r, pt_row, offs_k, mask_k,
            miss_src_ptr + b * miss_src_stride, miss_dst_ptr + b * miss_dst_stride,
            miss_count_ptr + b, counters_ptr, C0, U, W,
        )  # fmt: skip

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
        # Chunk u (held) of request r's lru_order, its unflagged entries.
        chunk = tl.load(unit_index_ptr + r * U + u)
        offs_c0 = tl.arange(0, BLOCK_C0)
        mask = offs_c0 < C0
        order = tl.load(lru_ptr + chunk * C0 + offs_c0, mask=mask, other=0)
        order = order.to(tl.int32)
        hit = tl.load(hit_flags_ptr + b.to(tl.int64) * C + order, mask=mask, other=1)
        return order, mask & (hit == 0)

    @triton.jit
    def _reorder_program(
        req_pool_ptr, num_real_ptr, row_direct_ptr, sink_req, DIRECT: tl.constexpr
    ):
        # Program (b, u): its request, whether row b (real, not direct) walks.
        b = tl.program_id(0)
        u = tl.program_id(1)
        walked = b < tl.load(num_real_ptr)
        if DIRECT:
            walked = walked & (tl.load(row_direct_ptr + b) == 0)
        r = _request_row(req_pool_ptr, b, sink_req)
        return b, u, r, walked

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
        b, u, r, walked = _reorder_program(
            req_pool_ptr, num_real_ptr, row_direct_ptr, sink_req, DIRECT
        )
        held = u * C0 < tl.load(capacity_ptr + r)  # the request holds chunk u
        if not walked:
            return
        count = tl.zeros((), tl.int32)
        # Chunks the request does not hold count none.
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
        # REORDER_ONLY: one token (no eviction; the hit flags end zero).
        REORDER_ONLY: tl.constexpr = False,
    ):
        b, u, r, walked = _reorder_program(
            req_pool_ptr, num_real_ptr, row_direct_ptr, sink_req, DIRECT
        )
        held = u * C0 < tl.load(capacity_ptr + r)  # the request holds chunk u
        if not (walked & held):
            return
        offs_c0 = tl.arange(0, BLOCK_C0)
        mask = offs_c0 < C0
        p = u * C0 + offs_c0  # positions of this chunk in lru_order
        order, evictable = _chunk_evictable(
            b, r, u, lru_ptr, unit_index_ptr, hit_flags_ptr, C, C0, U, BLOCK_C0
        )
        if REORDER_ONLY:
            # The flags are read in one thread layout (vectorized, 8
            # contiguous per thread) and cleared via hit_flags[order] in
            # another (one per thread): without the barrier a thread may clear
            # a flag another has not read (cross-thread write-after-read), and
            # a missed flag leaves a slot listed twice in the LRU order (two
            # misses into one row, a stale loc_to_slot): the wrong KV read at
            # 16 warps and with 2 units. The barrier must stay. The row ends 0.
            tl.debug_barrier()
            tl.store(
                hit_flags_ptr + b.to(tl.int64) * C + order,
                tl.zeros([BLOCK_C0], tl.int8),
                mask=mask,
            )
        # Recency rule: [untaken evictables, victims, hits], each in old order.
        offs_u = tl.arange(0, BLOCK_U)
        counts = tl.load(ev_count_ptr + b * U + offs_u, mask=offs_u < U, other=0)
        before = tl.sum(tl.where(offs_u < u, counts, 0), axis=0)
        num_misses = tl.load(miss_count_ptr + b)
        num_evictable = tl.sum(counts, axis=0)
        victims_row = victims_ptr + b.to(tl.int64) * K
        new_lru_row = new_lru_ptr + b.to(tl.int64) * C
        ev_i = evictable.to(tl.int32)
        ev_rank = before + tl.cumsum(ev_i, axis=0) - ev_i
        new_pos = tl.where(
            evictable,
            tl.where(
                ev_rank >= num_misses,
                ev_rank - num_misses,
                num_evictable - num_misses + ev_rank,
            ),
            num_evictable + p - ev_rank,
        )
        taken = evictable & (ev_rank < num_misses)
        if not REORDER_ONLY:
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
        b, u, r, walked = _reorder_program(
            req_pool_ptr, num_real_ptr, row_direct_ptr, sink_req, DIRECT
        )
        held = u * C0 < tl.load(capacity_ptr + r)  # the request holds chunk u
        if walked & held:
            _copy_back_order(
                new_lru_ptr, lru_ptr, unit_index_ptr, b, r, u, C, C0, U, BLOCK_C0
            )

    # One variant for every batch size and slice offset.
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
