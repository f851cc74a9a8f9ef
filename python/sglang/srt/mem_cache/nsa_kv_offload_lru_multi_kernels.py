"""Triton kernels of the multi-token LRU swap: ``Q > 1`` query tokens per
request (MTP target verify), launched by
``nsa_kv_offload_lru_triton.TritonLRUSwap``; semantics in ``docs/MTP.md``, the
torch reference is ``nsa_kv_offload_lru_reference`` (``num_query_tokens``).

A request's ``Q`` top-k rows are one list of ``Q x K`` entries. The swap is the
one-token swap of ``nsa_kv_offload_lru_kernels`` with its classify and assign
steps looped over the query tokens:

1. per query token: classify its entries; a loc that is not resident and not
   yet missed by an earlier query token of the step is this step's next miss:
   its rank goes into ``loc_to_slot[loc]`` as the marker ``-2 - rank`` (every
   slot id is >= 0 and "not resident" is -1), so a later query token that
   picks the same loc reads the marker and takes the same rank: the misses are
   deduplicated without another map. Hit slots are flagged as before.
2. the ``lru_order`` walk, unchanged (victims by rank, recency rule).
3. per query token: an entry whose loc holds a marker takes the victim of its
   rank (and writes the copy list entry of that rank: repeats write the same
   values); an entry reading a slot id (a hit, or a miss a previous query
   token has already assigned) uses it. Every marker is replaced by its victim
   (the capacity check guarantees a victim for every miss).

Markers live in ``loc_to_slot`` only between phases 1 and 3 of one swap, on
locs of the swapping request (token locs are unique across requests).
"""

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships with every CUDA build
    _HAS_TRITON = False

