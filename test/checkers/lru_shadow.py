"""The torch reference swap in the shadow of every Triton swap (test tooling).

:func:`shadow_reference` wraps an ``LRUCacheState``'s Triton backend: before
each swap it copies the state (on the stream the swap runs on), runs
``ReferenceLRUSwap`` on the copy with the same inputs, and compares what the
two wrote: the plan (page table, copy list) and the layer's maps right after
the swap, its ``lru_order`` once the (maybe deferred) reorder has run. The
first difference raises ``AssertionError`` naming the swap (layer, count),
the batch and the entries that differ: where a GPU run goes wrong, which
kernel output first disagrees with the reference, on which input.
"""

from __future__ import annotations

import contextlib
import copy
from typing import List, Optional

import torch
from sglang.srt.mem_cache.lru_cache_state import LRUCacheState
from sglang.srt.mem_cache.nsa_kv_offload_lru_reference import ReferenceLRUSwap

# The LRUCacheState buffers a swap reads or writes (besides its inputs).
STATE_BUFFERS = (
    "_loc_to_slot_buf",
    "_slot_loc_buf",
    "_lru_buf",
    "_unit_base_buf",
    "_unit_index_buf",
    "_capacity_buf",
    "_direct_buf",
    "counters",
)


class ShadowReference:
    """The comparisons of one state's swaps (see :func:`shadow_reference`)."""

    def __init__(self, state: LRUCacheState):
        self.state = state
        self.swaps = 0
        self.compared_orders = 0
        self._pending: Optional[tuple] = None

    def copy_state(self) -> LRUCacheState:
        s = self.state
        shadow = copy.copy(s)
        for name in STATE_BUFFERS:
            setattr(shadow, name, getattr(s, name).clone())
        shadow._region_base_buf = shadow._unit_base_buf[:, 0]
        shadow._layer_views = None  # the reference reads the buffers
        shadow.swap_backend = ReferenceLRUSwap()
        return shadow

    def _describe(self, layer, inputs) -> str:
        topk, req_pool_indices, seq_lens, num_real = inputs
        reqs = req_pool_indices.tolist()
        s = self.state
        return (
            f"swap {self.swaps} (layer {layer}): requests {reqs}, lengths "
            f"{seq_lens.tolist()}, real rows {num_real}, capacity "
            f"{[int(s._capacity_buf[r]) for r in reqs]}, direct "
            f"{[int(s._direct_buf[r]) for r in reqs]}"
        )

    @staticmethod
    def _diff(name, got, want, limit=6) -> List[str]:
        if torch.equal(got, want):
            return []
        idx = (got != want).nonzero()[:limit].tolist()
        pairs = [
            f"{i}: {got[tuple(i)].item()} (reference {want[tuple(i)].item()})"
            for i in idx
        ]
        return [
            f"{name} differs at {int((got != want).sum())} entries: " + "; ".join(pairs)
        ]

    def after_swap(self, layer, shadow, inputs, plan, ref_plan, where) -> None:
        s = self.state
        num_real = inputs[3]
        bs = inputs[1].shape[0]
        real = min(bs, num_real)
        out = []
        out += self._diff(
            "page_table", plan.page_table[:real], ref_plan.page_table[:real]
        )
        out += self._diff(
            "miss_count", plan.miss_count[:real], ref_plan.miss_count[:real]
        )
        for b in range(real):
            n = int(ref_plan.miss_count[b])
            out += self._diff(
                f"miss_src_loc[{b}]",
                plan.miss_src_loc[b, :n],
                ref_plan.miss_src_loc[b, :n],
            )
            out += self._diff(
                f"miss_dst_row[{b}]",
                plan.miss_dst_row[b, :n],
                ref_plan.miss_dst_row[b, :n].to(plan.miss_dst_row.dtype),
            )
        N, sink = s.num_locs, s.num_units
        out += self._diff(
            "loc_to_slot",
            s._loc_to_slot_buf[layer, :N],
            shadow._loc_to_slot_buf[layer, :N],
        )
        out += self._diff(
            "slot_loc",
            s._slot_loc_buf[layer, :sink],
            shadow._slot_loc_buf[layer, :sink],
        )
        out += self._diff("direct", s._direct_buf[:-1], shadow._direct_buf[:-1])
        if out:
            raise AssertionError(where + ":\n  " + "\n  ".join(out))

    def after_reorder(self) -> None:
        if self._pending is None:
            return
        shadow, layer, where = self._pending
        self._pending = None
        sink = self.state.num_units
        out = self._diff(
            "lru_order",
            self.state._lru_buf[layer, :sink],
            shadow._lru_buf[layer, :sink],
        )
        if out:
            raise AssertionError(where + " (after the reorder):\n  " + "\n  ".join(out))
        self.compared_orders += 1


@contextlib.contextmanager
def shadow_reference(state: LRUCacheState):
    """Compare every one-token Triton swap of ``state`` in the block with
    the torch reference (yields the :class:`ShadowReference`). Host syncs
    after every swap: a diagnosis tool, not for timing."""
    backend = state.swap_backend
    shadow_ref = ShadowReference(state)
    orig_swap, orig_finish = backend.swap_layer, backend.finish_reorder

    def finish_reorder():
        orig_finish()
        shadow_ref.after_reorder()

    def swap_layer(*args, defer_reorder=False):
        # LRUCacheState.swap_layer's call: (state, layer, topk_pos,
        # req_pool_indices, seq_lens, req_to_token, num_real_reqs, out,
        # num_query_tokens).
        st, layer, topk_pos, req_pool_indices, seq_lens, req_to_token = args[:6]
        if len(args) > 8 and args[8] != 1:
            raise NotImplementedError("the shadow compares one-token swaps")
        shadow = shadow_ref.copy_state()
        bs = req_pool_indices.shape[0]
        num_real = int(st.num_real_tensor(args[6], bs)[0])
        inputs = (
            topk_pos.clone(),
            req_pool_indices.clone(),
            seq_lens.clone(),
            num_real,
        )
        shadow_ref.swaps += 1
        where = shadow_ref._describe(layer, inputs)
        plan = orig_swap(*args, defer_reorder=True)
        ref_plan = shadow.swap_backend.swap_layer(
            shadow, layer, *inputs[:3], req_to_token, num_real, None
        )
        shadow_ref.after_swap(layer, shadow, inputs, plan, ref_plan, where)
        shadow_ref._pending = (shadow, layer, where)
        if not defer_reorder:
            finish_reorder()
        return plan

    backend.swap_layer = swap_layer
    backend.finish_reorder = finish_reorder
    try:
        yield shadow_ref
    finally:
        del backend.swap_layer
        del backend.finish_reorder
