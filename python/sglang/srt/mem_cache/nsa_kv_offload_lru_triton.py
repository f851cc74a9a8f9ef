"""The Triton swap backend of ``LRUCacheState`` (CUDA; CPU tests under
``TRITON_INTERPRET=1``): :class:`TritonLRUSwap` launches the kernels of
``nsa_kv_offload_lru_kernels`` (one query token) and
``nsa_kv_offload_lru_multi_kernels`` (MTP target verify), bit-exact with the
torch reference ``nsa_kv_offload_lru_reference``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from sglang.srt.mem_cache.nsa_kv_offload_lru_kernels import (
    _HAS_TRITON,
    swap_kernel_is_interpreted,
)
from sglang.srt.mem_cache.nsa_kv_offload_lru_reference import LayerSwapPlan

if _HAS_TRITON:
    import triton
    from sglang.srt.mem_cache.nsa_kv_offload_lru_kernels import (
        _map_new_tokens_kernel,
        _swap_copy_order_kernel,
        _swap_count_kernel,
        _swap_rank_kernel,
        _swap_select_kernel,
    )
    from sglang.srt.mem_cache.nsa_kv_offload_lru_multi_kernels import (
        _swap_multi_assign_kernel,
        _swap_multi_classify_kernel,
    )


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def default_num_warps(num_slots: int) -> int:
    """Warps of the swap kernels: 4, or 8 from 2,048 slots a request up (a
    tuning choice: 8 warps suffice)."""
    return 8 if _next_pow2(num_slots) >= 2048 else 4


class TritonLRUSwap:
    """The swap backend of ``LRUCacheState`` on CUDA (``state``: the
    ``LRUCacheState`` it serves; ``num_warps``: see :func:`default_num_warps`)."""

    # lru positions the select kernel scans per step for victims.
    SELECT_BLOCK = 1024

    def __init__(
        self,
        state,
        max_batch_size: Optional[int] = None,
        num_warps: Optional[int] = None,
    ):
        if not _HAS_TRITON:
            raise RuntimeError("the Triton LRU swap needs triton")
        if state.device.type != "cuda" and not swap_kernel_is_interpreted():
            raise RuntimeError(
                "the Triton LRU swap on a non-CUDA device needs TRITON_INTERPRET=1 "
                "set before its kernels are imported"
            )
        self.device = state.device
        self.top_k = state.top_k
        self.num_slots = state.num_slots
        self.buffer_size = state.buffer_size
        self.recent_window = state.recent_window
        self.max_units = state.max_units
        self.max_query_tokens = state.max_query_tokens
        self.slot_dtype = state.slot_dtype
        self.direct = state.direct_slots
        self.block_k = _next_pow2(self.top_k)
        self.num_warps = num_warps or default_num_warps(self.num_slots)
        self._scratch_rows = 0
        self._retired_scratch = []
        self._pending_reorder = None  # a deferred one-token reorder
        self._alloc_scratch(max_batch_size or state.max_num_reqs)

    def map_new_tokens(
        self, state, req_pool_indices, seq_lens, locs, loc_to_row
    ) -> None:
        bs = locs.numel()
        _map_new_tokens_kernel[(triton.cdiv(bs, 128),)](
            req_pool_indices,
            seq_lens,
            locs,
            state._unit_base_buf,
            loc_to_row,
            bs,
            C=self.buffer_size,
            W=self.recent_window,
            U=self.max_units,
            BLOCK=128,
        )

    def swap_layer(
        self,
        state,
        layer: int,
        topk_pos: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        req_to_token: torch.Tensor,
        num_real_reqs: Optional[Union[torch.Tensor, int]],
        out: Optional[LayerSwapPlan],
        num_query_tokens: int = 1,
        defer_reorder: bool = False,
    ) -> LayerSwapPlan:
        self.check_settled("swap_layer")
        q = num_query_tokens
        bs, k = topk_pos.shape[0] // q, topk_pos.shape[1]
        assert k == self.top_k, f"top-k width {k} != {self.top_k}"
        assert req_to_token.dtype == torch.int32
        plan = state.plan_view(bs, out, q)
        num_real = state.num_real_tensor(num_real_reqs, bs)
        if bs > self._scratch_rows:
            dev = self.device
            if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"swap_layer: bs={bs} exceeds the scratch rows "
                    f"({self._scratch_rows}); pass max_batch_size"
                )
            self._alloc_scratch(bs)
        if topk_pos.stride(1) != 1:
            topk_pos = topk_pos.contiguous()
        if req_to_token.stride(1) != 1:
            req_to_token = req_to_token.contiguous()
        if bs == 0:
            return plan
        loc_to_slot, slot_loc, lru, counters = state._layer_views[layer]
        batch = (
            topk_pos,
            topk_pos.stride(0),
            req_pool_indices,
            seq_lens,
            req_to_token,
            req_to_token.stride(0),
            num_real,
        )
        plan_rows = (
            plan.page_table,
            plan.page_table.stride(0),
            plan.miss_src_loc,
            plan.miss_src_loc.stride(0),
            plan.miss_dst_row,
            plan.miss_dst_row.stride(0),
        )
        maps = (loc_to_slot, slot_loc, lru)
        # A state built for several query tokens swaps with the multi-token
        # kernels (read_window), q = 1 too.
        if self.max_query_tokens > 1:
            self._multi_token_swap(state, q, batch, plan_rows, maps, counters, plan)
            return plan
        _swap_select_kernel[(batch[0].shape[0],)](
            *batch,
            *maps,
            state._unit_base_buf,
            state._unit_index_buf,
            state._capacity_buf,
            counters,
            *plan_rows,
            plan.miss_count,
            self._hit_flags,
            self._victims,
            state._sink_req,
            state._direct_buf,
            self._row_direct,
            K=self.top_k,
            C=self.num_slots,
            C0=self.buffer_size,
            U=self.max_units,
            W=self.recent_window,
            BLOCK_K=self.block_k,
            BLOCK_S=min(self.SELECT_BLOCK, _next_pow2(self.num_slots)),
            DIRECT=self.direct,
            num_warps=self.num_warps,
        )
        self._pending_reorder = (state, batch, maps, plan)
        if not defer_reorder:
            self.finish_reorder()
        return plan

    @property
    def reorder_pending(self) -> bool:
        return self._pending_reorder is not None

    def check_settled(self, what: str) -> None:
        """Refuse ``what`` while a deferred reorder has not been launched."""
        if self._pending_reorder is not None:
            raise RuntimeError(
                f"{what}: the LRU reorder of the last swap is still deferred; "
                "call finish_reorder() first"
            )

    def finish_reorder(self) -> None:
        """Launch the pending reorder (``lru_order``, hit flags) on the
        current stream; nothing when none is pending."""
        if self._pending_reorder is None:
            return
        state, batch, maps, plan = self._pending_reorder
        self._pending_reorder = None
        chunk = self._chunk_shape()
        self._count_and_rank(state, batch, self.top_k, maps, plan, chunk, True)
        _swap_copy_order_kernel[(batch[0].shape[0], self.max_units)](
            batch[2],
            batch[6],
            maps[2],
            self._new_lru,
            state._unit_index_buf,
            state._capacity_buf,
            state._sink_req,
            self._row_direct,
            DIRECT=self.direct,
            **chunk,
        )

    def _multi_token_swap(self, state, q, batch, plan_rows, maps, counters, plan):
        bs, U = plan.miss_count.shape[0], self.max_units
        shape = dict(
            K=self.top_k,
            Q=q,
            C=self.num_slots,
            C0=self.buffer_size,
            U=U,
            W=self.recent_window,
            WR=state.read_window,
            BLOCK_K=self.block_k,
            num_warps=self.num_warps,
        )
        chunk = self._chunk_shape()
        _swap_multi_classify_kernel[(bs,)](
            *batch,
            maps[0],
            counters,
            plan.page_table,
            plan.page_table.stride(0),
            plan.miss_count,
            self._hit_flags,
            state._sink_req,
            BLOCK_C0=chunk["BLOCK_C0"],
            **shape,
        )
        self._count_and_rank(state, batch, q * self.top_k, maps, plan, chunk, False)
        _swap_multi_assign_kernel[(bs, U)](
            *batch,
            *maps,
            state._unit_base_buf,
            state._unit_index_buf,
            state._capacity_buf,
            *plan_rows,
            self._victims,
            self._new_lru,
            state._sink_req,
            BLOCK_C0=chunk["BLOCK_C0"],
            **shape,
        )

    def _chunk_shape(self) -> dict:
        return dict(
            C=self.num_slots,
            C0=self.buffer_size,
            U=self.max_units,
            BLOCK_C0=_next_pow2(self.buffer_size),
            num_warps=self.num_warps,
        )

    def _count_and_rank(self, state, batch, victims_width, maps, plan, chunk, one):
        # Counts, then ranks and the new lru_order; the multi-token swap
        # evicts here, the one-token reorder (one) skips direct rows.
        bs, req_pool_indices, num_real = plan.miss_count.shape[0], batch[2], batch[6]
        direct = self.direct and one
        _swap_count_kernel[(bs, self.max_units)](
            req_pool_indices,
            num_real,
            maps[2],
            state._unit_index_buf,
            state._capacity_buf,
            self._hit_flags,
            self._evictable_counts,
            state._sink_req,
            self._row_direct,
            DIRECT=direct,
            **chunk,
        )
        _swap_rank_kernel[(bs, self.max_units)](
            req_pool_indices,
            num_real,
            *maps,
            state._unit_index_buf,
            state._capacity_buf,
            plan.miss_count,
            self._hit_flags,
            self._evictable_counts,
            self._victims,
            self._new_lru,
            state._sink_req,
            self._row_direct,
            K=victims_width,
            BLOCK_U=_next_pow2(self.max_units),
            DIRECT=direct,
            REORDER_ONLY=one,
            **chunk,
        )

    @staticmethod
    def scratch_bytes(
        rows: int,
        top_k: int,
        buffer_size: int,
        max_units: int,
        slot_id_bytes: int,
        max_query_tokens: int = 1,
    ) -> int:
        """GPU bytes of the scratch for ``rows`` batch rows (the pool sizing
        counts it): hit flags, victims, evictable counts, new order, flags."""
        C = buffer_size * max_units
        per_row = C + max_query_tokens * top_k * 4
        per_row += max_units * 4 + C * slot_id_bytes + 1
        return rows * per_row

    def _alloc_scratch(self, rows: int) -> None:
        # Shared by all layers; old buffers stay alive for CUDA graphs.
        self.check_settled("growing the scratch")
        if self._scratch_rows:
            self._retired_scratch.append(self._scratch)
        dev, K, C = self.device, self.top_k, self.num_slots

        def zeros(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=dev)

        self._hit_flags = zeros((rows, C), torch.int8)  # kernels leave it zero
        self._victims = zeros((rows, self.max_query_tokens * K), torch.int32)
        self._evictable_counts = zeros((rows, self.max_units), torch.int32)
        self._new_lru = zeros((rows, C), self.slot_dtype)
        self._row_direct = zeros((rows,), torch.int8)
        self._scratch = [
            self._hit_flags,
            self._victims,
            self._evictable_counts,
            self._new_lru,
            self._row_direct,
        ]
        self._scratch_rows = rows
