"""Per-(layer, request) LRU residency of the decode-side NSA KV offload.

Each admitted request owns a region of ``C + W`` GPU KV rows in every layer:
``C`` LRU slots (rows ``base + s``) and a ``W``-row window ring (rows ``base +
C + pos % W``). A swap turns one layer's top-k positions into a page table and
a host->GPU copy list (``docs/ENGINE.md``, "Per-layer swap semantics"). With
``max_units = U > 1`` slot ``s`` lives at ``unit_base[r, s // C] + s % C`` and
its LRU state in chunk ``unit_index[r, s // C]`` (``docs/ELASTIC_BUFFER.md``,
1e); ``max_query_tokens > 1`` serves MTP verify (``docs/MTP.md``);
``direct_slots``: slot = position while the context fits (``docs/ENGINE.md``).
Fixed-shape, sync-free (CUDA-graph capturable); backend ``TritonLRUSwap``
or the bit-exact torch ``ReferenceLRUSwap``. Callers guarantee unique top-k
positions (but padding), locs unique across live requests, release before
re-admission, one stream.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import torch
from sglang.srt.mem_cache.nsa_kv_offload_lru_kernels import (
    _HAS_TRITON,
    swap_kernel_is_interpreted,
)
from sglang.srt.mem_cache.nsa_kv_offload_lru_reference import (
    LayerSwapPlan,
    ReferenceLRUSwap,
    assign_slots,
    reorder_lru,
    slot_rows,
    state_index,
)
from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import TritonLRUSwap

__all__ = ["LayerSwapPlan", "LRUCacheState", "default_use_triton"]

IndexLike = Union[int, Sequence[int], torch.Tensor]


def default_use_triton(device: torch.device) -> bool:
    """Triton on CUDA; on CPU only under ``TRITON_INTERPRET=1`` (tests)."""
    if not _HAS_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and swap_kernel_is_interpreted()


def lru_slot_dtype(num_slots: int) -> torch.dtype:
    """dtype of a request's LRU slot ids (``loc_to_slot``, ``lru_order``):
    int16 while its ``units x buffer_size`` slots fit, int32 beyond."""
    return torch.int16 if num_slots <= torch.iinfo(torch.int16).max else torch.int32


class LRUCacheState:
    """GPU residency and recency of the LRU slots of every (layer, request).
    Buffers carry a "sink" entry (loc, request, unit chunk) for masked
    scatters; public attributes are views without it. ``num_units``: chunks
    of LRU state (default ``max_num_reqs x max_units``); admit and grow take
    one, release and shrink give it back."""

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
        max_query_tokens: int = 1,
        direct_slots: bool = False,
        num_units: Optional[int] = None,
    ):
        if max_query_tokens < 1:
            raise ValueError(f"max_query_tokens ({max_query_tokens}) must be >= 1")
        if buffer_size < max_query_tokens * top_k:
            raise ValueError(
                f"buffer_size ({buffer_size}) must be >= max_query_tokens "
                f"({max_query_tokens}) x top_k ({top_k})"
            )
        if not 1 <= recent_window < buffer_size:
            raise ValueError(
                f"recent_window ({recent_window}) must be in [1, buffer_size)"
            )
        # Swaps read the newest read_window ring positions (docs/MTP.md,
        # "Rollback"); a step's query tokens must be among them.
        read_window = recent_window - (max_query_tokens - 1)
        if read_window < max_query_tokens:
            raise ValueError(
                f"recent_window ({recent_window}) must be >= 2 x max_query_tokens "
                f"- 1 ({2 * max_query_tokens - 1})"
            )
        if max_units < 1:
            raise ValueError(f"max_units ({max_units}) must be >= 1")
        if direct_slots and max_query_tokens > 1:
            raise ValueError("direct_slots needs max_query_tokens = 1")
        if buffer_size * max_units > torch.iinfo(torch.int32).max:
            raise ValueError(
                "buffer_size x max_units must fit int32 (loc_to_slot, lru_order)"
            )
        if num_units is None:
            num_units = max_num_reqs * max_units
        if num_units < 1:
            raise ValueError(f"num_units ({num_units}) must be >= 1")
        if (num_units + 1) * buffer_size > torch.iinfo(torch.int32).max:
            raise ValueError("(num_units + 1) x buffer_size must fit int32")
        self.num_layers = num_layers
        self.max_num_reqs = max_num_reqs
        self.num_locs = num_locs
        self.buffer_size = buffer_size
        self.max_units = max_units
        self.num_units = num_units
        self.max_query_tokens = max_query_tokens
        self.direct_slots = direct_slots
        self.num_slots = buffer_size * max_units
        self.recent_window = recent_window
        self.read_window = read_window
        self.top_k = top_k
        self.region_size = buffer_size + recent_window
        self.device = torch.device(device)
        L, C0, R1, dev = num_layers, buffer_size, max_num_reqs + 1, self.device

        def full(shape, value, dtype):
            return torch.full(shape, value, dtype=dtype, device=dev)

        self._sink_req = max_num_reqs
        self._sink_unit = num_units
        self.slot_dtype = lru_slot_dtype(self.num_slots)
        self._loc_to_slot_buf = full((L, num_locs + 1), -1, self.slot_dtype)
        # Per unit chunk: slot_loc (-1: empty) and C positions of lru_order.
        self._slot_loc_buf = full((L, num_units + 1, C0), -1, torch.int32)
        self._lru_buf = full((L, num_units + 1, C0), -1, self.slot_dtype)
        # unit_index[r, u]: chunk of unit u of request r, else the sink chunk.
        self._unit_index_buf = full((R1, max_units), self._sink_unit, torch.int32)
        # Host side: free chunks (popped lowest first), each request's chunks.
        self._free_chunks: List[int] = list(range(num_units - 1, -1, -1))
        self._req_chunks: Dict[int, List[int]] = {}
        # unit_base[r, u]: first GPU row of unit u (-1: none); unit 0: region.
        self._unit_base_buf = full((R1, max_units), -1, torch.int32)
        self._unit_base_buf[self._sink_req] = 0
        self._region_base_buf = self._unit_base_buf[:, 0]
        self._capacity_buf = full((R1,), 0, torch.int32)
        # direct[r]: 1 while request r swaps in direct mode.
        self._direct_buf = full((R1,), 0, torch.int8)
        # loc_to_slot[l, loc]: LRU slot holding loc in layer l, -1 if not resident.
        self.loc_to_slot = self._loc_to_slot_buf[:, :num_locs]
        # region_base[r]: first GPU KV row of request r's region, -1 if none.
        self.region_base = self._region_base_buf[:max_num_reqs]
        self.unit_base = self._unit_base_buf[:max_num_reqs]
        self.unit_index = self._unit_index_buf[:max_num_reqs]
        # capacity[r]: LRU slots request r holds (its units x C), 0 if none.
        self.capacity = self._capacity_buf[:max_num_reqs]
        self.direct = self._direct_buf[:max_num_reqs]
        # counters[l] = (LRU hits, window hits, misses), accumulated on device.
        self.counters = full((L, 3), 0, torch.int64)

        self._arange_c = torch.arange(self.num_slots, dtype=torch.int64, device=dev)
        bufs = (self._loc_to_slot_buf, self._slot_loc_buf, self._lru_buf)
        self._layer_views = [
            tuple(t[layer] for t in (*bufs, self.counters)) for layer in range(L)
        ]
        if use_triton is None:
            use_triton = default_use_triton(self.device)
        self.swap_backend = (
            TritonLRUSwap(self, max_batch_size=max_batch_size, num_warps=num_warps)
            if use_triton
            else ReferenceLRUSwap()
        )

    def _per_request(self, buf: torch.Tensor) -> torch.Tensor:
        # (L, max_num_reqs, U x C) per-request entries, -1 beyond capacity.
        reqs = torch.arange(self.max_num_reqs, device=self.device)
        idx = self._arange_c.expand(self.max_num_reqs, -1)
        flat = buf.reshape(self.num_layers, -1)
        addr = state_index(self, reqs, idx).reshape(-1)
        out = flat[:, addr].reshape(self.num_layers, self.max_num_reqs, -1)
        held = idx < self.capacity.long()[:, None]
        return torch.where(held, out, torch.full_like(out, -1))

    @property
    def slot_loc(self) -> torch.Tensor:
        """``slot_loc[l, r, s]``: loc in slot ``s`` of request ``r``, -1 if
        empty or not held (a gathered copy)."""
        return self._per_request(self._slot_loc_buf)

    @property
    def lru_order(self) -> torch.Tensor:
        """``lru_order[l, r]``: request ``r``'s held slots, least recently
        used first, then -1 beyond its capacity (a gathered copy)."""
        return self._per_request(self._lru_buf)

    @property
    def unit_state_bytes(self) -> int:
        """GPU bytes of the per-unit state (``slot_loc``, ``lru_order``, sink
        chunk included)."""
        return self._slot_loc_buf.nbytes + self._lru_buf.nbytes

    def free_units(self) -> int:
        """Unit chunks not held by any request (host only)."""
        return len(self._free_chunks)

    def _take_chunk(self, what: str) -> int:
        if not self._free_chunks:
            raise RuntimeError(
                f"{what}: all {self.num_units} unit chunks of LRU state are held"
            )
        return self._free_chunks.pop()

    def _chunks(self, r: int) -> torch.Tensor:
        return torch.tensor(self._req_chunks[r], dtype=torch.int64, device=self.device)

    def _read_order(self, r: int) -> torch.Tensor:
        """(L, capacity) the held part of request ``r``'s order, int64."""
        return self._lru_buf[:, self._chunks(r)].reshape(self.num_layers, -1).long()

    def _write_order(self, r: int, order: torch.Tensor) -> None:
        """Request ``r``'s order, ``(L, capacity)`` or ``(capacity,)``."""
        chunks = self._chunks(r)
        order = order.to(self._lru_buf.dtype).expand(self.num_layers, -1)
        self._lru_buf[:, chunks] = order.reshape(self.num_layers, len(chunks), -1)

    @staticmethod
    def _host_indices(r: IndexLike) -> List[int]:
        if isinstance(r, torch.Tensor):
            return [int(x) for x in r.reshape(-1).tolist()]
        if isinstance(r, int):
            return [r]
        return [int(x) for x in r]

    def reset_counters(self) -> None:
        self.counters.zero_()

    def _as_index(self, r: IndexLike) -> torch.Tensor:
        if isinstance(r, torch.Tensor):
            return r.to(device=self.device, dtype=torch.int64).reshape(-1)
        return torch.tensor(r, dtype=torch.int64, device=self.device).reshape(-1)

    def admit_request(self, r: IndexLike, base: IndexLike) -> None:
        """Give request(s) ``r`` (not admitted) the region at GPU row
        ``base``: one unit, empty slots, ``lru_order = arange(C)``."""
        self.swap_backend.check_settled("admit_request")
        reqs, bases = self._host_indices(r), self._host_indices(base)
        if len(reqs) != len(bases):
            raise ValueError(f"{len(reqs)} requests for {len(bases)} bases")
        for req in reqs:
            if req in self._req_chunks:
                raise ValueError(f"admit_request: request {req} is admitted")
        if len(reqs) > len(self._free_chunks):
            raise RuntimeError(
                f"admit_request: {len(reqs)} requests for "
                f"{len(self._free_chunks)} free unit chunks of LRU state"
            )
        chunks = [self._free_chunks.pop() for _ in reqs]
        for req, chunk in zip(reqs, chunks):
            self._req_chunks[req] = [chunk]
        idx = torch.tensor(reqs, dtype=torch.int64, device=self.device)
        chunk_t = torch.tensor(chunks, dtype=torch.int64, device=self.device)
        self._unit_index_buf[idx] = self._sink_unit
        self._unit_index_buf[idx, 0] = chunk_t.to(torch.int32)
        self._unit_base_buf[idx] = -1
        self._region_base_buf[idx] = torch.tensor(
            bases, dtype=torch.int32, device=self.device
        )
        self._capacity_buf[idx] = self.buffer_size
        self._direct_buf[idx] = 0
        # Released chunks are empty already; their order is set here.
        self._lru_buf[:, chunk_t] = self._arange_c[: self.buffer_size].to(
            self._lru_buf.dtype
        )

    def release_request(self, r: IndexLike) -> None:
        """Drop every resident loc of request(s) ``r`` in every layer and give
        its unit chunks back."""
        self.swap_backend.check_settled("release_request")
        reqs = [req for req in self._host_indices(r) if req in self._req_chunks]
        if not reqs:
            return
        chunks = [c for req in reqs for c in self._req_chunks.pop(req)]
        chunk_t = torch.tensor(chunks, dtype=torch.int64, device=self.device)
        self._unmap_chunks(chunk_t)
        self._free_chunks.extend(chunks)
        self._free_chunks.sort(reverse=True)
        idx = torch.tensor(reqs, dtype=torch.int64, device=self.device)
        self._unit_index_buf[idx] = self._sink_unit
        self._unit_base_buf[idx] = -1
        self._capacity_buf[idx] = 0
        self._direct_buf[idx] = 0

    def _unmap_chunks(self, chunks: torch.Tensor) -> None:
        # The chunks' locs stop being resident (-1 to the sink loc); empty.
        locs = self._slot_loc_buf[:, chunks].reshape(self.num_layers, -1).long()
        self._loc_to_slot_buf.scatter_(
            1, torch.where(locs >= 0, locs, self.num_locs), -1
        )
        self._slot_loc_buf[:, chunks] = -1

    def enter_direct(self, r: int, num_positions: int) -> None:
        """Request ``r`` swaps in direct mode from its next swap on; the
        caller has put positions ``0 .. num_positions - 1`` in the same slots
        (fresh one-unit :meth:`warm_request`, or :meth:`warm_direct`)."""
        self.swap_backend.check_settled("enter_direct")
        if not self.direct_slots:
            raise ValueError("enter_direct: the state was built without direct_slots")
        if num_positions > self.num_slots:
            raise ValueError(
                f"enter_direct: {num_positions} positions exceed a request's "
                f"{self.num_slots} slots ({self.max_units} units)"
            )
        self._direct_buf[r] = 1

    def warm_direct(
        self,
        layers: Union[int, range, Sequence[int]],
        r: int,
        locs: torch.Tensor,
        num_slots: Optional[int] = None,
    ) -> torch.Tensor:
        """Position ``p`` (loc ``locs[p]``, none resident) into slot ``p`` of
        each of ``layers``, order = slot order, then direct mode (``num_slots``
        checked against ``r``'s). Returns ``(len(layers), n)`` int32 rows."""
        self.swap_backend.check_settled("warm_direct")
        layers = [layers] if isinstance(layers, int) else list(layers)
        locs = locs.reshape(-1).to(device=self.device, dtype=torch.int64)
        n = locs.numel()
        capacity = len(self._req_chunks[r]) * self.buffer_size
        if num_slots is not None and num_slots != capacity:
            raise ValueError(
                f"warm_direct: request {r} holds {capacity} slots, not {num_slots}"
            )
        if n > capacity:
            raise ValueError(
                f"warm_direct: positions 0..{n - 1} exceed the {capacity} slots "
                f"request {r} holds"
            )
        self.enter_direct(r, n)
        req = self._as_index(r)[:1]
        slot = torch.arange(n, dtype=torch.int64, device=self.device)
        layer_idx = torch.tensor(layers, dtype=torch.int64, device=self.device)
        self._loc_to_slot_buf[layer_idx[:, None], locs[None, :]] = slot.to(
            self.slot_dtype
        )
        flat = self._slot_loc_buf.view(self.num_layers, -1)
        addr = state_index(self, req, slot[None, :])
        flat[layer_idx[:, None], addr] = locs.to(torch.int32)
        order = self._read_order(r)
        order[layer_idx] = self._arange_c[:capacity]
        self._write_order(r, order)
        rows = slot_rows(self, req, slot[None, :])
        return rows.expand(len(layers), n).to(torch.int32)

    def grow_request(self, r: int, unit: int, base: int) -> None:
        """Give request ``r`` (holding ``unit`` units) unit ``unit`` at GPU
        row ``base``; its empty slots go to the LRU end of every order."""
        self.swap_backend.check_settled("grow_request")
        if not 1 <= unit < self.max_units:
            raise ValueError(f"unit {unit} not in [1, {self.max_units})")
        if len(self._req_chunks.get(r, ())) != unit:
            raise ValueError(f"grow_request: request {r} does not hold {unit} units")
        C = self.buffer_size
        lo, hi = unit * C, (unit + 1) * C
        old = self._read_order(r)
        chunk = self._take_chunk("grow_request")
        self._req_chunks[r].append(chunk)
        self._unit_index_buf[r, unit] = chunk
        self._unit_base_buf[r, unit] = base
        self._capacity_buf[r] = hi
        new = self._arange_c[lo:hi].expand(self.num_layers, -1)
        self._write_order(r, torch.cat([new, old], dim=1))

    def rebase_unit(self, r: int, unit: int, base: int) -> None:
        """Request ``r``'s extra unit ``unit`` now lives at GPU row ``base``
        (the caller copied its rows); slots and LRU state stay."""
        self.swap_backend.check_settled("rebase_unit")
        if not 1 <= unit < len(self._req_chunks.get(r, ())):
            raise ValueError(f"rebase_unit: request {r} holds no extra unit {unit}")
        self._unit_base_buf[r, unit] = base

    def shrink_request(self, r: int, unit: int) -> None:
        """Drop request ``r``'s last unit ``unit``: its locs stop being
        resident (nothing is copied), its slots leave the order (the others
        keep theirs), its chunk is given back."""
        self.swap_backend.check_settled("shrink_request")
        if not 1 <= unit < self.max_units:
            raise ValueError(f"unit {unit} not in [1, {self.max_units})")
        if len(self._req_chunks.get(r, ())) != unit + 1:
            raise ValueError(
                f"shrink_request: request {r} does not hold {unit + 1} units"
            )
        lo = unit * self.buffer_size
        order = self._read_order(r)
        keep = torch.argsort((order >= lo).to(torch.int8), dim=1, stable=True)
        kept = order.gather(1, keep)[:, :lo]
        chunk = self._req_chunks[r].pop()
        self._unmap_chunks(torch.tensor([chunk], device=self.device))
        self._free_chunks.append(chunk)
        self._free_chunks.sort(reverse=True)
        self._write_order(r, kept)
        self._unit_index_buf[r, unit] = self._sink_unit
        self._unit_base_buf[r, unit] = -1
        self._capacity_buf[r] = lo

    def warm_request(
        self,
        layers: Union[int, range, Sequence[int]],
        r: int,
        locs: torch.Tensor,
    ) -> torch.Tensor:
        """Install ``locs`` (``(n,)`` or ``(len(layers), n)``; -1 ignored, the
        others unique, ``n`` <= ``r``'s slots) in request ``r``: per layer one
        swap step (the last loc ends most recent), counters untouched. Returns
        ``(len(layers), n)`` int32 GPU rows holding each loc (-1: ignored)."""
        self.swap_backend.check_settled("warm_request")
        layers = [layers] if isinstance(layers, int) else list(layers)
        locs = locs.to(device=self.device, dtype=torch.int64)
        if locs.dim() == 1:
            locs = locs.unsqueeze(0).expand(len(layers), -1)
        if locs.shape[1] > self.max_units * self.buffer_size:
            raise ValueError("warm_request: more locs than a request's LRU slots")
        req = self._as_index(r)[:1]
        base = self._region_base_buf[req].long()
        rows = []
        for i, layer in enumerate(layers):
            loc = locs[i : i + 1]
            work = assign_slots(self, layer, req, base, loc >= 0, loc)
            reorder_lru(self, work)
            rows.append(work.row)
        return torch.cat(rows).to(torch.int32)

    def window_rows(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """``region_base + C + (seq_lens - 1) % W`` (int64): the window row of
        each request's newest token."""
        base = self._region_base_buf[req_pool_indices.long()].long()
        pos = seq_lens.long() - 1
        return base + self.buffer_size + pos % self.recent_window

    def expand_query_tokens(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        num_query_tokens: int,
    ):
        """Per query token (``bs * q``, request-major): its request's pool
        index and its own length, for :meth:`window_rows` and
        :meth:`map_new_tokens`."""
        q = num_query_tokens
        if q == 1:
            return req_pool_indices, seq_lens
        j = torch.arange(q, dtype=seq_lens.dtype, device=seq_lens.device)
        lens = (seq_lens[:, None] - q + 1 + j[None, :]).reshape(-1)
        return req_pool_indices.repeat_interleave(q), lens

    def map_new_tokens(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        locs: torch.Tensor,
        loc_to_row: torch.Tensor,
    ) -> None:
        """``loc_to_row[locs] = window_rows(req_pool_indices, seq_lens)``: a
        step's new tokens go to their window rows (one launch on CUDA)."""
        if locs.numel() == 0:
            return
        self.swap_backend.map_new_tokens(
            self, req_pool_indices, seq_lens, locs, loc_to_row
        )

    @property
    def use_triton(self) -> bool:
        return isinstance(self.swap_backend, TritonLRUSwap)

    def swap_layer(
        self,
        layer: int,
        topk_pos: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        req_to_token: torch.Tensor,
        num_real_reqs: Optional[Union[torch.Tensor, int]] = None,
        out: Optional[LayerSwapPlan] = None,
        num_query_tokens: int = 1,
        defer_reorder: bool = False,
    ) -> LayerSwapPlan:
        """One layer's swap: page table in top-k order + copy plan. Rows from
        ``num_real_reqs`` on are padding; ``out``: static buffers; ``q`` rows
        of ``topk_pos`` per request; ``defer_reorder``: the recency update
        waits for :meth:`finish_reorder` (docs/ENGINE.md)."""
        q = num_query_tokens
        if not 1 <= q <= self.max_query_tokens:
            raise ValueError(
                f"num_query_tokens ({q}) must be in [1, {self.max_query_tokens}]"
            )
        if topk_pos.shape[0] != req_pool_indices.shape[0] * q:
            raise ValueError(
                f"topk_pos has {topk_pos.shape[0]} rows for "
                f"{req_pool_indices.shape[0]} requests x {q} query tokens"
            )
        return self.swap_backend.swap_layer(
            self,
            layer,
            topk_pos,
            req_pool_indices,
            seq_lens,
            req_to_token,
            num_real_reqs,
            out,
            q,
            defer_reorder=defer_reorder,
        )

    def finish_reorder(self) -> None:
        """Launch the deferred recency update of the last swap, if any."""
        self.swap_backend.finish_reorder()

    def plan_view(
        self, bs: int, out: Optional[LayerSwapPlan], num_query_tokens: int = 1
    ) -> LayerSwapPlan:
        """The rows of ``out`` for ``bs`` requests (checked), or new buffers."""
        q = num_query_tokens
        if out is None:
            k, dev = self.top_k, self.device
            return LayerSwapPlan(
                torch.empty((bs * q, k), dtype=torch.int32, device=dev),
                torch.empty((bs, q * k), dtype=torch.int64, device=dev),
                torch.empty((bs, q * k), dtype=torch.int32, device=dev),
                torch.empty((bs,), dtype=torch.int32, device=dev),
            )
        for t, dtype in zip(out, (torch.int32, torch.int64, torch.int32, torch.int32)):
            assert t.dtype == dtype and t.shape[0] >= bs and t.stride(-1) == 1
        width = q * out.page_table.shape[1]
        assert out.page_table.shape[0] >= bs * q
        assert out.miss_src_loc.shape[1] >= width
        assert out.miss_dst_row.shape[1] >= width
        return LayerSwapPlan(
            out.page_table[: bs * q],
            out.miss_src_loc[:bs, :width],
            out.miss_dst_row[:bs, :width],
            out.miss_count[:bs],
        )

    def num_real_tensor(
        self, num_real_reqs: Optional[Union[torch.Tensor, int]], bs: int
    ) -> torch.Tensor:
        """``num_real_reqs`` as a 1-element device tensor."""
        if isinstance(num_real_reqs, torch.Tensor):
            return num_real_reqs.reshape(-1)[:1]
        n = bs if num_real_reqs is None else int(num_real_reqs)
        return torch.full((1,), n, dtype=torch.int32, device=self.device)
