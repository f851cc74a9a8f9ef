"""The Triton swap backend of ``LRUCacheState`` (CUDA; the CPU tests run it
under ``TRITON_INTERPRET=1``).

:class:`TritonLRUSwap` launches the kernels of ``nsa_kv_offload_lru_kernels``: one fused
kernel per layer (``_swap_layer_kernel``), or, with units (``max_units > 1``),
the select kernel (page table and copy list) and the three reorder kernels
(``lru_order``, split by unit; ``defer_reorder`` lets them wait until after
the miss copy), plus the per-step new-token mapping. Several query tokens per
request (MTP target verify) run the kernels of ``nsa_kv_offload_lru_multi_kernels``.
Semantics: ``docs/ENGINE.md``, ``docs/MTP.md``; the pure-torch reference in
``nsa_kv_offload_lru_reference`` is bit-exact with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch
from sglang.srt.mem_cache.nsa_kv_offload_lru_kernels import (
    _HAS_TRITON,
)
from sglang.srt.mem_cache.nsa_kv_offload_lru_kernels import (
    swap_kernel_is_interpreted as _swap_kernel_is_interpreted,
)
from sglang.srt.mem_cache.nsa_kv_offload_lru_reference import LayerSwapPlan

if _HAS_TRITON:
    import triton
    from sglang.srt.mem_cache.nsa_kv_offload_clock import _clock_swap_kernel
    from sglang.srt.mem_cache.nsa_kv_offload_lru_kernels import (
        _map_new_tokens_kernel,
        _swap_copy_order_kernel,
        _swap_count_kernel,
        _swap_layer_kernel,
        _swap_rank_kernel,
        _swap_select_kernel,
    )
    from sglang.srt.mem_cache.nsa_kv_offload_lru_multi_kernels import (
        _swap_multi_assign_kernel,
        _swap_multi_classify_kernel,
        _swap_multi_layer_kernel,
    )

if TYPE_CHECKING:
    from sglang.srt.mem_cache.lru_cache_state import LRUCacheState


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_triton_usable(device: torch.device) -> None:
    """Raise when the kernels cannot run on ``device``."""
    if not _HAS_TRITON:
        raise RuntimeError("use_triton=True but triton is not installed")
    if device.type != "cuda" and not _swap_kernel_is_interpreted():
        raise RuntimeError(
            "the Triton swap kernel on a non-CUDA device needs "
            "TRITON_INTERPRET=1 set before this module is imported"
        )


class TritonLRUSwap:
    """The swap backend of ``LRUCacheState`` on CUDA.

    ``split_by_unit`` (default: with units) runs the swap as the select kernel
    and the reorder split by unit; ``False`` runs the one-program fused kernel
    even with units (benchmarks and tests compare the two). ``multi_split`` is
    the same choice for swaps of several query tokens per request (default:
    split with units, or when one program would walk more than
    ``FUSED_MAX_SLOTS`` slots).
    Multi-token kernels run every swap of a state with ``max_query_tokens > 1``
    (its read window is shorter); ``always_multi_token`` runs them for one
    query token of a one-token state too (tests: the two must agree).
    """

    # The fused walk holds 8 lru entries per thread at 16 warps without
    # spills; at 8192 slots (16 per thread) it spills (kernel_resources.py,
    # sm_90), the split kernels do not.
    FUSED_MAX_SLOTS = 4096
    # lru positions the select kernel scans per step for victims: misses are
    # found near the least recent end, one block in steady state.
    SELECT_BLOCK = 1024
    SPLIT_MAX_WARPS = 8

    def __init__(
        self,
        state: LRUCacheState,
        max_batch_size: Optional[int] = None,
        num_warps: Optional[int] = None,
        split_by_unit: Optional[bool] = None,
        multi_split: Optional[bool] = None,
        always_multi_token: bool = False,
    ):
        check_triton_usable(state.device)
        self.device = state.device
        self.top_k = state.top_k
        self.num_slots = state.num_slots
        self.slot_dtype = state.slot_dtype
        self.buffer_size = state.buffer_size
        self.recent_window = state.recent_window
        self.max_units = state.max_units
        self.max_query_tokens = state.max_query_tokens
        # Rows in direct mode (slot = position) skip the LRU walk.
        self.direct = state.direct_slots
        self.block_c = _next_pow2(self.num_slots)
        self.block_k = _next_pow2(self.top_k)
        if num_warps is None:
            # ~256 lru entries per warp keeps the fused kernel near 128
            # registers/thread without spills (C=4096 -> 16 warps).
            num_warps = min(16, max(4, self.block_c // 256))
        self.num_warps = num_warps
        # The kernels split by unit at most SPLIT_MAX_WARPS: at 16 warps they
        # diverged from the torch reference on the H200 (4 units of 4,096
        # rows, every slot held: gpu_check_units.py, results/units/
        # per_unit_gpu_gate/), at 8 and 4 they did not. Root cause not found.
        self.split_num_warps = min(num_warps, self.SPLIT_MAX_WARPS)
        self.clock_block = self.clock_sweep_block(self.buffer_size)
        # Units: the fused kernel walks all U x C slots in one program.
        self.split_by_unit = (
            self.max_units > 1 if split_by_unit is None else split_by_unit
        )
        if multi_split is None:
            multi_split = self.split_by_unit or self.block_c > self.FUSED_MAX_SLOTS
        self.multi_split = multi_split
        self.always_multi_token = always_multi_token
        # Whether the split kernels' hand-over scratch is needed.
        self._split_scratch = self.max_units > 1 or (
            multi_split and (self.max_query_tokens > 1 or always_multi_token)
        )
        self._scratch_rows = 0
        self._retired_scratch = []
        # The reorder of the last split swap, when its caller deferred it.
        self._pending_reorder = None
        self._alloc_scratch(max_batch_size or state.max_num_reqs)

    @classmethod
    def clock_sweep_block(cls, buffer_size: int) -> int:
        """Positions CLOCK's sweep reads at a time: at most a revolution
        (every request holds at least one unit of ``buffer_size`` slots)."""
        return min(cls.SELECT_BLOCK, 1 << (int(buffer_size).bit_length() - 1))

    def map_new_tokens(
        self,
        state: LRUCacheState,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        locs: torch.Tensor,
        loc_to_row: torch.Tensor,
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
        state: LRUCacheState,
        layer: int,
        topk_pos: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        req_to_token: torch.Tensor,
        num_real_reqs: Optional[Union[torch.Tensor, int]],
        out: Optional[LayerSwapPlan],
        counters: Optional[torch.Tensor],
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
            if _is_capturing(self.device):
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
        loc_to_slot, slot_loc, lru, layer_counters = state._layer_views[layer]
        if counters is None:
            counters = layer_counters
        batch, plan_rows = self.launch_rows(
            topk_pos, req_pool_indices, seq_lens, req_to_token, num_real, plan
        )
        if state.uses_clock:
            # One kernel, no recency update to defer; lru_order's storage
            # holds the CLOCK bits.
            _clock_swap_kernel[(bs,)](
                *batch,
                loc_to_slot,
                slot_loc,
                lru,
                state._hand_views[layer],
                state._unit_base_buf,
                state._unit_index_buf,
                state._capacity_buf,
                counters,
                *plan_rows,
                plan.miss_count,
                self._victims,
                state._sink_req,
                K=self.top_k,
                C0=self.buffer_size,
                U=self.max_units,
                W=self.recent_window,
                BLOCK_K=self.block_k,
                BLOCK_S=self.clock_block,
                num_warps=self.split_num_warps,
            )
            return plan
        # With several query tokens per swap allowed, every swap (one query
        # token too) reads the shorter window (read_window): multi kernels.
        if q > 1 or self.multi_token:
            self.multi_token_swap(
                state, q, batch, plan_rows, loc_to_slot, slot_loc, lru, counters, plan
            )
            return plan
        if self.split_by_unit:
            self._split_swap(
                state, batch, plan_rows, loc_to_slot, slot_loc, lru, counters, plan
            )
            if not defer_reorder:
                self.finish_reorder()
            return plan
        _swap_layer_kernel[(bs,)](
            *self._fused_args(
                state, batch, plan_rows, loc_to_slot, slot_loc, lru, counters, plan
            ),
            state._direct_buf,
            K=self.top_k,
            C=self.num_slots,
            C0=self.buffer_size,
            U=self.max_units,
            W=self.recent_window,
            BLOCK_K=self.block_k,
            BLOCK_C=self.block_c,
            DIRECT=self.direct,
            num_warps=self.num_warps,
        )
        return plan

    def _split_swap(
        self,
        state: LRUCacheState,
        batch: tuple,
        plan_rows: tuple,
        loc_to_slot: torch.Tensor,
        slot_loc: torch.Tensor,
        lru: torch.Tensor,
        counters: torch.Tensor,
        plan: LayerSwapPlan,
    ) -> None:
        # The swap with units: the select kernel leaves the page table and
        # the copy list final; the reorder (pending until finish_reorder)
        # moves lru_order and clears the hit flags. batch and plan_rows as
        # swap_layer builds them.
        bs = batch[0].shape[0]
        shape = self._chunk_shape()
        _swap_select_kernel[(bs,)](
            *batch,
            loc_to_slot,
            slot_loc,
            lru,
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
            C=shape["C"],
            C0=shape["C0"],
            U=shape["U"],
            W=self.recent_window,
            BLOCK_K=self.block_k,
            BLOCK_S=min(self.SELECT_BLOCK, self.block_c),
            DIRECT=self.direct,
            num_warps=self.split_num_warps,
        )
        self._pending_reorder = (state, batch, loc_to_slot, slot_loc, lru, plan)

    @property
    def multi_token(self) -> bool:
        """Whether every swap runs the multi-token kernels."""
        return self.always_multi_token or self.max_query_tokens > 1

    @property
    def reorder_pending(self) -> bool:
        return self._pending_reorder is not None

    def check_settled(self, what: str) -> None:
        """Refuse ``what`` while a deferred reorder has not been launched:
        it would read or write an lru_order that is not final."""
        if self._pending_reorder is not None:
            raise RuntimeError(
                f"{what}: the LRU reorder of the last swap is still deferred; "
                "call finish_reorder() first"
            )

    def finish_reorder(self) -> None:
        """Launch the reorder of the last split swap (``lru_order`` and the hit
        flags), on the current stream; nothing when none is pending."""
        if self._pending_reorder is None:
            return
        state, batch, loc_to_slot, slot_loc, lru, plan = self._pending_reorder
        self._pending_reorder = None
        shape = self._chunk_shape()
        self._count_and_rank(
            state,
            batch,
            self.top_k,
            loc_to_slot,
            slot_loc,
            lru,
            plan,
            shape,
            direct=self.direct,
            reorder_only=True,
        )
        _swap_copy_order_kernel[(batch[0].shape[0], self.max_units)](
            batch[2],
            batch[6],
            lru,
            self._new_lru,
            state._unit_index_buf,
            state._capacity_buf,
            state._sink_req,
            self._row_direct,
            DIRECT=self.direct,
            **shape,
        )

    def multi_token_swap(
        self,
        state: LRUCacheState,
        q: int,
        batch: tuple,
        plan_rows: tuple,
        loc_to_slot: torch.Tensor,
        slot_loc: torch.Tensor,
        lru: torch.Tensor,
        counters: torch.Tensor,
        plan: LayerSwapPlan,
    ) -> None:
        """The swap with ``q`` query tokens per request (batch and plan_rows
        as swap_layer builds them); ``q = 1`` gives the one-token results (the
        tests compare the two)."""
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
        if not self.multi_split:
            _swap_multi_layer_kernel[(bs,)](
                *self._fused_args(
                    state, batch, plan_rows, loc_to_slot, slot_loc, lru, counters, plan
                ),
                BLOCK_C=self.block_c,
                **shape,
            )
            return
        shape["num_warps"] = self.split_num_warps
        chunk = self._chunk_shape()
        _swap_multi_classify_kernel[(bs,)](
            *batch,
            loc_to_slot,
            counters,
            plan.page_table,
            plan.page_table.stride(0),
            plan.miss_count,
            self._hit_flags,
            state._sink_req,
            BLOCK_C0=chunk["BLOCK_C0"],
            **shape,
        )
        self._count_and_rank(
            state, batch, q * self.top_k, loc_to_slot, slot_loc, lru, plan, chunk
        )
        _swap_multi_assign_kernel[(bs, U)](
            *batch,
            loc_to_slot,
            slot_loc,
            lru,
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
        # Launch constants of the split kernels (blocks of one unit).
        return dict(
            C=self.num_slots,
            C0=self.buffer_size,
            U=self.max_units,
            BLOCK_C0=_next_pow2(self.buffer_size),
            num_warps=self.split_num_warps,
        )

    def _count_and_rank(
        self,
        state: LRUCacheState,
        batch: tuple,
        victims_width: int,
        loc_to_slot: torch.Tensor,
        slot_loc: torch.Tensor,
        lru: torch.Tensor,
        plan: LayerSwapPlan,
        chunk: dict,
        direct: bool = False,
        reorder_only: bool = False,
    ) -> None:
        # Phase 2 of the split swap: per-chunk evictable counts, then ranks
        # and the new lru_order. The multi-token swap evicts here (victims
        # rows of victims_width: Q x K with Q query tokens); the one-token
        # reorder (reorder_only) only reorders and clears the hit flags. With
        # direct, rows the select kernel swapped in direct mode are skipped.
        bs, req_pool_indices, num_real = plan.miss_count.shape[0], batch[2], batch[6]
        U = self.max_units
        _swap_count_kernel[(bs, U)](
            req_pool_indices,
            num_real,
            lru,
            state._unit_index_buf,
            state._capacity_buf,
            self._hit_flags,
            self._evictable_counts,
            state._sink_req,
            self._row_direct,
            DIRECT=direct,
            **chunk,
        )
        _swap_rank_kernel[(bs, U)](
            req_pool_indices,
            num_real,
            loc_to_slot,
            slot_loc,
            lru,
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
            BLOCK_U=_next_pow2(U),
            DIRECT=direct,
            REORDER_ONLY=reorder_only,
            **chunk,
        )

    @staticmethod
    def launch_rows(
        topk_pos, req_pool_indices, seq_lens, req_to_token, num_real, plan
    ) -> tuple:
        """Launch arguments shared by the fused and the split kernels: the
        batch's inputs and the plan's outputs, each tensor with its row stride."""
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
        return batch, plan_rows

    def _fused_args(
        self, state, batch, plan_rows, loc_to_slot, slot_loc, lru, counters, plan
    ) -> tuple:
        """Positional arguments of the one-program swap kernels (one- and
        multi-token: the same list)."""
        return (
            *batch,
            loc_to_slot,
            slot_loc,
            lru,
            state._unit_base_buf,
            state._unit_index_buf,
            state._capacity_buf,
            counters,
            *plan_rows,
            plan.miss_count,
            self._hit_flags,
            self._victims,
            state._sink_req,
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
        """GPU bytes of the scratch :meth:`_alloc_scratch` allocates for
        ``rows`` batch rows (at most: the split swap's hand-over is counted
        with units or several query tokens). It grows with the slots a
        request may hold (``max_units x buffer_size``): the pool sizing
        counts it."""
        C = buffer_size * max_units
        per_row = C + max_query_tokens * top_k * 4  # hit flags, victims
        if max_units > 1 or max_query_tokens > 1:
            # Evictable counts, the new order, the direct-row flags.
            per_row += max_units * 4 + C * slot_id_bytes + 1
        return rows * per_row

    def _alloc_scratch(self, rows: int) -> None:
        # Per-batch-row scratch of the kernels, shared by all layers: swaps of
        # one state must run on one stream. Old buffers stay alive because
        # captured CUDA graphs may still point at them.
        self.check_settled("growing the scratch")
        if self._scratch_rows:
            self._retired_scratch.append(self._scratch)
        dev, K, C = self.device, self.top_k, self.num_slots
        # Zeroed here; the fused and multi-token kernels zero a row before
        # they use it, the one-token reorder clears what its select set (a
        # state runs one or the other: one query token or several).
        self._hit_flags = torch.zeros((rows, C), dtype=torch.int8, device=dev)
        # Victims by rank: up to Q x K misses per request with Q query tokens
        # (the one-token kernels use rows of K).
        self._victims = torch.zeros(
            (rows, self.max_query_tokens * K), dtype=torch.int32, device=dev
        )
        self._scratch = [self._hit_flags, self._victims]
        if self._split_scratch:
            # The split swap's hand-over between its kernels.
            self._evictable_counts = torch.zeros(
                (rows, self.max_units), dtype=torch.int32, device=dev
            )
            self._new_lru = torch.zeros((rows, C), dtype=self.slot_dtype, device=dev)
            self._row_direct = torch.zeros((rows,), dtype=torch.int8, device=dev)
            self._scratch += [
                self._evictable_counts,
                self._new_lru,
                self._row_direct,
            ]
        self._scratch_rows = rows
