"""Per-(layer, request) LRU residency of the decode-side NSA KV offload.

Each request admitted for decode owns one contiguous region of ``R = C + W`` GPU
KV rows, the same rows in every layer: ``C`` LRU-managed slots (rows
``base + s``) and a ``W``-row recent window (rows ``base + C + pos % W``). For
every layer this module tracks which token locs the slots hold and in which
order they were used, and turns one layer's top-k positions into a GPU page
table plus the list of host->GPU copies to make. The exact semantics are in
``docs/ENGINE.md`` ("Per-layer swap semantics").

With ``max_units = U > 1`` a request's LRU slots may span up to ``U`` units
of ``C`` rows each (its region is unit 0; ``grow_request`` / ``shrink_request``
add and drop units at other bases): slot ``s`` lives at row
``unit_base[r, s // C] + s % C`` and only the request's first ``capacity[r]``
slots are ever evicted into. ``U = 1`` is the fixed-region case above.

Everything is fixed-shape and sync-free so the swap can be captured in a CUDA
graph. ``swap_layer`` runs one fused Triton kernel (with units: the same swap
split by unit into four kernels, see ``_swap_classify_kernel``); the pure-torch
reference (``prepare_layer_swap`` -> ``build_gpu_page_table`` ->
``post_process_layer_swap``) implements the same semantics bit-exactly and backs
the CPU tests.

Callers guarantee: top-k positions unique apart from padding; token locs unique
across live requests; a request is released before its pool index is admitted
again; swaps of one state run on one stream (the kernel's scratch is shared).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

import torch

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships with every CUDA build
    _HAS_TRITON = False

IndexLike = Union[int, Sequence[int], torch.Tensor]


class LayerSwapPlan(NamedTuple):
    """Result of one layer's swap for a batch of ``bs`` rows.

    Only the first ``miss_count[b]`` entries of ``miss_src_loc[b]`` and
    ``miss_dst_row[b]`` are meaningful; the rest are garbage.
    """

    page_table: torch.Tensor  # (bs, K) int32, GPU rows in top-k order, -1 = skip
    miss_src_loc: torch.Tensor  # (bs, K) int64, host slot (= token loc) to load
    miss_dst_row: torch.Tensor  # (bs, K) int32, GPU row to load it into
    miss_count: torch.Tensor  # (bs,) int32


@dataclass
class LayerSwapWork:
    """Intermediate state of the reference swap, passed between its three steps."""

    layer: int
    real: torch.Tensor  # (bs,) bool, row is not CUDA-graph padding
    req: torch.Tensor  # (bs,) int64, request pool index (padding -> sink row)
    base: torch.Tensor  # (bs,) int64, region base row (unit 0)
    pos: torch.Tensor  # (bs, K) int64, top-k positions
    in_window: torch.Tensor  # (bs, K) bool
    hit: torch.Tensor  # (bs, K) bool
    miss: torch.Tensor  # (bs, K) bool
    loc: torch.Tensor  # (bs, K) int64, token loc of looked-up entries
    slot: torch.Tensor  # (bs, K) int64, LRU slot of hits and misses, else -1
    row: torch.Tensor  # (bs, K) int64, GPU row of ``slot``, else -1
    miss_rank: torch.Tensor  # (bs, K) int64, index among the row's misses
    num_misses: torch.Tensor  # (bs,) int64
    num_hits: torch.Tensor  # (bs,) int64
    order: torch.Tensor  # (bs, C) int64, lru_order before the step
    order_evictable: torch.Tensor  # (bs, C) bool, slot at that position not hit
    evict_rank: torch.Tensor  # (bs, C) int64, rank among evictable positions


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def default_use_triton(device: torch.device) -> bool:
    """Fused kernel on CUDA; on CPU only under ``TRITON_INTERPRET=1`` (tests)."""
    if not _HAS_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and _swap_kernel_is_interpreted()


class LRUCacheState:
    """GPU residency and recency of the LRU slots of every (layer, request).

    Internal buffers carry one extra "sink" entry (loc ``N`` in ``loc_to_slot``,
    request row ``max_num_reqs`` in the per-request tensors): the reference path
    routes masked-out scatters there instead of filtering with a host sync.
    The public attributes are views without the sink.
    """

    def __init__(
        self,
        num_layers: int,
        max_num_reqs: int,
        num_locs: int,
        buffer_size: int,
        recent_window: int,
        top_k: int,
        device: Union[str, torch.device] = "cuda",
        use_triton: Optional[bool] = None,
        max_batch_size: Optional[int] = None,
        num_warps: Optional[int] = None,
        max_units: int = 1,
    ):
        if buffer_size < top_k:
            raise ValueError(f"buffer_size ({buffer_size}) must be >= top_k ({top_k})")
        if not 1 <= recent_window < buffer_size:
            raise ValueError(
                f"recent_window ({recent_window}) must be in [1, buffer_size)"
            )
        if max_units < 1:
            raise ValueError(f"max_units ({max_units}) must be >= 1")
        if buffer_size * max_units > torch.iinfo(torch.int16).max:
            raise ValueError(
                "buffer_size x max_units must fit int16 (loc_to_slot, lru_order)"
            )
        self.num_layers = num_layers
        self.max_num_reqs = max_num_reqs
        self.num_locs = num_locs
        self.buffer_size = buffer_size
        self.max_units = max_units
        # LRU slots per (layer, request) across all units; a request uses
        # its first capacity[r] of them.
        self.num_slots = buffer_size * max_units
        self.recent_window = recent_window
        self.top_k = top_k
        self.region_size = buffer_size + recent_window
        self.device = torch.device(device)
        if use_triton is None:
            use_triton = default_use_triton(self.device)
        if use_triton and not _HAS_TRITON:
            raise RuntimeError("use_triton=True but triton is not installed")
        if use_triton and self.device.type != "cuda":
            if not _swap_kernel_is_interpreted():
                raise RuntimeError(
                    "the Triton swap kernel on a non-CUDA device needs "
                    "TRITON_INTERPRET=1 set before this module is imported"
                )
        self.use_triton = bool(use_triton)
        self.block_c = _next_pow2(self.num_slots)
        self.block_k = _next_pow2(top_k)
        if num_warps is None:
            # ~256 lru entries per warp keeps the fused kernel near 128
            # registers/thread without spills (C=4096 -> 16 warps).
            num_warps = min(16, max(4, self.block_c // 256))
        self.num_warps = num_warps
        # Units: the swap runs as kernels split by unit (the fused kernel
        # walks all U x C slots in one program). Benchmarks flip it to compare.
        self.split_swap = max_units > 1

        L, C, dev = num_layers, self.num_slots, self.device
        self._sink_req = max_num_reqs
        self._loc_to_slot_buf = torch.full(
            (L, num_locs + 1), -1, dtype=torch.int16, device=dev
        )
        self._slot_loc_buf = torch.full(
            (L, max_num_reqs + 1, C), -1, dtype=torch.int32, device=dev
        )
        self._lru_buf = (
            torch.arange(C, dtype=torch.int16, device=dev)
            .repeat(L, max_num_reqs + 1, 1)
            .contiguous()
        )
        # unit_base[r, u]: first GPU row of unit u of request r (-1: none);
        # unit 0 is the region, read through the view _region_base_buf
        # (kernels: unit_base_ptr + r * U).
        self._unit_base_buf = torch.full(
            (max_num_reqs + 1, max_units), -1, dtype=torch.int32, device=dev
        )
        self._unit_base_buf[self._sink_req] = 0
        self._region_base_buf = self._unit_base_buf[:, 0]
        self._capacity_buf = torch.zeros(
            (max_num_reqs + 1,), dtype=torch.int32, device=dev
        )
        # loc_to_slot[l, loc]: LRU slot holding loc in layer l, -1 if not resident.
        self.loc_to_slot = self._loc_to_slot_buf[:, :num_locs]
        # slot_loc[l, r, s]: token loc in slot s of request r, -1 if empty.
        self.slot_loc = self._slot_loc_buf[:, :max_num_reqs]
        # lru_order[l, r]: permutation of slots, index 0 = least recently used.
        self.lru_order = self._lru_buf[:, :max_num_reqs]
        # region_base[r]: first GPU KV row of request r's region, -1 if none.
        self.region_base = self._region_base_buf[:max_num_reqs]
        self.unit_base = self._unit_base_buf[:max_num_reqs]
        # capacity[r]: LRU slots request r may use (its units x C), 0 if none.
        self.capacity = self._capacity_buf[:max_num_reqs]
        # counters[l] = (LRU hits, window hits, misses), accumulated on device.
        self.counters = torch.zeros((L, 3), dtype=torch.int64, device=dev)

        self._arange_c = torch.arange(C, dtype=torch.int64, device=dev)
        # Per-layer views handed to the kernel (saves launch-time slicing).
        self._layer_views = [
            (
                self._loc_to_slot_buf[layer],
                self._slot_loc_buf[layer],
                self._lru_buf[layer],
                self.counters[layer],
            )
            for layer in range(L)
        ]
        self._scratch_rows = 0
        self._retired_scratch = []
        if self.use_triton:
            self._alloc_scratch(max_batch_size or max_num_reqs)

    # ------------------------------------------------------------------ counters

    def reset_counters(self) -> None:
        self.counters.zero_()

    # ---------------------------------------------------------------- lifecycle

    def _as_index(self, r: IndexLike) -> torch.Tensor:
        if isinstance(r, torch.Tensor):
            return r.to(device=self.device, dtype=torch.int64).reshape(-1)
        return torch.tensor(r, dtype=torch.int64, device=self.device).reshape(-1)

    def admit_request(self, r: IndexLike, base: IndexLike) -> None:
        """Give request(s) ``r`` the region starting at GPU row ``base``.

        It holds one unit (``C`` slots); all slots start empty with
        ``lru_order = arange(U x C)``. ``r`` must not hold resident locs (fresh,
        or released since its last admission).
        """
        r = self._as_index(r)
        if isinstance(base, torch.Tensor):
            base = base.to(device=self.device, dtype=torch.int32).reshape(-1)
        else:
            base = torch.tensor(base, dtype=torch.int32, device=self.device)
        self._unit_base_buf[r] = -1
        self._region_base_buf[r] = base
        self._capacity_buf[r] = self.buffer_size
        self._slot_loc_buf[:, r] = -1
        self._lru_buf[:, r] = self._arange_c.to(self._lru_buf.dtype)

    def release_request(self, r: IndexLike) -> None:
        """Drop every resident loc of request(s) ``r`` in every layer."""
        r = self._as_index(r)
        locs = self._slot_loc_buf[:, r, :].reshape(self.num_layers, -1).long()
        # Empty slots (-1) go to the sink loc.
        idx = torch.where(locs >= 0, locs, self.num_locs)
        self._loc_to_slot_buf.scatter_(1, idx, -1)
        self._slot_loc_buf[:, r] = -1
        self._lru_buf[:, r] = self._arange_c.to(self._lru_buf.dtype)
        self._unit_base_buf[r] = -1
        self._capacity_buf[r] = 0

    def grow_request(self, r: int, unit: int, base: int) -> None:
        """Give request ``r`` unit ``unit`` (its next one: it holds ``unit``
        units now) at GPU row ``base``. The unit's empty slots move to the LRU
        end of every layer's order, so misses fill them before evicting."""
        if not 1 <= unit < self.max_units:
            raise ValueError(f"unit {unit} not in [1, {self.max_units})")
        C = self.buffer_size
        lo, hi = unit * C, (unit + 1) * C
        self._unit_base_buf[r, unit] = base
        self._capacity_buf[r] = hi
        order = self._lru_buf[:, r].long()
        # Stable partition: the new slots first, everything else in its order.
        is_new = (order >= lo) & (order < hi)
        idx = torch.argsort((~is_new).to(torch.int8), dim=1, stable=True)
        self._lru_buf[:, r] = order.gather(1, idx).to(self._lru_buf.dtype)

    def shrink_request(self, r: int, unit: int) -> None:
        """Drop request ``r``'s last unit ``unit`` (it holds ``unit + 1``):
        the locs its slots hold stop being resident in every layer (the host
        pool keeps every token, so nothing is copied). Slots beyond the
        capacity are never victims; the order keeps them where they are."""
        if not 1 <= unit < self.max_units:
            raise ValueError(f"unit {unit} not in [1, {self.max_units})")
        C = self.buffer_size
        lo, hi = unit * C, (unit + 1) * C
        locs = self._slot_loc_buf[:, r, lo:hi].long()
        self._loc_to_slot_buf.scatter_(
            1, torch.where(locs >= 0, locs, self.num_locs), -1
        )
        self._slot_loc_buf[:, r, lo:hi] = -1
        self._unit_base_buf[r, unit] = -1
        self._capacity_buf[r] = lo

    def warm_request(
        self,
        layers: Union[int, range, Sequence[int]],
        r: int,
        locs: torch.Tensor,
    ) -> torch.Tensor:
        """Install ``locs`` as resident in request ``r`` for each of ``layers``.

        ``locs`` is ``(n,)`` (same locs in every layer) or ``(len(layers), n)``;
        ``-1`` entries are ignored, the others must be unique, ``n <= C``. Each
        layer is one swap step over ``locs``: locs already resident are hits,
        the others take LRU victims in order, and recency follows the tie rule
        (the last loc ends up most recent). Counters are not touched.

        Returns ``(len(layers), n)`` int32 GPU rows now holding each loc (-1 for
        ignored entries); the caller fills the newly installed rows.
        """
        if isinstance(layers, int):
            layers = [layers]
        layers = list(layers)
        locs = locs.to(device=self.device, dtype=torch.int64)
        if locs.dim() == 1:
            locs = locs.unsqueeze(0).expand(len(layers), -1)
        if locs.shape[1] > self.buffer_size:
            raise ValueError("warm_request: more locs than a unit's LRU slots")
        req = self._as_index(r)[:1]
        base = self._region_base_buf[req].long()
        rows = []
        for i, layer in enumerate(layers):
            loc = locs[i : i + 1]
            lookup = loc >= 0
            work = self._assign_slots(layer, req, base, lookup, loc)
            self._reorder_lru(work)
            rows.append(work.row)
        return torch.cat(rows).to(torch.int32)

    def window_rows(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """Window ring row of each request's newest token (position
        ``seq_lens - 1``): ``region_base + C + (seq_lens - 1) % W``, int64."""
        base = self._region_base_buf[req_pool_indices.long()].long()
        pos = seq_lens.long() - 1
        return base + self.buffer_size + pos % self.recent_window

    def map_new_tokens(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        locs: torch.Tensor,
        loc_to_row: torch.Tensor,
    ) -> None:
        """``loc_to_row[locs] = window_rows(req_pool_indices, seq_lens)``: one
        decode step's new tokens go to their window rows. One launch on CUDA
        (it runs every step, outside the CUDA graphs)."""
        bs = locs.numel()
        if bs == 0:
            return
        if not self.use_triton:
            loc_to_row[locs] = self.window_rows(req_pool_indices, seq_lens)
            return
        _map_new_tokens_kernel[(triton.cdiv(bs, 128),)](
            req_pool_indices,
            seq_lens,
            locs,
            self._unit_base_buf,
            loc_to_row,
            bs,
            C=self.buffer_size,
            W=self.recent_window,
            U=self.max_units,
            BLOCK=128,
        )

    # ------------------------------------------------------------- fused swap

    def swap_layer(
        self,
        layer: int,
        topk_pos: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        req_to_token: torch.Tensor,
        num_real_reqs: Optional[Union[torch.Tensor, int]] = None,
        out: Optional[LayerSwapPlan] = None,
        counters: Optional[torch.Tensor] = None,
    ) -> LayerSwapPlan:
        """Swap one layer for a batch: page table in top-k order + copy plan.

        ``num_real_reqs`` is a 1-element int32 device tensor (rows at or past it
        are CUDA-graph padding); ``None`` means every row is real. ``out`` holds
        preallocated buffers with at least ``bs`` rows (CUDA-graph capture);
        the returned plan views their first ``bs`` rows. ``counters`` (3,)
        int64 receives the hit / window / miss counts instead of the layer's
        own (a prefetch counts apart from the demand swaps).
        """
        if not self.use_triton:
            work = self.prepare_layer_swap(
                layer, topk_pos, req_pool_indices, seq_lens, req_to_token, num_real_reqs
            )
            page_table = self.build_gpu_page_table(
                work, out=None if out is None else out.page_table
            )
            return self.post_process_layer_swap(
                work, page_table, out=out, counters=counters
            )

        bs, k = topk_pos.shape
        assert k == self.top_k, f"top-k width {k} != {self.top_k}"
        assert req_to_token.dtype == torch.int32
        plan = self._out_buffers(bs, out)
        num_real = self._num_real_tensor(num_real_reqs, bs)
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
        loc_to_slot, slot_loc, lru, layer_counters = self._layer_views[layer]
        if counters is None:
            counters = layer_counters
        # Launch arguments shared by the fused and the split kernels.
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
        if self.split_swap:
            self._split_swap(
                batch, plan_rows, loc_to_slot, slot_loc, lru, counters, plan
            )
            return plan
        _swap_layer_kernel[(bs,)](
            *batch,
            loc_to_slot,
            slot_loc,
            lru,
            self._unit_base_buf,
            self._capacity_buf,
            counters,
            *plan_rows,
            plan.miss_count,
            self._hit_flags,
            self._victims,
            self._sink_req,
            K=self.top_k,
            C=self.num_slots,
            C0=self.buffer_size,
            U=self.max_units,
            W=self.recent_window,
            BLOCK_K=self.block_k,
            BLOCK_C=self.block_c,
            num_warps=self.num_warps,
        )
        return plan

    def _split_swap(
        self,
        batch: tuple,
        plan_rows: tuple,
        loc_to_slot: torch.Tensor,
        slot_loc: torch.Tensor,
        lru: torch.Tensor,
        counters: torch.Tensor,
        plan: LayerSwapPlan,
    ) -> None:
        # The swap with units as four kernels (see _swap_classify_kernel);
        # batch and plan_rows as swap_layer builds them.
        bs, req_pool_indices, num_real = batch[0].shape[0], batch[2], batch[6]
        U, C0 = self.max_units, self.buffer_size
        shape = dict(
            C=self.num_slots,
            C0=C0,
            U=U,
            BLOCK_C0=_next_pow2(C0),
            num_warps=self.num_warps,
        )
        _swap_classify_kernel[(bs,)](
            *batch,
            loc_to_slot,
            counters,
            plan.page_table,
            plan.page_table.stride(0),
            plan.miss_count,
            self._hit_flags,
            self._entry_slots,
            self._sink_req,
            K=self.top_k,
            W=self.recent_window,
            BLOCK_K=self.block_k,
            **shape,
        )
        _swap_count_kernel[(bs, U)](
            req_pool_indices,
            num_real,
            lru,
            self._capacity_buf,
            self._hit_flags,
            self._evictable_counts,
            self._sink_req,
            **shape,
        )
        _swap_rank_kernel[(bs, U)](
            req_pool_indices,
            num_real,
            loc_to_slot,
            slot_loc,
            lru,
            self._capacity_buf,
            plan.miss_count,
            self._hit_flags,
            self._evictable_counts,
            self._victims,
            self._new_lru,
            self._sink_req,
            K=self.top_k,
            BLOCK_U=_next_pow2(U),
            **shape,
        )
        _swap_assign_kernel[(bs, U)](
            *batch,
            loc_to_slot,
            slot_loc,
            lru,
            self._unit_base_buf,
            *plan_rows,
            self._entry_slots,
            self._victims,
            self._new_lru,
            self._sink_req,
            K=self.top_k,
            W=self.recent_window,
            BLOCK_K=self.block_k,
            **shape,
        )

    def _alloc_scratch(self, rows: int) -> None:
        # Per-batch-row scratch of the kernels, shared by all layers: swaps of
        # one state must run on one stream. Old buffers stay alive because
        # captured CUDA graphs may still point at them.
        if self._scratch_rows:
            self._retired_scratch.append(self._scratch)
        dev, K, C = self.device, self.top_k, self.num_slots
        self._hit_flags = torch.zeros((rows, C), dtype=torch.int8, device=dev)
        self._victims = torch.zeros((rows, K), dtype=torch.int32, device=dev)
        self._scratch = [self._hit_flags, self._victims]
        if self.max_units > 1:
            # The split swap's hand-over between its kernels.
            self._entry_slots = torch.zeros((rows, K), dtype=torch.int32, device=dev)
            self._evictable_counts = torch.zeros(
                (rows, self.max_units), dtype=torch.int32, device=dev
            )
            self._new_lru = torch.zeros((rows, C), dtype=torch.int16, device=dev)
            self._scratch += [self._entry_slots, self._evictable_counts, self._new_lru]
        self._scratch_rows = rows

    def _out_buffers(self, bs: int, out: Optional[LayerSwapPlan]) -> LayerSwapPlan:
        if out is None:
            k, dev = self.top_k, self.device
            return LayerSwapPlan(
                torch.empty((bs, k), dtype=torch.int32, device=dev),
                torch.empty((bs, k), dtype=torch.int64, device=dev),
                torch.empty((bs, k), dtype=torch.int32, device=dev),
                torch.empty((bs,), dtype=torch.int32, device=dev),
            )
        assert out.page_table.dtype == torch.int32
        assert out.miss_src_loc.dtype == torch.int64
        assert out.miss_dst_row.dtype == torch.int32
        assert out.miss_count.dtype == torch.int32
        for t in out:
            assert t.shape[0] >= bs and t.stride(-1) == 1
        return LayerSwapPlan(*(t[:bs] for t in out))

    def _num_real_tensor(
        self, num_real_reqs: Optional[Union[torch.Tensor, int]], bs: int
    ) -> torch.Tensor:
        if isinstance(num_real_reqs, torch.Tensor):
            return num_real_reqs.reshape(-1)[:1]
        n = bs if num_real_reqs is None else int(num_real_reqs)
        return torch.full((1,), n, dtype=torch.int32, device=self.device)

    # -------------------------------------------------------- reference path

    def prepare_layer_swap(
        self,
        layer: int,
        topk_pos: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        req_to_token: torch.Tensor,
        num_real_reqs: Optional[Union[torch.Tensor, int]] = None,
    ) -> LayerSwapWork:
        """Classify the top-k entries, pick victims and update residency."""
        bs = topk_pos.shape[0]
        W = self.recent_window
        num_real = self._num_real_tensor(num_real_reqs, bs)
        real = torch.arange(bs, device=self.device) < num_real
        req_in = req_pool_indices.long()
        req = torch.where(real, req_in, self._sink_req)
        base = self._region_base_buf[req].long()
        n = seq_lens.long()[:, None]
        pos = topk_pos.long()
        valid = real[:, None] & (pos >= 0) & (pos < n)
        in_window = valid & (pos >= n - W)
        lookup = valid & ~in_window
        tok_req = torch.where(real, req_in, 0)[:, None]
        loc = req_to_token[tok_req, torch.where(lookup, pos, 0)].long()
        loc = torch.where(lookup, loc, -1)
        return self._assign_slots(layer, req, base, lookup, loc, real, pos, in_window)

    def build_gpu_page_table(
        self, work: LayerSwapWork, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """GPU rows of the top-k entries, in top-k order (-1 for padding)."""
        base = work.base[:, None]
        window_row = base + self.buffer_size + work.pos.remainder(self.recent_window)
        rows = torch.where(work.in_window, window_row, work.row).to(torch.int32)
        if out is None:
            return rows
        out[: rows.shape[0]].copy_(rows)
        return out[: rows.shape[0]]

    def post_process_layer_swap(
        self,
        work: LayerSwapWork,
        page_table: torch.Tensor,
        out: Optional[LayerSwapPlan] = None,
        counters: Optional[torch.Tensor] = None,
    ) -> LayerSwapPlan:
        """Compact the misses into the copy list and apply the recency rule."""
        bs, k = work.miss.shape
        sink = torch.where(work.miss, work.miss_rank, k)
        src = torch.zeros((bs, k + 1), dtype=torch.int64, device=self.device)
        src.scatter_(1, sink, work.loc)
        dst = torch.zeros((bs, k + 1), dtype=torch.int64, device=self.device)
        dst.scatter_(1, sink, work.row)
        count = work.num_misses.to(torch.int32)
        self._reorder_lru(work)
        stats = torch.stack([work.hit.sum(), work.in_window.sum(), work.miss.sum()]).to(
            torch.int64
        )
        if counters is None:
            counters = self.counters[work.layer]
        counters += stats
        plan = LayerSwapPlan(page_table, src[:, :k], dst[:, :k].to(torch.int32), count)
        if out is None:
            return plan
        result = self._out_buffers(bs, out)
        for dst_t, src_t in zip(result, plan):
            if dst_t.data_ptr() != src_t.data_ptr():
                dst_t.copy_(src_t)
        return result

    def _assign_slots(
        self,
        layer: int,
        req: torch.Tensor,
        base: torch.Tensor,
        lookup: torch.Tensor,
        loc: torch.Tensor,
        real: Optional[torch.Tensor] = None,
        pos: Optional[torch.Tensor] = None,
        in_window: Optional[torch.Tensor] = None,
    ) -> LayerSwapWork:
        """Hits, misses and victims of looked-up locs; updates residency."""
        bs, k = loc.shape
        C, N = self.num_slots, self.num_locs
        l2s = self._loc_to_slot_buf[layer]
        slot_loc = self._slot_loc_buf[layer]
        # The sink entries of loc_to_slot may hold garbage: mask after the gather.
        cur = l2s[torch.where(lookup, loc, N)].long()
        hit = lookup & (cur >= 0)
        miss = lookup & (cur < 0)
        hit_flags = torch.zeros((bs, C + 1), dtype=torch.bool, device=self.device)
        hit_flags.scatter_(1, torch.where(hit, cur, C), True)
        order = self._lru_buf[layer][req].long()
        # Slots beyond the request's units are never victims.
        in_capacity = order < self._capacity_buf[req].long()[:, None]
        evictable = ~hit_flags.gather(1, order) & in_capacity
        ev = evictable.long()
        evict_rank = ev.cumsum(1) - ev
        mi = miss.long()
        miss_rank = mi.cumsum(1) - mi
        num_misses = mi.sum(1)
        # The j-th miss (top-k order) takes the j-th evictable slot (LRU first).
        taken = evictable & (evict_rank < num_misses[:, None])
        victim_by_rank = torch.zeros((bs, k + 1), dtype=torch.int64, device=self.device)
        victim_by_rank.scatter_(1, torch.where(taken, evict_rank, k), order)
        victim = victim_by_rank.gather(1, torch.where(miss, miss_rank, k))
        slot = torch.where(hit, cur, torch.where(miss, victim, -1))
        C0 = self.buffer_size
        unit = torch.where(slot >= 0, slot // C0, 0)
        unit_base = self._unit_base_buf[req].long().gather(1, unit)
        row = torch.where(slot >= 0, unit_base + slot % C0, -1)

        # Residency: victims' old locs leave, the missed locs enter.
        req2 = torch.where(miss, req[:, None], self._sink_req)
        vslot = torch.where(miss, victim, 0)
        old = torch.where(miss, slot_loc[req2, vslot].long(), -1)
        l2s.index_put_((torch.where(old >= 0, old, N),), l2s.new_full((), -1))
        l2s.index_put_((torch.where(miss, loc, N),), slot.to(l2s.dtype))
        slot_loc.index_put_((req2, vslot), loc.to(slot_loc.dtype))

        return LayerSwapWork(
            layer=layer,
            real=torch.ones_like(req, dtype=torch.bool) if real is None else real,
            req=req,
            base=base,
            pos=loc if pos is None else pos,
            in_window=torch.zeros_like(lookup) if in_window is None else in_window,
            hit=hit,
            miss=miss,
            loc=loc,
            slot=slot,
            row=row,
            miss_rank=miss_rank,
            num_misses=num_misses,
            num_hits=hit.long().sum(1),
            order=order,
            order_evictable=evictable,
            evict_rank=evict_rank,
        )

    def _reorder_lru(self, work: LayerSwapWork) -> None:
        # New order: [untaken evictables] + [victims] + [hits], each in old order
        # (victims in old order == misses in top-k order).
        m = work.num_misses[:, None]
        # Hits and the slots beyond the capacity keep their order at the end.
        num_evictable = work.order_evictable.long().sum(1, keepdim=True)
        ev_rank = work.evict_rank
        hit_rank = self._arange_c[None, :] - ev_rank
        new_pos = torch.where(
            work.order_evictable,
            torch.where(ev_rank >= m, ev_rank - m, num_evictable - m + ev_rank),
            num_evictable + hit_rank,
        )
        new_order = torch.empty_like(work.order).scatter_(1, new_pos, work.order)
        # Padding rows target the sink row; their new order equals the old one.
        self._lru_buf[work.layer].index_put_(
            (work.req,), new_order.to(self._lru_buf.dtype)
        )


def _is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _swap_kernel_is_interpreted() -> bool:
    # triton.jit picks the interpreter from TRITON_INTERPRET at decoration time.
    return _HAS_TRITON and not isinstance(_swap_layer_kernel, triton.JITFunction)


# Fused swap kernel: one program per batch row (grid (bs,)), three phases.
#   1. classify the K top-k entries (padding / window / hit via a loc_to_slot
#      gather / miss); exclusive cumsum gives each miss its rank; hit slots are
#      flagged in per-row scratch.
#   2. walk lru_order (C entries): gather the hit flags, cumsum ranks the
#      evictable slots; the first num_misses of them are the victims (their old
#      locs leave loc_to_slot) and are written to scratch by rank; lru_order is
#      permuted in place to [untaken evictables, victims, hits].
#   3. each miss gathers its victim by rank, updates loc_to_slot / slot_loc and
#      the page table; the copy list is compacted by miss rank.
# Scatter -> gather between phases (by slot, by rank) crosses threads, so it
# goes through global scratch with tl.debug_barrier() (bar.sync orders the
# CTA's global memory accesses). Whole-row blocks (next pow2 of K and C) keep
# the scans in registers: C=4096, K=2048 at 16 warps is ~116 registers, no
# spills (ptxas, sm_90).
if _HAS_TRITON:

    # Steps shared by the fused swap kernel and the split one.
    @triton.jit
    def _request_row(req_pool_ptr, b, sink_req):
        # The batch row's request pool index, clamped into the state (padding
        # rows may hold stale indices).
        r = tl.load(req_pool_ptr + b).to(tl.int64)
        return tl.minimum(tl.maximum(r, 0), sink_req)

    @triton.jit
    def _add_counters(counters_ptr, num_hits, in_window, num_misses):
        # The layer's (LRU hits, window hits, misses) counters.
        tl.atomic_add(counters_ptr + 0, num_hits.to(tl.int64))
        tl.atomic_add(
            counters_ptr + 1, tl.sum(in_window.to(tl.int32), axis=0).to(tl.int64)
        )
        tl.atomic_add(counters_ptr + 2, num_misses.to(tl.int64))

    @triton.jit
    def _classify_topk(
        pos, n, mask_k, r, req_to_token_ptr, req_to_token_stride, W: tl.constexpr
    ):
        # Top-k entries in the recent window, to look up (with their token
        # loc), or neither (padding / beyond the sequence).
        valid = mask_k & (pos >= 0) & (pos < n)
        in_window = valid & (pos >= n - W)
        lookup = valid & (pos < n - W)
        loc = tl.load(
            req_to_token_ptr + r * req_to_token_stride + pos, mask=lookup, other=0
        )
        return in_window, lookup, loc

    @triton.jit
    def _lru_new_positions(evictable, ev_rank, p, num_misses, num_evictable):
        # The recency rule: [untaken evictables, victims, hits and slots beyond
        # the capacity], each in its old order; p is the old position.
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
        ]
    )
    def _swap_layer_kernel(
        topk_ptr,
        topk_stride,
        req_pool_ptr,
        seq_lens_ptr,
        req_to_token_ptr,
        req_to_token_stride,
        num_real_ptr,
        loc_to_slot_ptr,  # (N + 1,) int16, this layer
        slot_loc_ptr,  # (max_reqs + 1, C) int32, this layer
        lru_ptr,  # (max_reqs + 1, C) int16, this layer
        unit_base_ptr,  # (max_reqs + 1, U) int32, unit 0 = the region
        capacity_ptr,  # (max_reqs + 1,) int32
        counters_ptr,  # (3,) int64, this layer
        page_table_ptr,
        page_table_stride,
        miss_src_ptr,
        miss_src_stride,
        miss_dst_ptr,
        miss_dst_stride,
        miss_count_ptr,
        hit_flags_ptr,  # (rows, C) int8 scratch
        victims_ptr,  # (rows, K) int32 scratch
        sink_req,  # max_reqs: the last row of the per-request tensors
        K: tl.constexpr,
        C: tl.constexpr,  # LRU slots of all units (U x C0)
        C0: tl.constexpr,  # LRU slots of one unit
        U: tl.constexpr,
        W: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # One program per batch row; rows touch disjoint state (distinct
        # requests own distinct locs and slots), so programs never race.
        b = tl.program_id(0)
        offs_k = tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        offs_c = tl.arange(0, BLOCK_C)
        mask_c = offs_c < C
        num_real = tl.load(num_real_ptr)
        # Loads that are in bounds for padding rows too (stale but valid pool
        # index, clamped anyway) go before the branch: saves a round trip.
        r = _request_row(req_pool_ptr, b, sink_req)
        n = tl.load(seq_lens_ptr + b).to(tl.int32)
        base = tl.load(unit_base_ptr + r * U)
        capacity = tl.load(capacity_ptr + r)
        pos = tl.load(topk_ptr + b * topk_stride + offs_k, mask=mask_k, other=-1)
        pos = pos.to(tl.int32)
        order = tl.load(lru_ptr + r * C + offs_c, mask=mask_c, other=0).to(tl.int32)
        old_loc = tl.load(slot_loc_ptr + r * C + order, mask=mask_c, other=-1)

        pt_row = page_table_ptr + b * page_table_stride
        if b >= num_real:
            tl.store(pt_row + offs_k, tl.full([BLOCK_K], -1, tl.int32), mask=mask_k)
            tl.store(miss_count_ptr + b, 0)
            return

        flags_row = hit_flags_ptr + b.to(tl.int64) * C
        victims_row = victims_ptr + b.to(tl.int64) * K
        tl.store(flags_row + offs_c, tl.zeros([BLOCK_C], tl.int8), mask=mask_c)

        # Phase 1: classify entries (padding / window / hit / miss).
        in_window, lookup, loc = _classify_topk(
            pos, n, mask_k, r, req_to_token_ptr, req_to_token_stride, W
        )
        cur = tl.load(loc_to_slot_ptr + loc, mask=lookup, other=-1).to(tl.int32)
        hit = lookup & (cur >= 0)
        miss = lookup & (cur < 0)
        miss_i = miss.to(tl.int32)
        miss_rank = tl.cumsum(miss_i, axis=0) - miss_i
        num_misses = tl.sum(miss_i, axis=0)
        num_hits = tl.sum(hit.to(tl.int32), axis=0)
        # Scatter hit flags by slot: the recency pass needs them by lru position,
        # a different thread mapping, so they go through global scratch. The
        # barriers order the zeroing, this scatter and the gather below.
        tl.debug_barrier()
        tl.store(flags_row + cur, tl.full([BLOCK_K], 1, tl.int8), mask=hit)
        tl.debug_barrier()

        # Phase 2: walk lru_order, rank evictable (not hit) slots, reorder.
        # Slots beyond the request's units are never victims; they keep their
        # order at the end with the hits.
        evictable = mask_c & (tl.load(flags_row + order, mask=mask_c, other=1) == 0)
        evictable = evictable & (order < capacity)
        ev_i = evictable.to(tl.int32)
        ev_rank = tl.cumsum(ev_i, axis=0) - ev_i
        new_pos, taken = _lru_new_positions(
            evictable, ev_rank, offs_c, num_misses, tl.sum(ev_i, axis=0)
        )
        # Victims' old locs leave the map now (phase 1 has read it already).
        tl.store(
            loc_to_slot_ptr + old_loc,
            tl.full([BLOCK_C], -1, tl.int16),
            mask=taken & (old_loc >= 0),
        )
        # Victim by rank, gathered by miss rank in phase 3 (another scatter ->
        # gather across threads through scratch).
        tl.store(victims_row + ev_rank, order, mask=taken)
        # Every thread has read lru_order (the scans above synchronize, the
        # barrier makes it explicit) before the in-place permutation.
        tl.debug_barrier()
        tl.store(lru_ptr + r * C + new_pos, order.to(tl.int16), mask=mask_c)

        # Phase 3: misses take their victims; page table in top-k order.
        # (Inline: as a shared helper it costs this kernel 16 registers and a
        # spill, ptxas sm_90.)
        victim = tl.load(victims_row + miss_rank, mask=miss, other=0)
        tl.store(loc_to_slot_ptr + loc, victim.to(tl.int16), mask=miss)
        tl.store(slot_loc_ptr + r * C + victim, loc, mask=miss)
        slot = tl.where(hit, cur, victim)
        if U == 1:
            slot_row = base + slot
        else:
            unit_base = tl.load(
                unit_base_ptr + r * U + slot // C0, mask=lookup, other=0
            )
            slot_row = unit_base + slot % C0
        rows = tl.where(in_window, base + C0 + pos % W, tl.where(lookup, slot_row, -1))
        tl.store(pt_row + offs_k, rows, mask=mask_k)
        tl.store(
            miss_src_ptr + b * miss_src_stride + miss_rank, loc.to(tl.int64), mask=miss
        )
        tl.store(miss_dst_ptr + b * miss_dst_stride + miss_rank, slot_row, mask=miss)
        tl.store(miss_count_ptr + b, num_misses)
        _add_counters(counters_ptr, num_hits, in_window, num_misses)

    # Split swap for U > 1 units (C = U x C0 slots): the fused kernel walks
    # all C slots in one program, which costs U times the one-unit swap. Here
    # the walk is spread over U programs per row, one per C0-position chunk of
    # lru_order; the cross-chunk rank prefix goes through per-row counts, so
    # the row's phases become kernels (same semantics, same results):
    #   _swap_classify_kernel (bs,): phase 1; hit flags and each entry's slot
    #     (-1 if none) to scratch, the row's miss count to miss_count.
    #   _swap_count_kernel (bs, U): evictable slots per chunk.
    #   _swap_rank_kernel (bs, U): phase 2 with the chunk's rank offset; the
    #     permuted order goes to scratch (other chunks still read theirs).
    #   _swap_assign_kernel (bs, U): chunk u copies the new order back; chunk 0
    #     does phase 3.
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
    def _swap_classify_kernel(
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
        hit_flags_ptr,  # (rows, C) int8 scratch
        cur_ptr,  # (rows, K) int32 scratch: slot of each entry, -1 if none
        sink_req,
        K: tl.constexpr,
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        W: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_C0: tl.constexpr,
    ):
        b = tl.program_id(0)
        offs_k = tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        if b >= tl.load(num_real_ptr):
            pt_row = page_table_ptr + b * page_table_stride
            tl.store(pt_row + offs_k, tl.full([BLOCK_K], -1, tl.int32), mask=mask_k)
            tl.store(miss_count_ptr + b, 0)
            return
        r = _request_row(req_pool_ptr, b, sink_req)
        n = tl.load(seq_lens_ptr + b).to(tl.int32)
        pos = tl.load(topk_ptr + b * topk_stride + offs_k, mask=mask_k, other=-1)
        pos = pos.to(tl.int32)
        flags_row = hit_flags_ptr + b.to(tl.int64) * C
        offs_c0 = tl.arange(0, BLOCK_C0)
        for u in tl.static_range(U):
            tl.store(
                flags_row + u * C0 + offs_c0,
                tl.zeros([BLOCK_C0], tl.int8),
                mask=offs_c0 < C0,
            )
        in_window, lookup, loc = _classify_topk(
            pos, n, mask_k, r, req_to_token_ptr, req_to_token_stride, W
        )
        cur = tl.load(loc_to_slot_ptr + loc, mask=lookup, other=-1).to(tl.int32)
        cur = tl.where(lookup, cur, -1)
        hit = cur >= 0
        num_misses = tl.sum((lookup & (cur < 0)).to(tl.int32), axis=0)
        tl.debug_barrier()
        tl.store(flags_row + cur, tl.full([BLOCK_K], 1, tl.int8), mask=hit)
        tl.store(cur_ptr + b.to(tl.int64) * K + offs_k, cur, mask=mask_k)
        tl.store(miss_count_ptr + b, num_misses)
        _add_counters(
            counters_ptr, tl.sum(hit.to(tl.int32), axis=0), in_window, num_misses
        )

    @triton.jit
    def _chunk_evictable(
        b,
        r,
        lru_ptr,
        capacity_ptr,
        hit_flags_ptr,
        offs,
        mask,
        C: tl.constexpr,
    ):
        # lru_order entries of one chunk and which of them are evictable: owned
        # (below the capacity) and not hit this step.
        order = tl.load(lru_ptr + r * C + offs, mask=mask, other=0).to(tl.int32)
        hit = tl.load(hit_flags_ptr + b.to(tl.int64) * C + order, mask=mask, other=1)
        evictable = mask & (hit == 0) & (order < tl.load(capacity_ptr + r))
        return order, evictable

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
        capacity_ptr,
        hit_flags_ptr,
        ev_count_ptr,  # (rows, U) int32 scratch
        sink_req,
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        BLOCK_C0: tl.constexpr,
    ):
        b = tl.program_id(0)
        u = tl.program_id(1)
        if b >= tl.load(num_real_ptr):
            return
        r = _request_row(req_pool_ptr, b, sink_req)
        offs_c0 = tl.arange(0, BLOCK_C0)
        _, evictable = _chunk_evictable(
            b,
            r,
            lru_ptr,
            capacity_ptr,
            hit_flags_ptr,
            u * C0 + offs_c0,
            offs_c0 < C0,
            C,
        )
        tl.store(ev_count_ptr + b * U + u, tl.sum(evictable.to(tl.int32), axis=0))

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
        capacity_ptr,
        miss_count_ptr,
        hit_flags_ptr,
        ev_count_ptr,
        victims_ptr,  # (rows, K) int32 scratch
        new_lru_ptr,  # (rows, C) int16 scratch
        sink_req,
        K: tl.constexpr,
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        BLOCK_U: tl.constexpr,
        BLOCK_C0: tl.constexpr,
    ):
        b = tl.program_id(0)
        u = tl.program_id(1)
        if b >= tl.load(num_real_ptr):
            return
        r = _request_row(req_pool_ptr, b, sink_req)
        offs_c0 = tl.arange(0, BLOCK_C0)
        mask = offs_c0 < C0
        p = u * C0 + offs_c0  # positions of this chunk in lru_order
        order, evictable = _chunk_evictable(
            b, r, lru_ptr, capacity_ptr, hit_flags_ptr, p, mask, C
        )
        offs_u = tl.arange(0, BLOCK_U)
        counts = tl.load(ev_count_ptr + b * U + offs_u, mask=offs_u < U, other=0)
        num_evictable = tl.sum(counts, axis=0)
        before = tl.sum(tl.where(offs_u < u, counts, 0), axis=0)
        num_misses = tl.load(miss_count_ptr + b)
        ev_i = evictable.to(tl.int32)
        ev_rank = before + tl.cumsum(ev_i, axis=0) - ev_i
        new_pos, taken = _lru_new_positions(
            evictable, ev_rank, p, num_misses, num_evictable
        )
        old_loc = tl.load(slot_loc_ptr + r * C + order, mask=taken, other=-1)
        tl.store(
            loc_to_slot_ptr + old_loc,
            tl.full([BLOCK_C0], -1, tl.int16),
            mask=taken & (old_loc >= 0),
        )
        tl.store(victims_ptr + b.to(tl.int64) * K + ev_rank, order, mask=taken)
        tl.store(
            new_lru_ptr + b.to(tl.int64) * C + new_pos, order.to(tl.int16), mask=mask
        )

    @triton.jit(
        do_not_specialize_on_alignment=[
            "req_pool_ptr",
            "seq_lens_ptr",
            "num_real_ptr",
            "loc_to_slot_ptr",
            "unit_base_ptr",
        ]
    )
    def _swap_assign_kernel(
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
        page_table_ptr,
        page_table_stride,
        miss_src_ptr,
        miss_src_stride,
        miss_dst_ptr,
        miss_dst_stride,
        cur_ptr,
        victims_ptr,
        new_lru_ptr,
        sink_req,
        K: tl.constexpr,
        C: tl.constexpr,
        C0: tl.constexpr,
        U: tl.constexpr,
        W: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_C0: tl.constexpr,
    ):
        b = tl.program_id(0)
        u = tl.program_id(1)
        if b >= tl.load(num_real_ptr):
            return
        r = _request_row(req_pool_ptr, b, sink_req)
        offs_c0 = tl.arange(0, BLOCK_C0)
        mask = offs_c0 < C0
        p = u * C0 + offs_c0
        new_order = tl.load(new_lru_ptr + b.to(tl.int64) * C + p, mask=mask)
        tl.store(lru_ptr + r * C + p, new_order, mask=mask)
        if u == 0:
            offs_k = tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            n = tl.load(seq_lens_ptr + b).to(tl.int32)
            base = tl.load(unit_base_ptr + r * U)
            pos = tl.load(topk_ptr + b * topk_stride + offs_k, mask=mask_k, other=-1)
            pos = pos.to(tl.int32)
            in_window, lookup, loc = _classify_topk(
                pos, n, mask_k, r, req_to_token_ptr, req_to_token_stride, W
            )
            cur = tl.load(cur_ptr + b.to(tl.int64) * K + offs_k, mask=mask_k, other=-1)
            hit = lookup & (cur >= 0)
            miss = lookup & (cur < 0)
            miss_i = miss.to(tl.int32)
            miss_rank = tl.cumsum(miss_i, axis=0) - miss_i
            # Phase 3 as in the fused kernel (units: U > 1 here).
            victims_row = victims_ptr + b.to(tl.int64) * K
            victim = tl.load(victims_row + miss_rank, mask=miss, other=0)
            tl.store(loc_to_slot_ptr + loc, victim.to(tl.int16), mask=miss)
            tl.store(slot_loc_ptr + r * C + victim, loc, mask=miss)
            slot = tl.where(hit, cur, victim)
            unit_base = tl.load(
                unit_base_ptr + r * U + slot // C0, mask=lookup, other=0
            )
            slot_row = unit_base + slot % C0
            rows = tl.where(
                in_window, base + C0 + pos % W, tl.where(lookup, slot_row, -1)
            )
            tl.store(page_table_ptr + b * page_table_stride + offs_k, rows, mask=mask_k)
            tl.store(
                miss_src_ptr + b * miss_src_stride + miss_rank,
                loc.to(tl.int64),
                mask=miss,
            )
            tl.store(
                miss_dst_ptr + b * miss_dst_stride + miss_rank, slot_row, mask=miss
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
