"""Triton kernels of the multi-token LRU swap (``Q > 1`` query tokens per
request, MTP target verify; ``docs/MTP.md``), launched by
``nsa_kv_offload_lru_triton``. A request's ``Q x K`` entries are one list:
classify marks each distinct new miss in ``loc_to_slot[loc]`` as ``-2 -
rank`` (slot ids are >= 0, -1 is "not resident"), so a repeat takes the same
rank; the rank kernel evicts; assign gives each marked entry its rank's
victim and replaces every marker by it (markers live only within one swap).
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
        _request_row,
        _take_victims,
    )

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
            # A CUDA-graph padding request: its Q page-table rows skip all.
            offs_k = tl.arange(0, BLOCK_K)
            for j in tl.static_range(Q):
                qrow = (b * Q + j).to(tl.int64)
                tl.store(
                    page_table_ptr + qrow * page_table_stride + offs_k,
                    tl.full([BLOCK_K], -1, tl.int32),
                    mask=offs_k < K,
                )
            tl.store(miss_count_ptr + b, 0)
            return
        r = _request_row(req_pool_ptr, b, sink_req)
        n = tl.load(seq_lens_ptr + b).to(tl.int32)
        token_row = req_to_token_ptr + r * req_to_token_stride
        flags_row = hit_flags_ptr + b.to(tl.int64) * C
        # Zero the row's hit flags a unit at a time (the rank kernel's blocks).
        offs_c0 = tl.arange(0, BLOCK_C0)
        for u in tl.static_range(U):
            tl.store(
                flags_row + u * C0 + offs_c0,
                tl.zeros([BLOCK_C0], tl.int8),
                mask=offs_c0 < C0,
            )
        tl.debug_barrier()
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
                pos, n - Q + 1 + j, n, mask_k, token_row, WR
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
            tl.debug_barrier()  # the next query token reads these markers
        tl.store(miss_count_ptr + b, num_misses)
        # A looked-up entry needing no copy of its own (a repeat too) is a hit.
        _add_counters(counters_ptr, num_lookups - num_misses, num_window, num_misses)

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
            # A marked entry takes the victim of its rank (repeats write the
            # same copy entry).
            n = tl.load(seq_lens_ptr + b).to(tl.int32)
            base = tl.load(unit_base_ptr + r * U)
            token_row = req_to_token_ptr + r * req_to_token_stride
            miss_src_row = miss_src_ptr + b * miss_src_stride
            miss_dst_row = miss_dst_ptr + b * miss_dst_stride
            victims_row = victims_ptr + b.to(tl.int64) * (Q * K)
            offs_k = tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            for j in tl.static_range(Q):
                qrow = (b * Q + j).to(tl.int64)
                pos = tl.load(
                    topk_ptr + qrow * topk_stride + offs_k, mask=mask_k, other=-1
                )
                pos = pos.to(tl.int32)
                in_window, lookup, loc = _classify_topk(
                    pos, n - Q + 1 + j, n, mask_k, token_row, WR
                )
                code = tl.load(loc_to_slot_ptr + loc, mask=lookup, other=-1)
                code = code.to(tl.int32)
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
                    page_table_ptr + qrow * page_table_stride + offs_k,
                    rows,
                    mask=mask_k,
                )
                tl.store(miss_src_row + rank, loc.to(tl.int64), mask=miss)
                tl.store(miss_dst_row + rank, slot_row, mask=miss)
                tl.debug_barrier()  # the next query token reads the victims
