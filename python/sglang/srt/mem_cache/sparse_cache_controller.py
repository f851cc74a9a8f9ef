"""Decode-side NSA KV offload: host pool + LRU residency + GPU regions + copies.

``SparseCacheController`` owns the pinned host pool (host slot == token loc),
the LRU residency, the units every request holds and a side stream for the
copies off the critical path; :meth:`swap_one_layer` is sync-free (CUDA-graph
safe). Stream rules: docs/ENGINE.md, "Copies and lifecycle".
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
from sglang.srt.mem_cache.lru_cache_state import LayerSwapPlan, LRUCacheState
from sglang.srt.mem_cache.nsa_kv_offload_copy import (
    COUNTER_D2H_ROWS,
    COUNTER_H2D_ROWS,
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
    RegionAllocator,
    UnitLedger,
    units_for_context,
)


class SparseCacheController:
    """``device_kv_buffers``: each layer's contiguous GPU ``kv_buffer``.
    ``host_writer``: False on an attention-TP group's ranks but its first.
    ``extra_units``: units the other sources may lend at once."""

    def __init__(
        self,
        device_kv_buffers: Sequence[torch.Tensor],
        host_pool,
        max_num_reqs: int,
        top_k: int,
        buffer_size: int,
        recent_window: int,
        region_start_row: int,
        num_regions: int,
        max_batch_size: Optional[int] = None,
        use_triton: Optional[bool] = None,
        max_units: int = 1,
        host_writer: bool = True,
        max_query_tokens: int = 1,
        direct_slots: bool = False,
        extra_units: int = 0,
        warm_tokens: Optional[int] = None,
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
        self._device_rows = [as_rows(b, self.row_bytes) for b in device_kv_buffers]
        if len({rows.shape[0] for rows in self._device_rows}) != 1:
            raise ValueError("device KV buffers differ in row count")
        self.num_device_rows = self._device_rows[0].shape[0]
        self.device = self._device_rows[0].device
        cuda = self.device.type == "cuda"
        if cuda and not host_pool.pin_memory:
            raise ValueError("the host pool must be pinned for GPU copies")

        self.top_k = top_k
        # Positions below the window a plain admission warms (newest first).
        self.warm_tokens = top_k if warm_tokens is None else warm_tokens
        self.buffer_size = buffer_size
        self.recent_window = recent_window
        self.region_rows = buffer_size + recent_window
        self.max_units = max_units
        self.regions = RegionAllocator(region_start_row, self.region_rows, num_regions)
        if self.regions.end_row > self.num_device_rows:
            raise ValueError(
                f"{num_regions} regions of {self.region_rows} rows from row "
                f"{region_start_row} exceed the {self.num_device_rows} device rows"
            )
        self.units = UnitLedger(self.regions, max_units)
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
            # The regions and what the other sources lend: all units at once.
            num_units=max(1, num_regions + (extra_units if max_units > 1 else 0)),
        )

        self.use_triton_copy = cuda or copy_kernels_interpreted()
        self._gather_rows = (
            gather_rows if self.use_triton_copy else gather_rows_reference
        )
        self.device_layer_ptrs = layer_pointer_table(
            device_kv_buffers, self.device, self.row_bytes
        )
        self.host_layer_ptrs = host_pool.get_layer_ptrs(self.device)
        self._host_rows = [host_pool.data_refs[i] for i in range(self.layer_num)]
        # Rows and bytes moved (COUNTER_*), on the device.
        self.counters = torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=self.device)

        self.side_stream = torch.cuda.Stream(device=self.device) if cuda else None
        self._last_side_event = None
        # Host-side counters since the last read (get_stats).
        events = "units_moved units_reclaimed units_kept warmed_requests warmed_bytes"
        self._events = dict.fromkeys(events.split(), 0)

    def _local_layer(self, layer_id: int) -> int:
        idx = layer_id - self.start_layer
        if not 0 <= idx < self.layer_num:
            raise IndexError(f"layer {layer_id} is not on this rank")
        return idx

    def _launch_side(self, fn, tensors: Sequence[torch.Tensor] = ()) -> None:
        """Run ``fn`` on the side stream after the caller's stream (inline off CUDA)."""
        if self.side_stream is None:
            fn()
            return
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side_stream):
            fn()
            event = torch.cuda.Event()
            event.record(self.side_stream)
        for t in tensors:
            if t.is_cuda:
                t.record_stream(self.side_stream)
        self._last_side_event = event

    def _copy_all_layers(self, src, dst, src_idx, dst_idx, count, counter_idx):
        # src / dst: "device" or "host"; one launch over every layer.
        if self.use_triton_copy:
            layers = {"device": self.device_layer_ptrs, "host": self.host_layer_ptrs}
            copy = copy_rows_all_layers
        else:
            layers = {"device": self._device_rows, "host": self._host_rows}
            copy = copy_rows_all_layers_reference
        counters = None if counter_idx is None else self.counters
        kw = dict(count=count, counters=counters, counter_idx=counter_idx or 0)
        copy(layers[src], layers[dst], src_idx, dst_idx, self.row_bytes, **kw)

    def _d2h_all_layers(self, gpu_rows, locs, count=None) -> None:
        self._copy_all_layers("device", "host", gpu_rows, locs, count, COUNTER_D2H_ROWS)

    def _h2d_all_layers(self, locs, gpu_rows, count=None) -> None:
        self._copy_all_layers("host", "device", locs, gpu_rows, count, COUNTER_H2D_ROWS)

    def _d2d_all_layers(self, src_rows, dst_rows) -> None:
        self._copy_all_layers("device", "device", src_rows, dst_rows, None, None)

    def swap_one_layer(
        self,
        layer_id: int,
        topk_pos: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        req_to_token: torch.Tensor,
        num_real_reqs=None,
        out: Optional[LayerSwapPlan] = None,
        num_query_tokens: int = 1,
        defer_lru_reorder: bool = False,
    ) -> torch.Tensor:
        """One layer's LRU swap and miss copy on the current stream; returns the
        page table, ready for FlashMLA."""
        layer = self._local_layer(layer_id)
        args = (topk_pos, req_pool_indices, seq_lens, req_to_token, num_real_reqs)
        q, defer = num_query_tokens, defer_lru_reorder
        plan = self.lru.swap_layer(
            layer, *args, out=out, num_query_tokens=q, defer_reorder=defer
        )
        # Counted as COUNTER_H2D_ROWS (the copy's default).
        src, dst = self._host_rows[layer], self._device_rows[layer]
        misses = (plan.miss_src_loc, plan.miss_dst_row, plan.miss_count)
        self._gather_rows(src, dst, *misses, self.row_bytes, counters=self.counters)
        return plan.page_table

    def finish_lru_reorder(self) -> None:
        """Launch the deferred recency update of the last swap (current stream)."""
        self.lru.finish_reorder()

    def write_back_new_tokens(self, gpu_rows, locs, count=None) -> None:
        """Copy one step's new-token rows of all layers to host slots ``locs`` on
        the current stream (graph-safe; ``count``: real entries, on the device)."""
        if self.host_writer:
            self._d2h_all_layers(gpu_rows, locs, count)

    def backup_prefilled_request(self, gpu_rows, locs) -> None:
        """Copy a prefilled request's staging rows (all layers) to its host slots on
        the side stream (reuse them after :meth:`wait_backup`)."""
        if not self.host_writer:
            return
        gpu_rows = gpu_rows.reshape(-1).to(self.device, torch.int64).contiguous()
        locs = locs.reshape(-1).to(self.device, torch.int64).contiguous()
        self._launch_side(
            lambda: self._d2h_all_layers(gpu_rows, locs), [gpu_rows, locs]
        )

    def wait_backup(self, stream=None) -> None:
        """Make ``stream`` (default: current) wait for every side-stream copy so far."""
        if self._last_side_event is None:
            return
        stream = stream or torch.cuda.current_stream(self.device)
        stream.wait_event(self._last_side_event)

    def synchronize(self) -> None:
        """Block the host until every side-stream copy issued so far is done."""
        if self.side_stream is not None:
            self.side_stream.synchronize()

    def is_admitted(self, req_pool_idx: int) -> bool:
        return self.units.is_admitted(int(req_pool_idx))

    def region_base(self, req_pool_idx: int) -> Optional[int]:
        return self.units.base(int(req_pool_idx))

    def num_units(self, req_pool_idx: int) -> int:
        return self.units.num_units(int(req_pool_idx))

    def num_free_regions(self) -> int:
        return self.regions.available_size()

    def admission_room(self) -> int:
        return self.units.admission_room()

    def can_admit(self, num_reqs: int = 1) -> bool:
        return self.admission_room() >= num_reqs

    def units_to_hold(self, seq_len: int) -> int:
        """Units holding a ``seq_len`` context below its window (<= max_units)."""
        units = units_for_context(seq_len, self.buffer_size, self.recent_window)
        return min(self.max_units, units)

    def admit_request(
        self,
        req_pool_idx: int,
        prefix_locs: Optional[torch.Tensor] = None,
        prefix_rows: Optional[torch.Tensor] = None,
        max_seq_len: Optional[int] = None,
    ) -> Optional[int]:
        """Give a request a region (taking back a lent one if none is free) and LRU
        state, warmed from ``prefix_locs`` (or GPU rows ``prefix_rows``) if given;
        ``max_seq_len`` caps its units. Returns the region's first row, or None."""
        r = int(req_pool_idx)
        if self.units.is_admitted(r):
            raise ValueError(f"request {r} is already admitted")
        base = self.regions.alloc_contiguous()
        if base is None and self._reclaim_from(REGION_UNIT_SOURCE):
            base = self.regions.alloc_contiguous()
        if base is None:
            return None
        cap = self.max_units if max_seq_len is None else self.units_to_hold(max_seq_len)
        self.units.admit(r, base, cap)
        self.lru.admit_request(r, base)
        if prefix_locs is not None and prefix_locs.numel() > 0:
            self._warm_request(r, base, prefix_locs, self.warm_tokens, prefix_rows)
        return base

    def warm_admitted(self, req_pool_idx: int, prefix_locs, prefix_rows=None) -> None:
        """Warm a request admitted without ``prefix_locs``, into all its slots."""
        r = int(req_pool_idx)
        most = self.max_units * self.buffer_size
        self._warm_request(r, self.units.base(r), prefix_locs, most, prefix_rows)

    def _warm_request(self, r, base, prefix_locs, warm_tokens, prefix_rows) -> None:
        # One side-stream copy: the first step's window rows ([n + 1 - W, n))
        # and the newest positions below (direct: all, position p in slot p).
        C, W, L = self.buffer_size, self.recent_window, self.layer_num
        prefix_locs = prefix_locs.reshape(-1).to(self.device, torch.int64)
        source = prefix_locs  # host slots, or the same positions' GPU rows
        if prefix_rows is not None:
            source = prefix_rows.reshape(-1).to(self.device, torch.int64)
            if source.numel() != prefix_locs.numel():
                raise ValueError(
                    f"{source.numel()} prefix rows for {prefix_locs.numel()} locs"
                )
        n = prefix_locs.numel()
        slots = C * self.num_units(r)
        win_start = max(0, n + 1 - W)
        pos = torch.arange(win_start, n, dtype=torch.int64, device=self.device)
        src, dst = source[win_start:n], base + C + pos % W
        direct = self.lru.direct_slots and win_start <= slots
        num_warm = win_start if direct else max(0, min(warm_tokens, slots, win_start))
        if num_warm > 0 or direct:
            # Oldest first: the newest token ends up most recently used.
            warm = slice(win_start - num_warm, win_start)
            if direct:
                rows = self.lru.warm_direct(range(L), r, prefix_locs[warm], slots)
            else:
                rows = self.lru.warm_request(range(L), r, prefix_locs[warm])
            src = torch.cat([src, source[warm]]).expand(L, -1).contiguous()
            dst = torch.cat([dst.expand(L, -1), rows.to(torch.int64)], dim=1)
        if src.shape[-1] == 0:
            return
        self._events["warmed_requests"] += 1
        self._events["warmed_bytes"] += src.shape[-1] * L * self.row_bytes
        copy = self._h2d_all_layers if prefix_rows is None else self._d2d_all_layers
        self._launch_side(lambda: copy(src, dst), [src, dst])
        # The first decode step reads these rows.
        self.wait_backup()

    def release_request(self, req_pool_idx: int) -> None:
        """Free the request's region, units and LRU state without a host sync (the
        caller's stream already waits for the forwards that may read it)."""
        r = int(req_pool_idx)
        if not self.units.is_admitted(r):
            raise ValueError(f"request {r} is not admitted")
        self.wait_backup()
        self.lru.release_request(r)
        self.units.release(r)

    def units_lent_by(self, source: str) -> int:
        return self.units.lent_by(source)

    def add_unit_source(self, name: str, source) -> None:
        """Another lender of units, asked after those added before it."""
        self.units.add_source(name, source)

    def wants_rebalance(self) -> bool:
        """Whether :meth:`rebalance` would hand out or move a unit (host only)."""
        grow = self.lru.free_units() and self.units.grow_candidate() is not None
        return bool(grow) or self.units.level_move() is not None

    def rebalance(self) -> int:
        """Lend idle rows as units, fewest units first, then even units out (the
        caller's stream already waits for the forwards); returns units lent."""
        granted = 0
        while True:
            while self.lru.free_units():
                r = self.units.grow_candidate()
                unit = None if r is None else self.units.lend()
                if unit is None:
                    break
                self._add_unit(r, unit)
                granted += 1
            move = self.units.level_move()
            if move is None:
                return granted
            self._move_unit(*move)

    def _move_unit(self, donor: int, recipient: int) -> None:
        # The donor's newest unit passes to the recipient, its rows dropped.
        self._add_unit(recipient, self._drop_last_unit(donor))
        self._events["units_moved"] += 1

    def _add_unit(self, r: int, unit) -> None:
        # Its slots start empty (new LRU state).
        held = self.units.add(r, unit)
        self.lru.grow_request(r, held - 1, unit[0])

    def _drop_last_unit(self, r: int):
        # Its rows are dropped; side-stream copies may still target them.
        self.wait_backup()
        self.lru.shrink_request(r, len(self.units.units(r)))
        return self.units.pop_last(r)

    def _reclaim_from(self, source: str) -> bool:
        """Give one unit of ``source`` back (``UnitLedger.reclaim_choice``); one not
        the newest has its rows copied into the newest's, which goes back instead."""
        choice = self.units.reclaim_choice(source)
        if choice is None:
            return False
        r, k = choice
        units = self.units.units(r)
        if k != len(units) - 1:
            # Ordered after every side-stream copy into either unit.
            rows = torch.arange(self.buffer_size, dtype=torch.int64, device=self.device)
            src, dst = rows + units[k][0], rows + units[-1][0]
            self._launch_side(lambda: self._d2d_all_layers(src, dst), [src, dst])
            self.lru.rebase_unit(r, k + 1, units[-1][0])
            self.units.swap_with_last(r, k)
            self._events["units_kept"] += 1
        base, _ = self._drop_last_unit(r)
        self.units.sources[source].give(base)
        self._events["units_reclaimed"] += 1
        return True

    def reclaim_units_of(self, source: str, enough) -> bool:
        """Take units of ``source`` back until ``enough()``; returns ``enough()``."""
        while not enough() and self._reclaim_from(source):
            pass
        return enough()

    def reset_stats(self) -> None:
        self._events = dict.fromkeys(self._events, 0)
        self.counters.zero_()
        self.lru.reset_counters()

    def get_stats(self) -> Dict[str, int]:
        """Counters since :meth:`reset_stats` and the units held now (syncs)."""
        lookups = (int(x) for x in self.lru.counters.sum(0).tolist())
        stats = dict(zip(("lru_hits", "window_hits", "misses"), lookups))
        moved = (int(x) for x in self.counters.tolist())
        stats.update(zip(("h2d_rows", "h2d_bytes", "d2h_rows", "d2h_bytes"), moved))
        fewest, most = self.units.spread()
        skip = (REGION_UNIT_SOURCE, IDLE_LOC_UNIT_SOURCE)
        lent = sum(self.units_lent_by(n) for n in self.units.sources if n not in skip)
        stats.update(
            regions_used=self.regions.num_regions - self.regions.available_size(),
            regions_total=self.regions.num_regions,
            extra_units=sum(len(self.units.units(r)) for r in self.units.requests()),
            extra_units_lent=lent,
            idle_loc_units_lent=self.units_lent_by(IDLE_LOC_UNIT_SOURCE),
            fewest_units=fewest,
            most_units=most,
            direct_requests=int(self.lru.direct.sum()) if self.lru.direct_slots else 0,
            **self._events,
        )
        return stats

    def idle_leaks(self):
        """What the controller still holds although no request is left."""
        return self.units.idle_leaks()
