"""Pure-torch reference of the LRU swap of ``LRUCacheState`` (CPU tests),
bit-exact with the Triton kernels (``docs/ENGINE.md``, "Per-layer swap
semantics"): :func:`prepare_layer_swap` (hits, misses, victims, residency),
:func:`build_gpu_page_table`, :func:`post_process_layer_swap` (copy list,
recency rule, counters). ``warm_request`` uses :func:`assign_slots` and
:func:`reorder_lru` on every backend. With ``q > 1`` query tokens
(``docs/MTP.md``) a request's ``q x K`` entries are one list whose misses are
copied once each; rows in direct mode go through :func:`direct_swap`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch


class LayerSwapPlan(NamedTuple):
    """One layer's swap of ``bs`` requests with ``q`` query tokens each; only
    the first ``miss_count[b]`` entries of ``miss_src_loc[b]`` and
    ``miss_dst_row[b]`` are meaningful."""

    page_table: torch.Tensor  # (bs * q, K) int32, GPU rows in top-k order, -1 = skip
    miss_src_loc: torch.Tensor  # (bs, q * K) int64, host slot (= token loc) to load
    miss_dst_row: torch.Tensor  # (bs, q * K) int32, GPU row to load it into
    miss_count: torch.Tensor  # (bs,) int32


@dataclass
class LayerSwapWork:
    """State of the reference swap between its three steps."""

    layer: int
    real: torch.Tensor  # (bs,) bool, row is not CUDA-graph padding
    req: torch.Tensor  # (bs,) int64, request pool index (padding -> sink row)
    base: torch.Tensor  # (bs,) int64, region base row (unit 0)
    # Entries: the request's q top-k rows side by side (M = q x K; q = 1: K).
    pos: torch.Tensor  # (bs, M) int64, top-k positions
    in_window: torch.Tensor  # (bs, M) bool
    hit: torch.Tensor  # (bs, M) bool
    miss: torch.Tensor  # (bs, M) bool
    first_miss: torch.Tensor  # (bs, M) bool, first entry of each missed loc
    loc: torch.Tensor  # (bs, M) int64, token loc of looked-up entries
    slot: torch.Tensor  # (bs, M) int64, LRU slot of hits and misses, else -1
    row: torch.Tensor  # (bs, M) int64, GPU row of ``slot``, else -1
    miss_rank: torch.Tensor  # (bs, M) int64, index of the loc among the misses
    num_misses: torch.Tensor  # (bs,) int64
    num_hits: torch.Tensor  # (bs,) int64
    order: torch.Tensor  # (bs, C) int64, lru_order before the step
    order_evictable: torch.Tensor  # (bs, C) bool, slot at that position not hit
    evict_rank: torch.Tensor  # (bs, C) int64, rank among evictable positions
    num_query_tokens: int = 1
    # (bs,) bool: rows swapped in direct mode, whose lru_order stays as it is.
    frozen: Optional[torch.Tensor] = None


class ReferenceLRUSwap:
    """The swap backend of ``LRUCacheState`` without Triton (CPU)."""

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
        work = prepare_layer_swap(
            state,
            layer,
            topk_pos,
            req_pool_indices,
            seq_lens,
            req_to_token,
            num_real_reqs,
            num_query_tokens,
        )
        page_table = build_gpu_page_table(
            state, work, out=None if out is None else out.page_table
        )
        return post_process_layer_swap(state, work, page_table, out=out)

    def check_settled(self, what: str) -> None:
        pass

    def finish_reorder(self) -> None:
        pass

    def map_new_tokens(
        self,
        state,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        locs: torch.Tensor,
        loc_to_row: torch.Tensor,
    ) -> None:
        loc_to_row[locs] = state.window_rows(req_pool_indices, seq_lens)


def prepare_layer_swap(
    state,
    layer: int,
    topk_pos: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    num_real_reqs: Optional[Union[torch.Tensor, int]] = None,
    num_query_tokens: int = 1,
) -> LayerSwapWork:
    """Classify the top-k entries, pick victims, update residency.
    ``topk_pos``: ``(bs * q, K)``, row ``b * q + j`` query token ``j`` of
    request ``b`` (sees positions ``< seq_lens[b] - q + j + 1``); the newest
    ``state.read_window`` positions come from the window ring."""
    q = num_query_tokens
    bs, k = topk_pos.shape[0] // q, topk_pos.shape[1]
    W = state.read_window
    num_real = state.num_real_tensor(num_real_reqs, bs)
    real = torch.arange(bs, device=state.device) < num_real
    req_in = req_pool_indices.long()
    req = torch.where(real, req_in, state._sink_req)
    base = state._region_base_buf[req].long()
    n = seq_lens.long()[:, None]
    pos = topk_pos.long().reshape(bs, q * k)
    if q == 1:
        kv_len = n
    else:
        query = torch.arange(q * k, device=state.device) // k
        kv_len = n - q + 1 + query[None, :]
    valid = real[:, None] & (pos >= 0) & (pos < kv_len)
    in_window = valid & (pos >= n - W)
    lookup = valid & ~in_window
    tok_req = torch.where(real, req_in, 0)[:, None]
    loc = req_to_token[tok_req, torch.where(lookup, pos, 0)].long()
    loc = torch.where(lookup, loc, -1)
    fits = None
    if state.direct_slots:
        fits = direct_rows(state, req, real, n[:, 0], W)
        lru_lookup = lookup & ~fits[:, None]
    else:
        lru_lookup = lookup
    work = assign_slots(
        state,
        layer,
        req,
        base,
        lru_lookup,
        torch.where(lru_lookup, loc, -1),
        real,
        pos,
        in_window,
        dedup=q > 1,
    )
    work.num_query_tokens = q
    if fits is not None:
        direct_swap(state, work, fits, lookup & fits[:, None], loc)
    return work


def direct_rows(
    state,
    req: torch.Tensor,
    real: torch.Tensor,
    n: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """(bs,) bool: direct rows whose positions below the window fit their
    slots; a direct row that no longer fits leaves direct mode for good."""
    flags = state._direct_buf[req]
    direct = real & (flags != 0)
    fits = direct & (n - window <= state._capacity_buf[req].long())
    state._direct_buf[req] = torch.where(direct & ~fits, 0, flags).to(flags.dtype)
    return fits


def direct_swap(
    state,
    work: LayerSwapWork,
    fits: torch.Tensor,
    lookup: torch.Tensor,
    loc: torch.Tensor,
) -> None:
    """Swap the direct rows ``fits`` into ``work``: a hit keeps its slot, a
    miss of position ``p`` takes slot ``p``; nothing is evicted."""
    N = state.num_locs
    l2s = state._loc_to_slot_buf[work.layer]
    slot_loc = state._slot_loc_buf[work.layer].view(-1)
    cur = l2s[torch.where(lookup, loc, N)].long()
    hit = lookup & (cur >= 0)
    miss = lookup & (cur < 0)
    slot = torch.where(hit, cur, torch.where(miss, work.pos, -1))
    row = slot_rows(state, work.req, slot)
    mi = miss.long()
    miss_rank = mi.cumsum(1) - mi
    l2s.index_put_((torch.where(miss, loc, N),), slot.to(l2s.dtype))
    addr = state_index(state, work.req, torch.where(miss, slot, -1))
    slot_loc.index_put_((addr,), loc.to(slot_loc.dtype))
    f = fits[:, None]
    work.hit = torch.where(f, hit, work.hit)
    work.miss = torch.where(f, miss, work.miss)
    work.first_miss = torch.where(f, miss, work.first_miss)
    work.loc = torch.where(f, loc, work.loc)
    work.slot = torch.where(f, slot, work.slot)
    work.row = torch.where(f, row, work.row)
    work.miss_rank = torch.where(f, miss_rank, work.miss_rank)
    work.num_misses = torch.where(fits, mi.sum(1), work.num_misses)
    work.num_hits = torch.where(fits, hit.long().sum(1), work.num_hits)
    work.frozen = fits


def build_gpu_page_table(
    state, work: LayerSwapWork, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """GPU rows of the top-k entries in top-k order (-1: padding), one row
    per query token."""
    base = work.base[:, None]
    window_row = base + state.buffer_size + work.pos.remainder(state.recent_window)
    rows = torch.where(work.in_window, window_row, work.row).to(torch.int32)
    q = work.num_query_tokens
    rows = rows.reshape(rows.shape[0] * q, -1)
    if out is None:
        return rows
    out[: rows.shape[0]].copy_(rows)
    return out[: rows.shape[0]]


def post_process_layer_swap(
    state,
    work: LayerSwapWork,
    page_table: torch.Tensor,
    out: Optional[LayerSwapPlan] = None,
) -> LayerSwapPlan:
    """Compact the misses into the copy list and apply the recency rule."""
    bs, k = work.miss.shape
    sink = torch.where(work.first_miss, work.miss_rank, k)
    src = torch.zeros((bs, k + 1), dtype=torch.int64, device=state.device)
    src.scatter_(1, sink, work.loc)
    dst = torch.zeros((bs, k + 1), dtype=torch.int64, device=state.device)
    dst.scatter_(1, sink, work.row)
    count = work.num_misses.to(torch.int32)
    reorder_lru(state, work)
    # LRU hits: looked-up entries without a copy of their own.
    hits = work.hit.sum() + (work.miss & ~work.first_miss).sum()
    stats = torch.stack([hits, work.in_window.sum(), work.first_miss.sum()])
    state.counters[work.layer] += stats.to(torch.int64)
    plan = LayerSwapPlan(page_table, src[:, :k], dst[:, :k].to(torch.int32), count)
    if out is None:
        return plan
    result = state.plan_view(bs, out, work.num_query_tokens)
    for dst_t, src_t in zip(result, plan):
        if dst_t.data_ptr() != src_t.data_ptr():
            dst_t.copy_(src_t)
    return result


def assign_slots(
    state,
    layer: int,
    req: torch.Tensor,
    base: torch.Tensor,
    lookup: torch.Tensor,
    loc: torch.Tensor,
    real: Optional[torch.Tensor] = None,
    pos: Optional[torch.Tensor] = None,
    in_window: Optional[torch.Tensor] = None,
    dedup: bool = False,
) -> LayerSwapWork:
    """Hits, misses and victims of looked-up locs; updates residency.
    ``dedup``: a row may repeat a loc (several query tokens); its miss is
    counted, ranked and loaded at the first entry, whose victim all get."""
    bs, k = loc.shape
    C, N = state.num_slots, state.num_locs
    l2s = state._loc_to_slot_buf[layer]
    # The sink entries of loc_to_slot may hold garbage: mask after the gather.
    cur = l2s[torch.where(lookup, loc, N)].long()
    hit = lookup & (cur >= 0)
    miss = lookup & (cur < 0)
    first, leader = first_misses(loc, miss, N) if dedup else (miss, None)
    hit_flags = torch.zeros((bs, C + 1), dtype=torch.bool, device=state.device)
    hit_flags.scatter_(1, torch.where(hit, cur, C), True)
    order = read_order(state, layer, req)
    # Slots beyond the request's units are never victims.
    in_capacity = order < state._capacity_buf[req].long()[:, None]
    evictable = ~hit_flags.gather(1, order) & in_capacity
    ev = evictable.long()
    evict_rank = ev.cumsum(1) - ev
    mi = first.long()
    miss_rank = mi.cumsum(1) - mi
    if leader is not None:
        miss_rank = miss_rank.gather(1, leader)
    num_misses = mi.sum(1)
    # The j-th miss (top-k order) takes the j-th evictable slot (LRU first).
    taken = evictable & (evict_rank < num_misses[:, None])
    victim_by_rank = torch.zeros((bs, k + 1), dtype=torch.int64, device=state.device)
    victim_by_rank.scatter_(1, torch.where(taken, evict_rank, k), order)
    victim = victim_by_rank.gather(1, torch.where(miss, miss_rank, k))
    slot = torch.where(hit, cur, torch.where(miss, victim, -1))
    row = slot_rows(state, req, slot)
    move_in(state, layer, req, first, victim, loc, slot)
    return LayerSwapWork(
        layer=layer,
        real=torch.ones_like(req, dtype=torch.bool) if real is None else real,
        req=req,
        base=base,
        pos=loc if pos is None else pos,
        in_window=torch.zeros_like(lookup) if in_window is None else in_window,
        hit=hit,
        miss=miss,
        first_miss=first,
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


def move_in(state, layer, req, first, victim, loc, slot) -> torch.Tensor:
    """Residency: the victims' old locs leave ``loc_to_slot``, the missed
    locs (``first``: each once) enter their slots, other entries go to the
    sink chunk. Returns the victims' state offsets."""
    N = state.num_locs
    l2s = state._loc_to_slot_buf[layer]
    slot_loc = state._slot_loc_buf[layer].view(-1)
    addr = state_index(state, req, torch.where(first, victim, -1))
    old = torch.where(first, slot_loc[addr].long(), -1)
    l2s.index_put_((torch.where(old >= 0, old, N),), l2s.new_full((), -1))
    l2s.index_put_((torch.where(first, loc, N),), slot.to(l2s.dtype))
    slot_loc.index_put_((addr,), loc.to(slot_loc.dtype))
    return addr


