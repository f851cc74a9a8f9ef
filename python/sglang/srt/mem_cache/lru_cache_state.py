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

The LRU state is held per unit, not per request slot (``docs/ELASTIC_BUFFER.md``,
1e): every unit a request holds has a chunk of ``C`` entries of ``slot_loc``
and ``lru_order`` among ``num_units`` chunks, ``unit_index[r, u]`` names it.
Slot ``s`` of request ``r`` keeps its loc at chunk ``unit_index[r, s // C]``,
offset ``s % C``, and position ``p`` of its LRU order (a permutation of the
``capacity[r]`` slots it holds) at chunk ``unit_index[r, p // C]``, offset
``p % C``. Memory then grows with the units that exist, not with
``max_num_reqs x U``.

With ``max_query_tokens = Q > 1`` a swap may serve up to ``Q`` query tokens
per request (MTP target verify, ``docs/MTP.md``): their top-k rows are looked
up as one list, each missing loc is copied once, and each query token gets its
own page-table row in its own top-k order. Swaps then read only the newest
``W - Q + 1`` positions from the ring (``read_window``; the older ones through
the LRU): rejected drafts may have overwritten the ring rows of the others.
``Q = 1`` is the decode swap.

With ``direct_slots`` (one query token only), a request admitted with every
position below its first window installed in order (slot ``p`` holds position
``p``) swaps in direct mode while its context fits its slots: a hit is looked
up as always, a miss of position ``p`` is copied into slot ``p`` (empty by
construction), and ``lru_order`` is neither read nor written. The first swap
at which ``seq_len - W > capacity`` ends it for good (``direct[r] = 0``); the
LRU swap then goes on from the order as it was left (``docs/ENGINE.md``, "A
context that fits its rows").

Everything is fixed-shape and sync-free so the swap can be captured in a CUDA
graph. The swap backend is chosen once, at construction: on CUDA (or under
``TRITON_INTERPRET=1``) ``nsa_kv_offload_lru_triton.TritonLRUSwap`` runs one
fused Triton kernel per layer (with units: a select kernel for the page table
and copy list, then the recency update split by unit, which may be deferred:
``swap_layer(defer_reorder=True)``); else
``nsa_kv_offload_lru_reference.ReferenceLRUSwap``, the pure-torch reference
of the same semantics (bit-exact; it backs the CPU tests). Both read and
write the sink-padded buffers of this class.

Callers guarantee: top-k positions unique apart from padding; token locs unique
across live requests; a request is released before its pool index is admitted
again; swaps of one state run on one stream (the kernel's scratch is shared).
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
    """Fused kernel on CUDA; on CPU only under ``TRITON_INTERPRET=1`` (tests)."""
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

    Internal buffers carry one extra "sink" entry (loc ``N`` in ``loc_to_slot``,
    request row ``max_num_reqs`` in the per-request tensors, unit chunk
    ``num_units`` in the per-unit ones): the reference path routes masked-out
    scatters there instead of filtering with a host sync. The public
    attributes are views without the sink; ``slot_loc`` and ``lru_order``
    are gathered per request (tests and tools).

    ``num_units``: unit chunks of LRU state, at least the units held at once
    by all requests (default ``max_num_reqs x max_units``: every request at
    its most). :meth:`admit_request` and :meth:`grow_request` take one,
    release and shrink give it back (host-side free list).
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
        max_query_tokens: int = 1,
        direct_slots: bool = False,
        num_units: Optional[int] = None,
    ):
        if max_query_tokens < 1:
            raise ValueError(f"max_query_tokens ({max_query_tokens}) must be >= 1")
        # One swap keeps the union of its query tokens' top-k resident at once.
        if buffer_size < max_query_tokens * top_k:
            raise ValueError(
                f"buffer_size ({buffer_size}) must be >= max_query_tokens "
                f"({max_query_tokens}) x top_k ({top_k})"
            )
        if not 1 <= recent_window < buffer_size:
            raise ValueError(
                f"recent_window ({recent_window}) must be in [1, buffer_size)"
            )
        # Swaps read the newest read_window positions from the ring: the ring
        # rows of the W - read_window older ones may hold drafts rejected by
        # an earlier step (docs/MTP.md, "Rollback"). A step's query tokens
        # (its newest positions) must be among them.
        read_window = recent_window - (max_query_tokens - 1)
        if read_window < max_query_tokens:
            raise ValueError(
                f"recent_window ({recent_window}) must be >= 2 x max_query_tokens "
                f"- 1 ({2 * max_query_tokens - 1})"
            )
        if max_units < 1:
            raise ValueError(f"max_units ({max_units}) must be >= 1")
        if direct_slots and max_query_tokens > 1:
            # A verify's positions are not one chain per slot range.
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
        # LRU slots a request may hold across all units; it holds the first
        # capacity[r] of them.
        self.num_slots = buffer_size * max_units
        self.recent_window = recent_window
        # Window positions a swap reads from the ring (W with one query token).
        self.read_window = read_window
        self.top_k = top_k
        self.region_size = buffer_size + recent_window
        self.device = torch.device(device)
        L, C0, dev = num_layers, buffer_size, self.device
        self._sink_req = max_num_reqs
        self._sink_unit = num_units
        # Slot ids (loc_to_slot, lru_order): int16 while a request's slots fit.
        self.slot_dtype = lru_slot_dtype(self.num_slots)
        self._loc_to_slot_buf = torch.full(
            (L, num_locs + 1), -1, dtype=self.slot_dtype, device=dev
        )
        # Per unit chunk: slot_loc (the loc in each of its C slots, -1: empty)
        # and its C positions of its request's lru_order.
        self._slot_loc_buf = torch.full(
            (L, num_units + 1, C0), -1, dtype=torch.int32, device=dev
        )
        self._lru_buf = torch.full(
            (L, num_units + 1, C0), -1, dtype=self.slot_dtype, device=dev
        )
        # unit_index[r, u]: the chunk of unit u of request r; units it does
        # not hold (and the sink request's) name the sink chunk, so a stale
        # padding row's reads stay in bounds.
        self._unit_index_buf = torch.full(
            (max_num_reqs + 1, max_units),
            self._sink_unit,
            dtype=torch.int32,
            device=dev,
        )
        # Free chunks (lowest first) and each request's chunks, on the host.
        self._free_chunks: List[int] = list(range(num_units - 1, -1, -1))
        self._req_chunks: Dict[int, List[int]] = {}
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
        # direct[r]: 1 while request r swaps in direct mode (slot = position).
        self._direct_buf = torch.zeros(
            (max_num_reqs + 1,), dtype=torch.int8, device=dev
        )
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
        self.counters = torch.zeros((L, 3), dtype=torch.int64, device=dev)

        self._arange_c = torch.arange(self.num_slots, dtype=torch.int64, device=dev)
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
        if use_triton is None:
            use_triton = default_use_triton(self.device)
        # The swap backend, chosen once.
        self.swap_backend = (
            TritonLRUSwap(self, max_batch_size=max_batch_size, num_warps=num_warps)
            if use_triton
            else ReferenceLRUSwap()
        )

    # ------------------------------------------------ per-request state views

    def _per_request(self, buf: torch.Tensor) -> torch.Tensor:
        # (L, max_num_reqs, U x C) entries of each request's chunks, -1
        # beyond its capacity.
        reqs = torch.arange(self.max_num_reqs, device=self.device)
        idx = self._arange_c.expand(self.max_num_reqs, -1)
        flat = buf.reshape(self.num_layers, -1)
        addr = state_index(self, reqs, idx).reshape(-1)
        out = flat[:, addr].reshape(self.num_layers, self.max_num_reqs, -1)
        held = idx < self.capacity.long()[:, None]
        return torch.where(held, out, torch.full_like(out, -1))

    @property
    def slot_loc(self) -> torch.Tensor:
        """``slot_loc[l, r, s]``: token loc in slot ``s`` of request ``r``,
        -1 if empty or not held (a gathered copy)."""
        return self._per_request(self._slot_loc_buf)

    @property
    def lru_order(self) -> torch.Tensor:
        """``lru_order[l, r]``: request ``r``'s held slots, least recently
        used first, then -1 beyond its capacity (a gathered copy)."""
        return self._per_request(self._lru_buf)

    @property
    def unit_state_bytes(self) -> int:
        """GPU bytes of the per-unit state (``slot_loc``, ``lru_order``; the
        sink chunk included): what the pool sizing counts per unit."""
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

    # ---------------------------------------------------------------- lifecycle

    def _as_index(self, r: IndexLike) -> torch.Tensor:
        if isinstance(r, torch.Tensor):
            return r.to(device=self.device, dtype=torch.int64).reshape(-1)
        return torch.tensor(r, dtype=torch.int64, device=self.device).reshape(-1)

    def admit_request(self, r: IndexLike, base: IndexLike) -> None:
        """Give request(s) ``r`` the region starting at GPU row ``base``.

        It holds one unit (``C`` slots, a chunk of LRU state); all slots start
        empty with ``lru_order = arange(C)``. ``r`` must not be admitted
        (fresh, or released since its last admission).
        """
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
        # The locs the chunks' slots hold stop being resident; the chunks end
        # empty.
        locs = self._slot_loc_buf[:, chunks].reshape(self.num_layers, -1).long()
        # Empty slots (-1) go to the sink loc.
        self._loc_to_slot_buf.scatter_(
            1, torch.where(locs >= 0, locs, self.num_locs), -1
        )
        self._slot_loc_buf[:, chunks] = -1

    def enter_direct(self, r: int, num_positions: int) -> None:
        """Request ``r`` swaps in direct mode from its next swap on. The
        caller has installed positions ``0 .. num_positions - 1`` (those below
        its first window) in slots ``0 .. num_positions - 1``: with one
        :meth:`warm_request` of a fresh one-unit admission (it fills slots in
        order) or with :meth:`warm_direct`."""
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
        """Direct mode's warm-up: position ``p`` (loc ``locs[p]``) into slot
        ``p`` of each of ``layers`` across the units ``r`` holds (none resident
        yet; ``num_slots``: checked against them), its order slot order, then
        direct mode. Returns ``(len(layers), n)`` int32 GPU rows to fill."""
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
        """Give request ``r`` unit ``unit`` (its next one: it holds ``unit``
        units now) at GPU row ``base``, with a chunk of LRU state. The unit's
        empty slots go to the LRU end of every layer's order, so misses fill
        them before evicting."""
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
        """Request ``r``'s unit ``unit`` (an extra one) is backed by the GPU
        rows from ``base`` on: the caller has copied its rows there. Its slots
        and their LRU state stay as they are."""
        self.swap_backend.check_settled("rebase_unit")
        if not 1 <= unit < len(self._req_chunks.get(r, ())):
            raise ValueError(f"rebase_unit: request {r} holds no extra unit {unit}")
        self._unit_base_buf[r, unit] = base

    def shrink_request(self, r: int, unit: int) -> None:
        """Drop request ``r``'s last unit ``unit`` (it holds ``unit + 1``):
        the locs its slots hold stop being resident in every layer (the host
        pool keeps every token, so nothing is copied), its slots leave the
        order (the others keep theirs) and its chunk is given back."""
        self.swap_backend.check_settled("shrink_request")
        if not 1 <= unit < self.max_units:
            raise ValueError(f"unit {unit} not in [1, {self.max_units})")
        if len(self._req_chunks.get(r, ())) != unit + 1:
            raise ValueError(
                f"shrink_request: request {r} does not hold {unit + 1} units"
            )
        lo = unit * self.buffer_size
        order = self._read_order(r)
        # Stable compaction: the slots below lo, in their order.
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
        """Install ``locs`` as resident in request ``r`` for each of ``layers``.

        ``locs`` is ``(n,)`` (same locs in every layer) or ``(len(layers), n)``;
        ``-1`` entries are ignored, the others must be unique, ``n`` at most
        the slots request ``r`` holds (its units x C: the caller's to keep). Each
        layer is one swap step over ``locs``: locs already resident are hits,
        the others take LRU victims in order, and recency follows the tie rule
        (the last loc ends up most recent). Counters are not touched.

        Returns ``(len(layers), n)`` int32 GPU rows now holding each loc (-1 for
        ignored entries); the caller fills the newly installed rows.
        """
        self.swap_backend.check_settled("warm_request")
        if isinstance(layers, int):
            layers = [layers]
        layers = list(layers)
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
            lookup = loc >= 0
            work = assign_slots(self, layer, req, base, lookup, loc)
            reorder_lru(self, work)
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

    def expand_query_tokens(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        num_query_tokens: int,
    ):
        """Per query token (``bs * q`` entries, request-major): its request's
        pool index and its own length (position + 1), for :meth:`window_rows`
        and :meth:`map_new_tokens` (``seq_lens`` as in :meth:`swap_layer`)."""
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
        """``loc_to_row[locs] = window_rows(req_pool_indices, seq_lens)``: one
        decode step's new tokens go to their window rows. One launch on CUDA
        (it runs every step, outside the CUDA graphs)."""
        if locs.numel() == 0:
            return
        self.swap_backend.map_new_tokens(
            self, req_pool_indices, seq_lens, locs, loc_to_row
        )

    # --------------------------------------------------------------- the swap

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
        """One layer's swap: page table in top-k order + copy plan. Rows at
        or past ``num_real_reqs`` (device tensor) are padding; ``out``: static
        buffers (CUDA graphs); ``q = num_query_tokens`` rows of ``topk_pos`` per
        request (``docs/MTP.md``); ``defer_reorder``: the recency update waits
        for :meth:`finish_reorder` (docs/ENGINE.md, "Per-layer swap semantics")."""
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
        """Launch the deferred recency update of the last swap (on the
        current stream); nothing when none is pending."""
        self.swap_backend.finish_reorder()

    def plan_view(
        self, bs: int, out: Optional[LayerSwapPlan], num_query_tokens: int = 1
    ) -> LayerSwapPlan:
        """The rows of ``out`` for ``bs`` requests with ``num_query_tokens``
        each (checked), or new buffers."""
        q = num_query_tokens
        if out is None:
            k, dev = self.top_k, self.device
            return LayerSwapPlan(
                torch.empty((bs * q, k), dtype=torch.int32, device=dev),
                torch.empty((bs, q * k), dtype=torch.int64, device=dev),
                torch.empty((bs, q * k), dtype=torch.int32, device=dev),
                torch.empty((bs,), dtype=torch.int32, device=dev),
            )
        assert out.page_table.dtype == torch.int32
        assert out.miss_src_loc.dtype == torch.int64
        assert out.miss_dst_row.dtype == torch.int32
        assert out.miss_count.dtype == torch.int32
        for t in out:
            assert t.shape[0] >= bs and t.stride(-1) == 1
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