if _HAS_TRITON:
    from sglang.srt.mem_cache.nsa_kv_offload_lru_kernels import (
        _add_counters,
        _classify_topk,
        _copy_back_order,
        _entry_rows,
        _evict_victims,
        _request_row,
        _state_offset,
        _take_victims,
        _zero_flags_by_unit,
    )

    @triton.jit
    def _mark_query_misses(
        topk_ptr,
        topk_stride,
        b,
        r,
        n,
        req_to_token_ptr,
        req_to_token_stride,
        loc_to_slot_ptr,
        flags_row,
        K: tl.constexpr,
        Q: tl.constexpr,
        WR: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Phase 1 over the Q query tokens; returns (distinct misses, looked-up
        # entries, window entries). The caller zeroed the flags and synced.
        offs_k = tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        num_misses = tl.zeros((), tl.int32)
        num_lookups = tl.zeros((), tl.int32)
        num_window = tl.zeros((), tl.int32)
        for j in tl.static_range(Q):
            row = topk_ptr + (b * Q + j).to(tl.int64) * topk_stride
            pos = tl.load(row + offs_k, mask=mask_k, other=-1).to(tl.int32)
            # Query token j sees n - Q + 1 + j positions; the ring reads WR.
            in_window, lookup, loc = _classify_topk(
                pos,
                n - Q + 1 + j,
                n,
                mask_k,
                r,
                req_to_token_ptr,
                req_to_token_stride,
                WR,
            )
            cur = tl.load(loc_to_slot_ptr + loc, mask=lookup, other=-1).to(tl.int32)
            new = lookup & (cur == -1)
            new_i = new.to(tl.int32)
            rank = num_misses + tl.cumsum(new_i, axis=0) - new_i
            tl.debug_barrier()  # every replica's load before the marks
            tl.store(
                loc_to_slot_ptr + loc,
                (-2 - rank).to(loc_to_slot_ptr.dtype.element_ty),
                mask=new,
            )
            tl.store(
                flags_row + cur,
                tl.full([BLOCK_K], 1, tl.int8),
                mask=lookup & (cur >= 0),
            )
            num_misses += tl.sum(new_i, axis=0)
            num_lookups += tl.sum(lookup.to(tl.int32), axis=0)
            num_window += tl.sum(in_window.to(tl.int32), axis=0)
            # The next query token reads this one's markers.
            tl.debug_barrier()
        return num_misses, num_lookups, num_window

    @triton.jit
    def _assign_query_rows(
        topk_ptr,
        topk_stride,
        b,
        r,
        n,
        base,
        req_to_token_ptr,
        req_to_token_stride,
        loc_to_slot_ptr,
        slot_loc_ptr,
        unit_base_ptr,
        unit_index_ptr,
        page_table_ptr,
        page_table_stride,
        miss_src_row,
        miss_dst_row,
        victims_row,
        K: tl.constexpr,
        Q: tl.constexpr,
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        W: tl.constexpr,
        WR: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Phase 3 over the Q query tokens: rows in each one's top-k order.
        offs_k = tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        for j in tl.static_range(Q):
            qrow = (b * Q + j).to(tl.int64)
            pos = tl.load(topk_ptr + qrow * topk_stride + offs_k, mask=mask_k, other=-1)
            pos = pos.to(tl.int32)
            in_window, lookup, loc = _classify_topk(
                pos,
                n - Q + 1 + j,
                n,
                mask_k,
                r,
                req_to_token_ptr,
                req_to_token_stride,
                WR,
            )
            code = tl.load(loc_to_slot_ptr + loc, mask=lookup, other=-1).to(tl.int32)
            miss = lookup & (code < -1)
            rank = -2 - code
            tl.debug_barrier()  # every replica's load before the maps change
            victim = _take_victims(
                victims_row,
                rank,
                miss,
                loc,
                loc_to_slot_ptr,
                slot_loc_ptr,
                unit_index_ptr,
                r,
                C0,
                U,
            )
            slot = tl.where(miss, victim, code)
            slot_row, rows = _entry_rows(
                slot, lookup, in_window, pos, base, unit_base_ptr, r, C0, U, W
            )
            tl.store(
                page_table_ptr + qrow * page_table_stride + offs_k, rows, mask=mask_k
            )
            tl.store(miss_src_row + rank, loc.to(tl.int64), mask=miss)
            tl.store(miss_dst_row + rank, slot_row, mask=miss)
            # The next query token may read the victims stored above (other
            # threads'). A marker or its victim gives the same slot, but
            # ordered, no argument is needed (test_nsa_kv_offload_kernel_hazards).
            tl.debug_barrier()

    @triton.jit
    def _padding_rows(
        page_table_ptr,
        page_table_stride,
        miss_count_ptr,
        b,
        K: tl.constexpr,
        Q: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # A CUDA-graph padding request: its Q page-table rows skip everything.
        offs_k = tl.arange(0, BLOCK_K)
        for j in tl.static_range(Q):
            qrow = (b * Q + j).to(tl.int64)
            tl.store(
                page_table_ptr + qrow * page_table_stride + offs_k,
                tl.full([BLOCK_K], -1, tl.int32),
                mask=offs_k < K,
            )
        tl.store(miss_count_ptr + b, 0)

    @triton.jit
    def _add_multi_counters(counters_ptr, num_misses, num_lookups, num_window):
        # A looked-up entry that needs no copy of its own is a hit (repeats of
        # this step's misses too).
        _add_counters(counters_ptr, num_lookups - num_misses, num_window, num_misses)

    @triton.jit(
        do_not_specialize_on_alignment=[
            "req_pool_ptr",
            "seq_lens_ptr",
            "num_real_ptr",
            "loc_to_slot_ptr",
            "counters_ptr",
            "miss_count_ptr",
        ]
    )
    def _swap_multi_classify_kernel(
        topk_ptr,
        topk_stride,
        req_pool_ptr,
        seq_lens_ptr,
        req_to_token_ptr,
        req_to_token_stride,
        num_real_ptr,
        loc_to_slot_ptr,
        counters_ptr,
        page_table_ptr,
        page_table_stride,
        miss_count_ptr,
        hit_flags_ptr,
        sink_req,
        K: tl.constexpr,
        Q: tl.constexpr,
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        W: tl.constexpr,
        WR: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_C0: tl.constexpr,
    ):
        b = tl.program_id(0)
        if b >= tl.load(num_real_ptr):
            _padding_rows(
                page_table_ptr, page_table_stride, miss_count_ptr, b, K, Q, BLOCK_K
            )
            return
        r = _request_row(req_pool_ptr, b, sink_req)
        n = tl.load(seq_lens_ptr + b).to(tl.int32)
        flags_row = hit_flags_ptr + b.to(tl.int64) * C
        _zero_flags_by_unit(flags_row, C0, U, BLOCK_C0)
        tl.debug_barrier()
        num_misses, num_lookups, num_window = _mark_query_misses(
            topk_ptr,
            topk_stride,
            b,
            r,
            n,
            req_to_token_ptr,
            req_to_token_stride,
            loc_to_slot_ptr,
            flags_row,
            K,
            Q,
            WR,
            BLOCK_K,
        )
        tl.store(miss_count_ptr + b, num_misses)
        _add_multi_counters(counters_ptr, num_misses, num_lookups, num_window)

    @triton.jit(
        do_not_specialize_on_alignment=[
            "req_pool_ptr",
            "seq_lens_ptr",
            "num_real_ptr",
            "loc_to_slot_ptr",
            "unit_base_ptr",
        ]
    )
    def _swap_multi_assign_kernel(
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
        page_table_ptr,
        page_table_stride,
        miss_src_ptr,
        miss_src_stride,
        miss_dst_ptr,
        miss_dst_stride,
        victims_ptr,
        new_lru_ptr,
        sink_req,
        K: tl.constexpr,
        Q: tl.constexpr,
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        W: tl.constexpr,
        WR: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_C0: tl.constexpr,
    ):
        b = tl.program_id(0)
        u = tl.program_id(1)
        if b >= tl.load(num_real_ptr):
            return
        r = _request_row(req_pool_ptr, b, sink_req)
        if u * C0 < tl.load(capacity_ptr + r):
            _copy_back_order(
                new_lru_ptr, lru_ptr, unit_index_ptr, b, r, u, C, C0, U, BLOCK_C0
            )
        if u == 0:
            _assign_query_rows(
                topk_ptr,
                topk_stride,
                b,
                r,
                tl.load(seq_lens_ptr + b).to(tl.int32),
                tl.load(unit_base_ptr + r * U),
                req_to_token_ptr,
                req_to_token_stride,
                loc_to_slot_ptr,
                slot_loc_ptr,
                unit_base_ptr,
                unit_index_ptr,
                page_table_ptr,
                page_table_stride,
                miss_src_ptr + b * miss_src_stride,
                miss_dst_ptr + b * miss_dst_stride,
                victims_ptr + b.to(tl.int64) * (Q * K),
                K,
                Q,
                C,
                C0,
                U,
                W,
                WR,
                BLOCK_K,
            )
