"""Decode-side NSA KV offload: host pool + LRU residency + copies.

``SparseCacheController`` owns

* the pinned host pool (:class:`NSAKVOnlyTokenToKVPoolHost`): the MLA KV of
  every token, at host slot == token loc;
* the per-(layer, request) LRU residency (:class:`LRUCacheState`);
* the GPU regions: each request admitted for decode owns one contiguous region
  of ``R = C + W`` rows of the device ``kv_buffer`` (the same rows in every
  layer): ``C`` LRU slots and a ``W``-row ring of its newest tokens;
* a side stream and events for the copies that are off the critical path
  (backups to host, warming a newly admitted request).

With ``max_units = U > 1`` (the server's default: the units that hold the
model's context) free regions are also handed out as extra LRU units: a
request may hold up to ``U`` units (:meth:`rebalance`), and gives one back
when an admission finds no free region (the largest holder; its newest
unit's slots are dropped, an older unit's rows copied there first when the
region is an older one); rebalancing also moves units from the largest
holders to the smallest until they differ by at most one. Other sources of
idle rows can lend units too (:meth:`add_unit_source`: the coordinator adds
idle prefill staging rows) and take them back the same way when they need
them (:meth:`reclaim_units_of`). A request's window stays in its region.

Per layer of a decode step the attention backend calls :meth:`swap_one_layer`:
the LRU swap writes the page table (GPU rows in top-k order) and the miss list,
then one count-bounded kernel loads the misses host -> GPU. Both are fixed-shape
and sync-free, so they can be captured in a CUDA graph.

Synchronization rules (callers):

* :meth:`wait_backup` makes a stream wait (on the GPU) for every copy issued so
  far on the side stream; call it before a forward that may read rows warmed
  by :meth:`admit_request` or host rows written by a backup, and before reusing
  GPU staging rows that a :meth:`backup_prefilled_request` reads. Side-stream
  copies themselves wait for the work enqueued so far on the caller's stream.
* :meth:`release_request` frees a region and LRU state without a host sync:
  everything that reuses them is ordered after the request's copies on the GPU.

See ``docs/ENGINE.md`` for the swap semantics and address spaces.
"""

from __future__ import annotations

import functools
import heapq
import logging
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from sglang.srt.mem_cache.lru_cache_state import LayerSwapPlan, LRUCacheState
from sglang.srt.mem_cache.nsa_kv_offload_copy import (
    COUNTER_D2H_ROWS,
    COUNTER_H2D_ROWS,
    DEFAULT_ALL_LAYER_BLOCK_ROWS,
    DEFAULT_BLOCK_ROWS,
    DEFAULT_NUM_WARPS,
    NUM_COUNTERS,
    as_rows,
    copy_kernels_interpreted,
    copy_rows_all_layers,
    copy_rows_all_layers_reference,
    gather_rows,
    gather_rows_reference,
    layer_pointer_table,
)
from sglang.srt.mem_cache.nsa_kv_offload_units import (
    IDLE_LOC_UNIT_SOURCE,
    REGION_UNIT_SOURCE,
    NSAKVOffloadUnitSource,
    RegionUnitSource,
    units_for_context,
)
from sglang.srt.mem_cache.nsa_kv_only_host_pool import NSAKVOnlyTokenToKVPoolHost

logger = logging.getLogger(__name__)


class RegionAllocator:
    """Free list of fixed-size contiguous GPU row regions.

    Regions are ``region_rows`` rows each, starting at ``start_row``; the lowest
    free region is handed out first.
    """

    def __init__(self, start_row: int, region_rows: int, num_regions: int):
        if start_row < 0 or region_rows <= 0 or num_regions < 0:
            raise ValueError(
                f"bad regions: start_row={start_row} region_rows={region_rows} "
                f"num_regions={num_regions}"
            )
        self.start_row = start_row
        self.region_rows = region_rows
        self.num_regions = num_regions
        self.clear()

    def clear(self) -> None:
        self._free: List[int] = list(range(self.num_regions))
        heapq.heapify(self._free)
        self._used = set()

    @property
    def end_row(self) -> int:
        return self.start_row + self.num_regions * self.region_rows

    def available_size(self) -> int:
        """Number of free regions."""
        return len(self._free)

    def alloc_contiguous(self, num_rows: Optional[int] = None) -> Optional[int]:
        """First row of a free region of ``num_rows`` (<= ``region_rows``)
        contiguous rows, or ``None`` when every region is taken."""
        if num_rows is not None and num_rows > self.region_rows:
            raise ValueError(
                f"alloc_contiguous({num_rows}): regions have {self.region_rows} rows"
            )
        if not self._free:
            return None
        region = heapq.heappop(self._free)
        self._used.add(region)
        return self.start_row + region * self.region_rows

    def free(self, base_row: int) -> None:
        region, rem = divmod(base_row - self.start_row, self.region_rows)
        if rem != 0 or region not in self._used:
            raise ValueError(f"row {base_row} is not the base of an allocated region")
        self._used.remove(region)
        heapq.heappush(self._free, region)