def slot_rows(state, req: torch.Tensor, slot: torch.Tensor):
    """GPU row of each slot (``unit_base[r, s // C] + s % C``), -1 for -1."""
    C0 = state.buffer_size
    unit = torch.where(slot >= 0, slot // C0, 0)
    unit_base = state._unit_base_buf[req].long().gather(1, unit)
    return torch.where(slot >= 0, unit_base + slot % C0, -1)


def state_index(state, req: torch.Tensor, idx: torch.Tensor):
    """Offset in one layer's per-unit state of entry ``idx[b, i]`` (slot id
    or order position) of request ``req[b]``: chunk ``unit_index[r, idx //
    C]``, entry ``idx % C``; entries not held go to the sink chunk."""
    C0 = state.buffer_size
    idx = idx.long()
    held = (idx >= 0) & (idx < state._capacity_buf[req].long()[:, None])
    unit = torch.where(held, idx // C0, 0)
    chunk = state._unit_index_buf[req].long().gather(1, unit)
    chunk = torch.where(held, chunk, state._sink_unit)
    return chunk * C0 + torch.where(held, idx % C0, 0)


def read_order(state, layer: int, req: torch.Tensor) -> torch.Tensor:
    """``(bs, U x C)`` int64 LRU order of each request; positions beyond its
    capacity hold their own index (never victims, left in place)."""
    p = state._arange_c.expand(req.shape[0], -1)
    order = state._lru_buf[layer].view(-1)[state_index(state, req, p)].long()
    return torch.where(p < state._capacity_buf[req].long()[:, None], order, p)


def first_misses(loc: torch.Tensor, miss: torch.Tensor, num_locs: int):
    """``(first, leader)``: ``first[b, i]``: entry ``i`` is row ``b``'s first
    miss of its loc; ``leader[b, i]``: that first entry (``i`` for others)."""
    bs, m = loc.shape
    idx = torch.arange(m, device=loc.device).expand(bs, m)
    # Entries that are not misses get keys of their own (locs are < num_locs).
    key = torch.where(miss, loc, num_locs + idx)
    sorted_key, perm = torch.sort(key, dim=1, stable=True)
    starts = torch.ones_like(sorted_key, dtype=torch.bool)
    starts[:, 1:] = sorted_key[:, 1:] != sorted_key[:, :-1]
    # Stable sort: each run of one loc starts at its lowest entry index.
    run_start = torch.where(starts, idx, 0).cummax(1).values
    leader = torch.empty_like(perm).scatter_(1, perm, perm.gather(1, run_start))
    return miss & (leader == idx), leader


def reorder_lru(state, work: LayerSwapWork) -> None:
    # New order: [untaken evictables] + [victims] + [hits (and the slots
    # beyond the capacity)], each in old order.
    m = work.num_misses[:, None]
    num_evictable = work.order_evictable.long().sum(1, keepdim=True)
    ev_rank = work.evict_rank
    hit_rank = state._arange_c[None, :] - ev_rank
    new_pos = torch.where(
        work.order_evictable,
        torch.where(ev_rank >= m, ev_rank - m, num_evictable - m + ev_rank),
        num_evictable + hit_rank,
    )
    new_order = torch.empty_like(work.order).scatter_(1, new_pos, work.order)
    if work.frozen is not None:
        new_order = torch.where(work.frozen[:, None], work.order, new_order)
    # Positions not held (padding rows: all) go to the sink chunk.
    addr = state_index(state, work.req, state._arange_c.expand_as(new_order))
    state._lru_buf[work.layer].view(-1).index_put_(
        (addr,), new_order.to(state._lru_buf.dtype)
    )