class SparseCacheController:
    """Host KV pool, LRU residency, GPU regions and copies of the NSA KV offload.

    Args:
        device_kv_buffers: the device ``kv_buffer`` of every layer of this rank
            (e.g. ``NSATokenToKVPool.kv_buffer``): contiguous tensors viewable as
            ``(N_gpu, row_bytes)``.
        host_pool: host KV of every token loc; its ``row_bytes`` must match.
        max_num_reqs: size of the request pool (``req_pool_indices`` range).
        top_k: ``K``, the indexer's top-k width.
        buffer_size: ``C``, LRU slots per (layer, request); ``C >= K``.
        recent_window: ``W``, window rows per request; ``1 <= W < C``.
        region_start_row / num_regions: GPU rows
            ``[region_start_row, region_start_row + num_regions * (C + W))`` of
            every layer belong to the controller's regions.
        max_batch_size: largest decode batch (sizes the swap's scratch).
        use_triton: LRU swap kernel (default: on CUDA, or under
            ``TRITON_INTERPRET=1``); the copies use Triton on CUDA and under the
            interpreter, else a torch reference (CPU only).
        warm_tokens: default number of tokens (newest first, below the window)
            installed into the LRU slots at admission (clipped to ``C``).
        copy_block_rows / copy_num_warps / copy_word_bytes: tile of the miss copy.
        max_units: regions a request may hold (1: exactly one).
        host_writer: whether this rank writes host rows (backups, new tokens).
            False on the ranks of an attention-TP group but its first: they
            share one host pool, which only the first writes (the others hold
            the same KV on their GPUs and only read it).
        max_query_tokens: query tokens per request a swap may serve (MTP
            target verify: ``--speculative-num-draft-tokens``; 1: decode).
        direct_slots: a request whose positions below its first window fit
            one unit's slots is warmed whole, position ``p`` into slot ``p``,
            and swaps without the LRU walk while its context fits its slots
            (``LRUCacheState``; experimental).
        extra_units: units the other unit sources (:meth:`add_unit_source`)
            may lend at once. The LRU state is held per unit: one unit of it
            for every region and for each of these.
        direct_warm_positions: with direct slots, warm a request entering
            direct mode with at most this many positions below its first
            window (the newest; the older ones are missed into their own
            slots when read). None: all of them.
        slot_policy: the slots' replacement, "lru" or "clock"
            (``nsa_kv_offload_clock``, experimental).
    """

    def __init__(
        self,
        device_kv_buffers: Sequence[torch.Tensor],
        host_pool: NSAKVOnlyTokenToKVPoolHost,
        max_num_reqs: int,
        top_k: int,
        buffer_size: int,
        recent_window: int,
        region_start_row: int,
        num_regions: int,
        max_batch_size: Optional[int] = None,
        use_triton: Optional[bool] = None,
        warm_tokens: Optional[int] = None,
        copy_block_rows: int = DEFAULT_BLOCK_ROWS,
        copy_num_warps: int = DEFAULT_NUM_WARPS,
        copy_word_bytes: Optional[int] = None,
        copy_flat_programs: Optional[int] = None,
        max_units: int = 1,
        host_writer: bool = True,
        max_query_tokens: int = 1,
        direct_slots: bool = False,
        extra_units: int = 0,
        direct_warm_positions: Optional[int] = None,
        slot_policy: str = "lru",
    ):
        self.host_pool = host_pool
        self.host_writer = host_writer
        self.row_bytes = host_pool.row_bytes
        self.layer_num = host_pool.layer_num
        self.start_layer = host_pool.start_layer
        if len(device_kv_buffers) != self.layer_num:
            raise ValueError(
                f"{len(device_kv_buffers)} device KV buffers for a host pool of "
                f"{self.layer_num} layers"
            )
        self.device_kv_buffers = list(device_kv_buffers)
        self._device_rows = [as_rows(b, self.row_bytes) for b in device_kv_buffers]
        for rows in self._device_rows:
            if rows.shape[0] != self._device_rows[0].shape[0]:
                raise ValueError("device KV buffers differ in row count")
        self.num_device_rows = self._device_rows[0].shape[0]
        self.device = self._device_rows[0].device

        self.top_k = top_k
        self.buffer_size = buffer_size
        self.recent_window = recent_window
        self.region_rows = buffer_size + recent_window
        self.max_num_reqs = max_num_reqs
        self.regions = RegionAllocator(region_start_row, self.region_rows, num_regions)
        if self.regions.end_row > self.num_device_rows:
            raise ValueError(
                f"{num_regions} regions of {self.region_rows} rows from row "
                f"{region_start_row} exceed the {self.num_device_rows} device rows"
            )
        self.lru = LRUCacheState(
            num_layers=self.layer_num,
            max_num_reqs=max_num_reqs,
            num_locs=host_pool.num_rows,
            buffer_size=buffer_size,
            recent_window=recent_window,
            top_k=top_k,
            device=self.device,
            use_triton=use_triton,
            max_batch_size=max_batch_size,
            max_units=max_units,
            max_query_tokens=max_query_tokens,
            direct_slots=direct_slots,
            policy=slot_policy,
            # Every admitted request holds a region: the regions and what
            # the other sources lend are all the units that exist at once.
            num_units=max(1, num_regions + (extra_units if max_units > 1 else 0)),
        )
        self.max_units = max_units
        self.warm_tokens = top_k if warm_tokens is None else warm_tokens
        self.direct_warm_positions = direct_warm_positions

        self.use_triton_copy = self.device.type == "cuda" or copy_kernels_interpreted()
        # The miss copy, chosen once: the Triton kernel, or its torch reference
        # (CPU without the interpreter).
        self._gather_rows = (
            functools.partial(
                gather_rows,
                word_bytes=copy_word_bytes,
                block_rows=copy_block_rows,
                num_warps=copy_num_warps,
                flat_programs=copy_flat_programs,
            )
            if self.use_triton_copy
            else gather_rows_reference
        )
        if self.device.type == "cuda" and not host_pool.pin_memory:
            raise ValueError("the host pool must be pinned for GPU copies")
        self.copy_block_rows = copy_block_rows
        self.copy_num_warps = copy_num_warps
        self.copy_word_bytes = copy_word_bytes

        # Layer base pointers for the all-layer kernels, on the device.
        self.device_layer_ptrs = layer_pointer_table(
            self.device_kv_buffers, self.device, self.row_bytes
        )
        self.host_layer_ptrs = host_pool.get_layer_ptrs(self.device)
        self._host_rows = [host_pool.data_refs[i] for i in range(self.layer_num)]

        # Rows/bytes moved (see nsa_kv_offload_copy.COUNTER_*), on the device.
        self.counters = torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=self.device)
        # (LRU hits, window hits, loads) of cross-layer prefetches, per layer.
        self.prefetch_counters = torch.zeros(
            (self.layer_num, 3), dtype=torch.int64, device=self.device
        )

        if self.device.type == "cuda":
            self.side_stream = torch.cuda.Stream(device=self.device)
        else:
            self.side_stream = None
        self._last_side_event = None
        self._req_base: Dict[int, int] = {}
        # Extra units of each request beyond its region, oldest first:
        # (first row, name of its source).
        self._req_units: Dict[int, List[Tuple[int, str]]] = {}
        # Most units each request is lent (units_to_hold of its longest
        # context): a unit beyond them would hold nothing it reads.
        self._req_unit_cap: Dict[int, int] = {}
        # Units moved between requests to even them out, units taken back by
        # their lenders, and of those the ones whose rows a copy kept
        # (get_stats).
        self.units_moved = 0
        self.units_reclaimed = 0
        self.units_kept = 0
        # Admissions warmed and the bytes their warm-ups copied into GPU rows
        # (get_stats; counted on the host: the copy sizes are known there).
        self.warmed_requests = 0
        self.warmed_bytes = 0
        # Lenders of extra units by name, asked in this order.
        self._unit_sources: Dict[str, NSAKVOffloadUnitSource] = {
            REGION_UNIT_SOURCE: RegionUnitSource(self.regions)
        }

    # ------------------------------------------------------------------ helpers

    def _local_layer(self, layer_id: int) -> int:
        idx = layer_id - self.start_layer
        if not 0 <= idx < self.layer_num:
            raise IndexError(f"layer {layer_id} is not on this rank")
        return idx

    def _launch_side(self, fn, tensors: Sequence[torch.Tensor] = ()):
        """Run ``fn`` on the side stream after the work enqueued so far on the
        caller's stream; return its event."""
        if self.side_stream is None:
            fn()
            return None
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side_stream):
            fn()
            event = torch.cuda.Event()
            event.record(self.side_stream)
        for t in tensors:
            if t.is_cuda:
                t.record_stream(self.side_stream)
        self._last_side_event = event
        return event

    def _copy_all_layers(
        self,
        src_ptrs: torch.Tensor,
        dst_ptrs: torch.Tensor,
        src_layers,
        dst_layers,
        src_idx: torch.Tensor,
        dst_idx: torch.Tensor,
        count: Optional[torch.Tensor],
        counter_idx: Optional[int],
    ) -> None:
        counters = None if counter_idx is None else self.counters
        if self.use_triton_copy:
            copy_rows_all_layers(
                src_ptrs,
                dst_ptrs,
                src_idx,
                dst_idx,
                self.row_bytes,
                count=count,
                counters=counters,
                counter_idx=counter_idx or 0,
                word_bytes=self.copy_word_bytes,
                block_rows=DEFAULT_ALL_LAYER_BLOCK_ROWS,
            )
        else:
            copy_rows_all_layers_reference(
                src_layers,
                dst_layers,
                src_idx,
                dst_idx,
                self.row_bytes,
                count,
                counters=counters,
                counter_idx=counter_idx or 0,
            )

    def _d2h_all_layers(self, gpu_rows, locs, count) -> None:
        self._copy_all_layers(
            self.device_layer_ptrs,
            self.host_layer_ptrs,
            self._device_rows,
            self._host_rows,
            gpu_rows,
            locs,
            count,
            COUNTER_D2H_ROWS,
        )

    def _h2d_all_layers(self, locs, gpu_rows, count=None) -> None:
        self._copy_all_layers(
            self.host_layer_ptrs,
            self.device_layer_ptrs,
            self._host_rows,
            self._device_rows,
            locs,
            gpu_rows,
            count,
            COUNTER_H2D_ROWS,
        )

    def _d2d_all_layers(self, src_rows, dst_rows) -> None:
        self._copy_all_layers(
            self.device_layer_ptrs,
            self.device_layer_ptrs,
            self._device_rows,
            self._device_rows,
            src_rows,
            dst_rows,
            None,
            None,
        )

    def _as_device_index(self, t, dtype) -> torch.Tensor:
        if not torch.is_tensor(t):
            t = torch.tensor(t, dtype=dtype)
        t = t.reshape(-1) if t.dim() != 2 else t
        return t.to(device=self.device, dtype=dtype).contiguous()

    # ---------------------------------------------------------------- hot path

    def load_tokens_h2d_one_layer(self, layer_id: int, plan: LayerSwapPlan) -> None:
        """Copy one layer's misses ``host[loc] -> kv_buffer[layer][row]``.

        Reads only the first ``plan.miss_count[b]`` entries of each row, on the
        device; runs on the current stream (the attention needs the rows).
        """
        layer = self._local_layer(layer_id)
        self._gather_rows(
            self._host_rows[layer],
            self._device_rows[layer],
            plan.miss_src_loc,
            plan.miss_dst_row,
            plan.miss_count,
            self.row_bytes,
            counters=self.counters,
            counter_idx=COUNTER_H2D_ROWS,
        )

    def swap_one_layer(
        self,
        layer_id: int,
        topk_pos: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        req_to_token: torch.Tensor,
        num_real_reqs: Optional[Union[torch.Tensor, int]] = None,
        out: Optional[LayerSwapPlan] = None,
        num_query_tokens: int = 1,
        defer_lru_reorder: bool = False,
    ) -> torch.Tensor:
        """LRU swap of one layer + load of its misses; returns the page table.

        ``topk_pos (bs, K)`` are top-k positions (-1 = padding); the result is
        ``(bs, K)`` int32 GPU rows in top-k order (-1 = skip), ready for FlashMLA.
        ``out`` passes preallocated plan buffers (CUDA-graph capture). With
        ``num_query_tokens = q > 1`` (MTP target verify) ``topk_pos`` and the
        page table have ``q`` rows per request (``LRUCacheState.swap_layer``).
        ``defer_lru_reorder``: the recency update waits for
        :meth:`finish_lru_reorder` (the caller's to call before anything else
        touches the LRU state), so it can run after the miss copy.
        """
        swap_args = (topk_pos, req_pool_indices, seq_lens, req_to_token, num_real_reqs)
        plan = self._swap_and_load(
            layer_id,
            swap_args,
            out,
            counters=None,
            num_query_tokens=num_query_tokens,
            defer_reorder=defer_lru_reorder,
        )
        return plan.page_table

    def finish_lru_reorder(self) -> None:
        """Launch the deferred recency update of the last swap (current stream)."""
        self.lru.finish_reorder()

    def prefetch_one_layer(
        self, layer_id: int, *swap_args, out: Optional[LayerSwapPlan] = None
    ) -> None:
        """``swap_one_layer``'s arguments, with ``topk_pos`` another layer's
        top-k of this step: loads it into this layer's LRU slots ahead of its
        own swap, exactly as a swap would (same residency and recency rules);
        its hits and loads count apart, no page table is kept."""
        counters = self.prefetch_counters[self._local_layer(layer_id)]
        self._swap_and_load(layer_id, swap_args, out, counters=counters)

    def _swap_and_load(
        self,
        layer_id,
        swap_args,
        out,
        counters,
        num_query_tokens=1,
        defer_reorder=False,
    ) -> LayerSwapPlan:
        plan = self.lru.swap_layer(
            self._local_layer(layer_id),
            *swap_args,
            out=out,
            counters=counters,
            num_query_tokens=num_query_tokens,
            defer_reorder=defer_reorder,
        )
        self.load_tokens_h2d_one_layer(layer_id, plan)
        return plan

    # ------------------------------------------------------------------ backups

    def write_back_new_tokens(
        self,
        gpu_rows: torch.Tensor,
        locs: torch.Tensor,
        count: Optional[torch.Tensor] = None,
    ) -> None:
        """Copy one decode step's new-token rows of all layers to host slots,
        on the current stream in order with the forward that wrote them
        (CUDA-graph safe: no host work at replay).

        ``gpu_rows (n,)`` are the window rows the step wrote, ``locs (n,)`` their
        token locs (int64 device tensors); with ``count`` (1-element device
        tensor, e.g. the number of real requests) only the first ``count``
        entries are read. Call it before any of these requests is released
        (their locs must still be theirs when the copy runs). A rank that is
        not the host writer copies nothing."""
        if self.host_writer:
            self._d2h_all_layers(gpu_rows, locs, count)

    def backup_prefilled_request(
        self,
        gpu_rows: torch.Tensor,
        locs: torch.Tensor,
    ):
        """Copy every layer of a prefilled request's tokens from the GPU
        (staging) rows ``gpu_rows`` to host slots ``locs``, on the side stream
        after the work enqueued so far on the caller's stream.

        The staging rows must not be reused before :meth:`wait_backup` (or the
        returned event) says the copy is done. A rank that is not the host
        writer copies nothing (returns None).
        """
        if not self.host_writer:
            return None
        gpu_rows = self._as_device_index(gpu_rows, torch.int64)
        locs = self._as_device_index(locs, torch.int64)
        return self._launch_side(
            lambda: self._d2h_all_layers(gpu_rows, locs, None),
            [gpu_rows, locs],
        )

    def wait_backup(self, stream=None) -> None:
        """Make ``stream`` (default: current) wait on the GPU for every side-stream
        copy issued so far. No host sync."""
        if self._last_side_event is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self._last_side_event)

    def synchronize(self) -> None:
        """Block the host until every side-stream copy issued so far is done."""
        if self.side_stream is not None:
            self.side_stream.synchronize()

    # ---------------------------------------------------------------- lifecycle

    def num_free_regions(self) -> int:
        return self.regions.available_size()

    def admission_room(self) -> int:
        """Requests that can be admitted now: free regions plus the regions
        running requests hold as extra units (an admission takes them back)."""
        return self.regions.available_size() + self.units_lent_by(REGION_UNIT_SOURCE)

    def can_admit(self, num_reqs: int = 1) -> bool:
        """Whether ``num_reqs`` more requests get a GPU region now."""
        return self.admission_room() >= num_reqs

    def is_admitted(self, req_pool_idx: int) -> bool:
        return int(req_pool_idx) in self._req_base

    def region_base(self, req_pool_idx: int) -> Optional[int]:
        return self._req_base.get(int(req_pool_idx))

    def admit_request(
        self,
        req_pool_idx: int,
        prefix_locs: Optional[torch.Tensor] = None,
        warm_tokens: Optional[int] = None,
        prefix_rows: Optional[torch.Tensor] = None,
        max_seq_len: Optional[int] = None,
    ) -> Optional[int]:
        """Give a request a GPU region and admit it into the LRU state.

        ``prefix_locs``: token locs of positions ``0 .. n-1`` already in host
        memory (e.g. ``req_to_token[r, :n]`` after the prefill backup). When
        given, the window rows of positions ``[n + 1 - W, n)`` (the prompt tokens
        inside the first decode step's window) are loaded, and the newest
        ``warm_tokens`` positions below the window are installed into the LRU
        slots. The loads run on the side stream, after the backups issued
        before (see :meth:`wait_backup`). With ``prefix_rows`` (the GPU rows
        of the same positions, e.g. prefill staging rows) they are copied from
        those rows instead of host memory: a rank that shares its host pool
        reads no host row another rank may still be writing.
        ``max_seq_len``: the longest the request can grow (prompt + its
        ``max_new_tokens``); :meth:`rebalance` lends it no more units than
        hold that context whole (:meth:`units_to_hold`). None: up to
        ``max_units``.

        Returns the region's first row, or ``None`` when no region is free.
        """
        r = int(req_pool_idx)
        if r in self._req_base:
            raise ValueError(f"request {r} is already admitted")
        base = self.regions.alloc_contiguous(self.region_rows)
        if base is None and self._reclaim_unit():
            base = self.regions.alloc_contiguous(self.region_rows)
        if base is None:
            return None
        self._req_base[r] = base
        self._req_units[r] = []
        self._req_unit_cap[r] = (
            self.max_units if max_seq_len is None else self.units_to_hold(max_seq_len)
        )
        self.lru.admit_request(r, base)
        if prefix_locs is not None and prefix_locs.numel() > 0:
            self._warm_request(r, base, prefix_locs, warm_tokens, prefix_rows)
        return base

    def warm_admitted(
        self,
        req_pool_idx: int,
        prefix_locs: torch.Tensor,
        prefix_rows: Optional[torch.Tensor] = None,
    ) -> None:
        """Warm a request admitted without ``prefix_locs`` once its units are
        granted: the first step's window rows and the newest positions below
        it, into every slot it holds (one copy from host memory, where a PD
        request's KV arrived and a prefilled request's backup, issued before
        on the same side stream, lands; or from ``prefix_rows``, the GPU rows
        of the same positions, e.g. its prefill staging rows; these rows are
        its first steps' likely reads)."""
        r = int(req_pool_idx)
        # _warm_request caps this at the slots the request holds.
        most = self.max_units * self.buffer_size
        self._warm_request(r, self._req_base[r], prefix_locs, most, prefix_rows)

    def _warm_request(
        self,
        r: int,
        base: int,
        prefix_locs: torch.Tensor,
        warm_tokens,
        prefix_rows: Optional[torch.Tensor] = None,
    ) -> None:
        C, W = self.buffer_size, self.recent_window
        prefix_locs = prefix_locs.reshape(-1).to(self.device, torch.int64)
        # Where the copies read: host slots (= locs) or the given GPU rows.
        source = prefix_locs
        if prefix_rows is not None:
            source = prefix_rows.reshape(-1).to(self.device, torch.int64)
            if source.numel() != prefix_locs.numel():
                raise ValueError(
                    f"{source.numel()} prefix rows for {prefix_locs.numel()} locs"
                )
        n = prefix_locs.numel()
        # Every slot the request holds: one unit at admission, more when it is
        # warmed after its units are granted (warm_admitted).
        slots = C * self.num_units(r)
        # The first decode step has seq_len n + 1: its window is [n + 1 - W, n].
        win_start = max(0, n + 1 - W)
        pos = torch.arange(win_start, n, dtype=torch.int64, device=self.device)
        locs = [source[win_start:n]]
        rows = [base + C + pos % W]

        if warm_tokens is None:
            warm_tokens = self.warm_tokens
        num_warm = max(0, min(warm_tokens, slots, win_start))
        direct = self.lru.direct_slots and win_start <= slots
        if direct:
            # The positions below the window (maybe none; the newest only
            # with direct_warm_positions): position p in slot p, across the
            # units it holds (nothing is resident yet).
            num_warm = win_start
            if self.direct_warm_positions is not None:
                num_warm = min(num_warm, self.direct_warm_positions)
        if num_warm > 0 or direct:
            # Oldest first: the newest token ends up most recently used.
            warm_locs = prefix_locs[win_start - num_warm : win_start]
            layers = range(self.layer_num)
            if direct:
                # The slots it holds are known here: no read of the GPU's.
                warm_rows = self.lru.warm_direct(
                    layers, r, warm_locs, slots, first_position=win_start - num_warm
                )
            else:
                warm_rows = self.lru.warm_request(layers, r, warm_locs)
            warm_src = source[win_start - num_warm : win_start]
            locs.append(warm_src.unsqueeze(0).expand(self.layer_num, -1))
            rows.append(warm_rows.to(torch.int64))
            rows[0] = rows[0].unsqueeze(0).expand(self.layer_num, -1)
            locs[0] = locs[0].unsqueeze(0).expand(self.layer_num, -1)
            src = torch.cat(locs, dim=1).contiguous()
            dst = torch.cat(rows, dim=1).contiguous()
        else:
            src, dst = locs[0].contiguous(), rows[0].contiguous()
        if src.shape[-1] == 0:
            return
        # Every layer's rows of these positions (src is per layer or shared).
        self.warmed_requests += 1
        self.warmed_bytes += src.shape[-1] * self.layer_num * self.row_bytes
        copy = self._h2d_all_layers if prefix_rows is None else self._d2d_all_layers
        self._launch_side(lambda: copy(src, dst), [src, dst])
        # The first decode step reads these rows: order the caller's stream.
        if self.side_stream is not None:
            self.wait_backup()

    def release_request(self, req_pool_idx: int) -> None:
        """Free the request's region and drop its LRU state (its host slots
        belong to the token allocator).

        The host does not wait: whoever reuses the region, the LRU slots or the
        host slots is ordered after the request's copies on the GPU (later
        side-stream copies run in issue order, and forwards wait for the side
        stream). The caller's stream waits for the side stream before the LRU
        state is cleared, and the caller must already have made it wait for any
        forward that may still read the request (the coordinator does).
        """
        r = int(req_pool_idx)
        if r not in self._req_base:
            raise ValueError(f"request {r} is not admitted")
        self.wait_backup()
        self.lru.release_request(r)
        self.regions.free(self._req_base.pop(r))
        del self._req_unit_cap[r]
        for base, source in self._req_units.pop(r):
            self._unit_sources[source].give(base)

    # ------------------------------------------------------------ extra units

    def num_units(self, req_pool_idx: int) -> int:
        """LRU units the request holds (0 when not admitted)."""
        r = int(req_pool_idx)
        return 1 + len(self._req_units[r]) if r in self._req_base else 0

    def units_lent_by(self, source: str) -> int:
        """Extra units running requests hold from the source named ``source``
        (``REGION_UNIT_SOURCE``: the free decode regions)."""
        return sum(src == source for u in self._req_units.values() for _, src in u)

    def add_unit_source(self, name: str, source: NSAKVOffloadUnitSource) -> None:
        """Another lender of extra units, named ``name`` (see
        ``nsa_kv_offload_units``; ``buffer_size`` rows per unit), asked after
        the sources added before it (the free regions first)."""
        if name in self._unit_sources:
            raise ValueError(f"unit source {name!r} is already added")
        self._unit_sources[name] = source

    def units_to_hold(self, seq_len: int) -> int:
        """Units whose LRU slots hold every position of a ``seq_len`` context
        below its recent window (what direct slots need), within
        ``1 .. max_units``."""
        units = units_for_context(seq_len, self.buffer_size, self.recent_window)
        return min(self.max_units, units)

    def _wanting_units(self) -> List[Tuple[int, int]]:
        """(units held, pool index) of the requests below their unit cap."""
        return [
            (len(u) + 1, r)
            for r, u in self._req_units.items()
            if len(u) + 1 < self._req_unit_cap[r]
        ]

    def _grow_candidate(self) -> Optional[int]:
        """The admitted request with the fewest units below its cap
        (``max_units``, or fewer when its context needs fewer; lowest pool
        index first), if some source can lend a unit."""
        if (
            self.max_units == 1
            or not self.lru.free_units()
            or not any(s.available() for s in self._unit_sources.values())
        ):
            return None
        candidates = self._wanting_units()
        return min(candidates)[1] if candidates else None

    def _level_move(self) -> Optional[Tuple[int, int]]:
        """(donor, recipient): a request holding two or more extra units more
        than the poorest one below its unit cap, and that poorest one (else
        None): :meth:`rebalance` moves the donor's newest unit to it once no
        source lends any more.

        Admissions into a full pool take units from the largest holders only,
        and requests admitted while prefills hold the staging and the locs
        find the idle rows lent to earlier ones, so requests admitted last can
        be left with none while earlier ones keep several; misses grow fast as
        a request's rows shrink, so an even split misses least. A unit of any
        source moves: it passes from request to request, its lender is not
        asked (rank_speed/run_h100_default_model_8k_x64/: with region units
        only, 8 of 64 requests kept one unit beside 45 holding three)."""
        if self.max_units == 1 or len(self._req_units) < 2:
            return None
        # The poorest among the requests that can use another unit.
        wanting = self._wanting_units()
        if not wanting:
            return None
        held, recipient = min(wanting)
        donors = [(len(u), r) for r, u in self._req_units.items() if len(u) > held]
        return (max(donors)[1], recipient) if donors else None

    def wants_rebalance(self) -> bool:
        """Whether :meth:`rebalance` would hand out or move a unit (host only)."""
        return self._grow_candidate() is not None or self._level_move() is not None

    def rebalance(self) -> int:
        """Hand idle rows out as extra units, fewest units first, free regions
        before other sources; then even out units between requests
        (:meth:`_level_move`). The caller's stream must already wait for every
        forward that may still read the LRU state. Returns the units handed
        out (a moved unit counts once)."""
        granted = 0
        while True:
            while (r := self._grow_candidate()) is not None:
                for name, source in self._unit_sources.items():
                    base = source.take() if source.available() else None
                    if base is not None:
                        break
                else:
                    break
                self._add_unit(r, base, name)
                granted += 1
            move = self._level_move()
            if move is None:
                return granted
            self._move_last_unit(*move)
            self.units_moved += 1

    def _add_unit(self, r: int, base: int, source: str) -> None:
        """Give request ``r`` the unit at row ``base`` lent by ``source`` (its
        slots start empty)."""
        self._req_units[r].append((base, source))
        self.lru.grow_request(r, len(self._req_units[r]), base)

    def _drop_last_unit(self, r: int) -> Tuple[int, str]:
        """Take request ``r``'s newest extra unit from it (its resident rows
        there are dropped: missed again if read); returns (first row, source
        name)."""
        units = self._req_units[r]
        # Copies still in flight on the side stream may target its rows.
        self.wait_backup()
        self.lru.shrink_request(r, len(units))
        return units.pop()

    def _move_last_unit(self, donor: int, recipient: int) -> None:
        """Pass ``donor``'s newest extra unit to ``recipient`` (its rows start
        empty there: its LRU state is new)."""
        self._add_unit(recipient, *self._drop_last_unit(donor))

    def _reclaim_from(self, source: str) -> bool:
        """Give one unit of ``source`` back, from the request holding the most
        units (highest pool index first) among those holding one. The
        request's newest unit's slots are dropped (their resident locs:
        nothing is copied back, the host pool keeps every token); when the
        unit of ``source`` is an older one, its rows are first copied into
        the newest unit's rows (:meth:`_keep_unit_rows`), so that the request
        loses one unit's rows, not those of every unit lent after it. False
        when no request holds one."""
        donors = [
            (len(u), r)
            for r, u in self._req_units.items()
            if any(src == source for _, src in u)
        ]
        if not donors:
            return False
        _, r = max(donors)
        units = self._req_units[r]
        k = max(i for i, (_, src) in enumerate(units) if src == source)
        if k != len(units) - 1:
            self._keep_unit_rows(r, k)
        base, _ = self._drop_last_unit(r)
        self._unit_sources[source].give(base)
        self.units_reclaimed += 1
        return True

    def _keep_unit_rows(self, r: int, k: int) -> None:
        """Copy the rows of request ``r``'s extra unit ``k`` (``k``: index
        into its extra units) into those of its newest unit, which back unit
        ``k``'s slots from then on; the newest entry then names unit ``k``'s
        old rows and lender, given back next. One all-layer GPU copy of a
        unit's rows, on the side stream after the work enqueued so far (the
        caller's stream already waits for every forward that may read them;
        side-stream copies into either unit's rows were issued before it)."""
        units = self._req_units[r]
        (kept_base, kept_source), (last_base, last_source) = units[k], units[-1]
        rows = torch.arange(self.buffer_size, dtype=torch.int64, device=self.device)
        src, dst = rows + kept_base, rows + last_base
        self._launch_side(lambda: self._d2d_all_layers(src, dst), [src, dst])
        self.lru.rebase_unit(r, k + 1, last_base)
        units[k], units[-1] = (last_base, last_source), (kept_base, kept_source)
        self.units_kept += 1

    def _reclaim_unit(self) -> bool:
        """Free a region for an admission (see :meth:`_reclaim_from`)."""
        return self._reclaim_from(REGION_UNIT_SOURCE)

    def reclaim_units_of(self, source: str, enough) -> bool:
        """Take back units lent by ``source`` until ``enough()``; the caller's
        stream must already wait for every forward that may still read them.
        Returns ``enough()``."""
        while not enough() and self._reclaim_from(source):
            pass
        return enough()

    # ------------------------------------------------------------------- stats

    def reset_stats(self) -> None:
        self.units_moved = 0
        self.units_reclaimed = 0
        self.units_kept = 0
        self.warmed_requests = 0
        self.warmed_bytes = 0
        self.counters.zero_()
        self.prefetch_counters.zero_()
        self.lru.reset_counters()

    def get_stats(self) -> Dict[str, float]:
        """Counters since the last reset (reads device tensors: syncs; for logs)."""
        hits, window, misses = (int(x) for x in self.lru.counters.sum(0).tolist())
        h2d_rows, h2d_bytes, d2h_rows, d2h_bytes = (
            int(x) for x in self.counters.tolist()
        )
        lookups = hits + misses
        prefetched = int(self.prefetch_counters[:, 2].sum())
        held = [self.num_units(r) for r in self._req_units]
        return {
            "lru_hits": hits,
            "window_hits": window,
            "misses": misses,
            "prefetched": prefetched,  # rows loaded ahead (in h2d_* as well)
            "hit_rate": hits / lookups if lookups else 0.0,
            "h2d_rows": h2d_rows,
            "h2d_bytes": h2d_bytes,
            "d2h_rows": d2h_rows,
            "d2h_bytes": d2h_bytes,
            "regions_used": self.regions.num_regions - self.regions.available_size(),
            "regions_total": self.regions.num_regions,
            # Extra LRU units running requests hold: free regions and units
            # lent by the other sources (idle prefill staging).
            "extra_units": sum(len(u) for u in self._req_units.values()),
            # Of those, units lent by the other sources (idle prefill
            # staging), and by the indexer keys of free locs (the arena).
            "extra_units_lent": sum(
                self.units_lent_by(name)
                for name in self._unit_sources
                if name not in (REGION_UNIT_SOURCE, IDLE_LOC_UNIT_SOURCE)
            ),
            "idle_loc_units_lent": self.units_lent_by(IDLE_LOC_UNIT_SOURCE),
            # Units moved from the largest holders to the smallest.
            "units_moved": self.units_moved,
            # Units taken back for admissions, prefill staging and token locs
            # (their rows dropped, read again on a miss), and of those the
            # units whose rows a copy kept (a newer unit's rows dropped
            # instead).
            "units_reclaimed": self.units_reclaimed,
            "units_kept": self.units_kept,
            # Units held by the poorest and the richest running request now
            # (0 when none runs): an uneven split misses most.
            "fewest_units": min(held, default=0),
            "most_units": max(held, default=0),
            # Admissions warmed, and the bytes copied into their GPU rows
            # (from host memory, or from prefill staging rows on the GPU):
            # the admission's price, which the batch's next step waits for.
            "warmed_requests": self.warmed_requests,
            "warmed_bytes": self.warmed_bytes,
            # Requests swapping in direct mode now (slot = position: no LRU
            # walk); a request leaves it on the GPU when it outgrows its slots.
            "direct_requests": (
                int(self.lru.direct.sum()) if self.lru.direct_slots else 0
            ),
        }

    def idle_leaks(self) -> List[str]:
        """What the controller still holds although no request is left (the
        scheduler's idle check); empty when every region and unit is back."""
        leaks = []
        if self._req_base:
            held = sorted(self._req_base)
            leaks.append(f"{len(held)} request(s) still admitted (req pool {held[:8]})")
        free = self.regions.available_size()
        if free != self.regions.num_regions:
            leaks.append(f"decode regions free: {free} of {self.regions.num_regions}")
        for name in self._unit_sources:
            if self.units_lent_by(name):
                leaks.append(f"{self.units_lent_by(name)} unit(s) still lent by {name}")
        return leaks
