"""Request lifecycle and forward hooks of the decode NSA KV offload.

One ``NSAKVOffloadCoordinator`` per rank, built by ModelRunner after its pools
and before its attention backends, which are handed it (the scheduler takes it
from the model runner; code that holds only the token allocator reaches it
through ``get_nsa_kv_offload``). It owns the ``SparseCacheController`` (host
pool, LRU state, regions, copies) and connects it to sglang's scheduling:

* admission (right after the forward that completes a prompt is enqueued;
  the first decode preparation admits anything missed): back the prompt up
  to host slots, give the request a region, warm it, and return the staging
  rows. On a PD decode server the prompt's KV arrives in the host slots
  through the KV transfer: admission (first decode preparation) only gives
  the region and warms it;
* every decode preparation: map each new token loc to its window ring row;
  with ``--nsa-kv-offload-max-units U`` > 1 (default 4), hand free
  regions, then idle prefill staging rows, to running requests as extra LRU
  units (an admission that finds no free region takes one back, a prefill
  that finds no free staging page takes staging units back);
* every forward: make the forward stream wait for the side-stream copies;
* inside every decode forward (CUDA-graph captured, no host work per step):
  the first layer's hook counts the batch's real rows, the last layer's hook
  writes the step's new tokens (all layers, one launch) back to host memory;
* optional cross-layer prefetch (``SGLANG_NSA_KV_OFFLOAD_CROSS_LAYER_PREFETCH=1``,
  experimental): right after layer l's swap, layer l's top-k is loaded into
  layer l+1's LRU slots on a second stream (with the early swap: on the
  swap's stream, after layer l's swap), overlapping layer l's attention
  and MLP; layer l+1's swap waits for it and then misses only what the two
  layers do not share;
* the early swap (on by default, ``early_swap_enabled``;
  ``SGLANG_NSA_KV_OFFLOAD_EARLY_SWAP=0`` turns it off): the model hands a
  decode or verify layer's top-k over as soon as the indexer returns it
  (``begin_layer_swap``); its swap and miss copy run on a side stream
  beside the query projection, rope and the new tokens' KV write, and the
  backend's swap hook only waits for them. Same kernels, same inputs: the
  outputs are the inline swap's;
* optional direct slots (``SGLANG_NSA_KV_OFFLOAD_DIRECT_SLOTS=1``,
  experimental): a request whose prompt fits one unit's slots is warmed
  whole and swaps without the LRU walk while its context fits
  (``LRUCacheState``);
* finish / abort / retract: release the region and LRU state after the GPU work
  that may still touch them.

With attention TP the ranks of the group hold the same KV and share one host
pool (``host_pool_group``): the first rank writes it, the others only read it
and warm new requests from their own prefill staging rows (docs/MULTI_GPU.md).

See docs/ENGINE.md (swap semantics) and docs/INTEGRATION.md (hook points).
"""

from __future__ import annotations

import functools
import logging
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Dict, Optional

import torch
from sglang.srt.arg_groups.nsa_kv_offload_args import (
    ENV_CROSS_LAYER_PREFETCH,
    ENV_DIRECT_SLOTS,
    ENV_EARLY_SWAP,
    ENV_GATHER_PROGRAMS,
    ENV_IDLE_LOC_UNITS,
    ENV_SLOT_POLICY,
    ENV_SWAP_AFTER_ROPE,
    ENV_WARM_UNITS,
    direct_slots_enabled,
    direct_warm_positions_from_env,
    early_swap_enabled,
    gather_programs_from_env,
    slot_policy_from_env,
    swap_batch_rows,
    swap_query_tokens,
    warm_units_enabled,
    warm_units_refusal,
)
from sglang.srt.managers.nsa_kv_offload_verify import NSAKVOffloadVerifyMixin
from sglang.srt.mem_cache.lru_cache_state import LayerSwapPlan
from sglang.srt.mem_cache.nsa_kv_offload_pool import (
    NSAKVOffloadPoolSizes,
    NSAKVOffloadTokenToKVPool,
    NSAKVOffloadTokenToKVPoolAllocator,
    staging_reserve_rows,
)
from sglang.srt.mem_cache.nsa_kv_offload_shared_host import (
    HostPoolGroup,
    SharedHostLayout,
    open_shared_host_segment,
)
from sglang.srt.mem_cache.nsa_kv_offload_units import (
    IDLE_LOC_UNIT_SOURCE,
    STAGING_UNIT_SOURCE,
    IdleLocUnitLender,
    StagingUnitLender,
    idle_loc_reserve_pages,
    staging_unit_capacity,
)
from sglang.srt.mem_cache.nsa_kv_only_host_pool import NSAKVOnlyTokenToKVPoolHost
from sglang.srt.mem_cache.sparse_cache_controller import SparseCacheController

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

# While idle, the metrics are refreshed at most this often (sglang checks
# its pools at every idle scheduler iteration).
IDLE_METRICS_INTERVAL_S = 1.0


def _pad_rows(page_table: torch.Tensor, rows: int) -> torch.Tensor:
    # The backend pads the top-k to the query rows (TP with partial DP
    # attention); the early swap ran on the indexer's rows.
    if page_table.shape[0] >= rows:
        return page_table
    pad = page_table.new_full((rows - page_table.shape[0], page_table.shape[1]), -1)
    return torch.cat([page_table, pad])


def longest_seq_len(req: Req) -> Optional[int]:
    """The longest ``req`` can grow: its prompt plus ``max_new_tokens`` (the
    scheduler caps that by the context length; None when it is unset)."""
    max_new_tokens = req.sampling_params.max_new_tokens
    if max_new_tokens is None:
        return None
    return len(req.origin_input_ids) + max_new_tokens


class NSAKVOffloadCoordinator(NSAKVOffloadVerifyMixin):
    def __init__(
        self,
        kv_pool: NSAKVOffloadTokenToKVPool,
        allocator: NSAKVOffloadTokenToKVPoolAllocator,
        req_to_token: torch.Tensor,
        sizes: NSAKVOffloadPoolSizes,
        top_k: int,
        buffer_size: int,
        recent_window: int,
        max_batch_size: int,
        kv_arrives_in_host: bool = False,
        cross_layer_prefetch: bool = False,
        max_units: int = 1,
        staging_reserve_pages: int = 0,
        host_pool_group: Optional[HostPoolGroup] = None,
        max_query_tokens: int = 1,
        early_swap: bool = False,
        direct_slots: bool = False,
        warm_units: bool = False,
        copy_flat_programs: Optional[int] = None,
        swap_after_rope: bool = False,
        direct_warm_positions: Optional[int] = None,
        slot_policy: str = "lru",
    ):
        if warm_units:
            why = warm_units_refusal(
                max_units,
                max_query_tokens > 1,
                host_pool_group is not None,
            )
            if why:
                raise ValueError(f"NSA KV offload: {ENV_WARM_UNITS}=1 {why}")
        if cross_layer_prefetch and max_query_tokens > 1:
            # The prefetch swaps one top-k row per request.
            raise ValueError(
                f"NSA KV offload: {ENV_CROSS_LAYER_PREFETCH}=1 does not support "
                "MTP target verify (--speculative-algorithm)"
            )
        if direct_slots and max_query_tokens > 1:
            raise ValueError(
                f"NSA KV offload: {ENV_DIRECT_SLOTS}=1 does not support MTP "
                "target verify (--speculative-algorithm)"
            )
        self.kv_pool = kv_pool
        self.kv_arrives_in_host = kv_arrives_in_host
        # Admissions warm after the next rebalance (warm_admitted), in
        # prepare_decode: req_pool_idx -> the prompt's locs until then.
        self.warm_units = warm_units
        self._deferred_warm: Dict[int, torch.Tensor] = {}
        # The ranks of an attention-TP group share one host pool; its first
        # rank writes it, every rank warms admissions from its staging rows.
        self.shares_host_pool = host_pool_group is not None
        if self.shares_host_pool and kv_arrives_in_host:
            raise ValueError(
                "NSA KV offload: a shared host pool needs colocated prefill (the "
                "PD transfer would write every rank's copy)"
            )
        host_writer = not self.shares_host_pool or host_pool_group.rank_in_group == 0
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.sizes = sizes
        self.top_k = top_k
        self.buffer_size = buffer_size
        self.recent_window = recent_window
        self.device = kv_pool.device

        row_bytes = NSAKVOnlyTokenToKVPoolHost.get_row_bytes(
            kv_pool.kv_cache_dim, kv_pool.store_dtype
        )
        tic = time.perf_counter()
        shared_segment = None
        if self.shares_host_pool:
            shape = NSAKVOnlyTokenToKVPoolHost.buffer_shape(
                sizes.num_locs, kv_pool.page_size, kv_pool.layer_num, row_bytes
            )
            shared_segment = open_shared_host_segment(
                SharedHostLayout(*shape), host_pool_group
            )
        self.host_pool = NSAKVOnlyTokenToKVPoolHost(
            size=sizes.num_locs,
            page_size=kv_pool.page_size,
            layer_num=kv_pool.layer_num,
            row_bytes=row_bytes,
            start_layer=kv_pool.start_layer,
            shared_segment=shared_segment,
        )
        logger.info(
            "NSA KV offload: pinned %.2f GB of host memory for %d token locs x %d "
            "layers x %d B in %.1f s%s.",
            self.host_pool.nbytes / (1 << 30),
            sizes.num_locs,
            kv_pool.layer_num,
            row_bytes,
            time.perf_counter() - tic,
            (
                f" (shared by {host_pool_group.world_size} attention-TP ranks, "
                f"{'the writer' if host_writer else 'a reader'})"
                if self.shares_host_pool
                else ""
            ),
        )
        self.controller = SparseCacheController(
            device_kv_buffers=kv_pool.kv_buffer,
            host_pool=self.host_pool,
            max_num_reqs=req_to_token.shape[0],
            top_k=top_k,
            buffer_size=buffer_size,
            recent_window=recent_window,
            region_start_row=sizes.region_start_row,
            num_regions=sizes.total_regions,
            max_batch_size=max_batch_size,
            max_units=max_units,
            host_writer=host_writer,
            max_query_tokens=max_query_tokens,
            direct_slots=direct_slots,
            direct_warm_positions=direct_warm_positions,
            copy_flat_programs=copy_flat_programs,
            slot_policy=slot_policy,
            extra_units=staging_unit_capacity(
                allocator.staging.num_pages, kv_pool.page_size, buffer_size
            )
            + sizes.idle_loc_units,
        )
        if slot_policy != "lru":
            logger.info(
                "NSA KV offload: %s=%s (experimental): the slots' replacement "
                "keeps a reference bit per slot instead of an LRU order.",
                ENV_SLOT_POLICY,
                slot_policy,
            )
        if copy_flat_programs is not None:
            logger.info(
                "NSA KV offload: flat miss copy (experimental, %s=%d): that many "
                "programs share every request's misses.",
                ENV_GATHER_PROGRAMS,
                copy_flat_programs,
            )
        # Query tokens per request of a target-verify forward (1: no MTP).
        self.max_query_tokens = max_query_tokens
        self.lru = self.controller.lru
        self._lends_idle_locs = max_units > 1 and kv_pool.uses_arena
        if self._lends_idle_locs:
            # The indexer keys of free locs, as KV rows (the arena): before
            # the staging, which every prefill takes back.
            allocator.idle_loc_lender = IdleLocUnitLender(
                allocator, buffer_size, idle_loc_reserve_pages(sizes.num_regions)
            )
            self.controller.add_unit_source(
                IDLE_LOC_UNIT_SOURCE, allocator.idle_loc_lender
            )
            logger.info(
                "NSA KV offload: idle token locs lent as units (%s=0 turns "
                "them off): up to %d units of %d loc pages each, LRU state "
                "for %d.",
                ENV_IDLE_LOC_UNITS,
                kv_pool.num_index_pages // allocator.idle_loc_lender.pages_per_unit,
                allocator.idle_loc_lender.pages_per_unit,
                sizes.idle_loc_units,
            )
        self._lends_staging = max_units > 1 and allocator.staging.num_pages > 0
        if self._lends_staging:
            # Between prefills the staging rows idle: lend them as units.
            self.controller.add_unit_source(
                STAGING_UNIT_SOURCE,
                StagingUnitLender(
                    allocator.staging, buffer_size, staging_reserve_pages
                ),
            )

        # Rows of the batch that are real (CUDA-graph padding rows are inert).
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=self.device)
        # Target verify: its real query tokens (the write-back count).
        self.num_real_tokens = torch.zeros(1, dtype=torch.int32, device=self.device)
        first = kv_pool.start_layer
        self._layer_range = (first, first + kv_pool.layer_num - 1)
        # Static swap outputs, sliced per batch size (CUDA-graph safe).
        self._plan_buffers = self._new_plan_buffers(
            max_batch_size, top_k, max_query_tokens
        )
        self.cross_layer_prefetch = cross_layer_prefetch
        if cross_layer_prefetch:
            # Its own plan buffers and a copy of the top-k it loads: the
            # forward stream moves on while the prefetch stream reads them.
            self._prefetch_plan = self._new_plan_buffers(max_batch_size, top_k)
            self._prefetch_topk = torch.full(
                (max_batch_size, top_k), -1, dtype=torch.int32, device=self.device
            )
            # With the early swap the prefetch runs on the swap's side stream,
            # in order with the swaps (begin_layer_swap).
            self._prefetch_stream, self._prefetch_done = (
                (None, None) if early_swap else self._side_stream()
            )
        self.early_swap = early_swap
        # Page tables of the layers whose swap began early, by layer id
        # (host bookkeeping: set and taken within one forward, or capture).
        self._early_page_tables = {}
        # Where the early swap starts (nsa_offload_hooks.begin_layer_swap):
        # after the layer's indexer, or after its query rope.
        self.swap_after_rope = early_swap and swap_after_rope
        if early_swap:
            self._swap_stream, self._swap_done = self._side_stream()
            logger.info(
                "NSA KV offload: early swap on (each layer's swap and miss copy "
                "start on a side stream after its %s; %s=0 turns it off).",
                (
                    f"query rope, experimental {ENV_SWAP_AFTER_ROPE}=1"
                    if self.swap_after_rope
                    else "indexer"
                ),
                ENV_EARLY_SWAP,
            )
        if warm_units:
            logger.info(
                "NSA KV offload: warm units on (%s=0 turns them off): a request "
                "is warmed after its units are granted, into up to %d "
                "rows per layer instead of %d.",
                ENV_WARM_UNITS,
                max_units * buffer_size,
                min(top_k, buffer_size),
            )
        if direct_slots:
            logger.info(
                "NSA KV offload: direct slots on (%s=0 turns them off): a "
                "request whose context fits its units swaps without the LRU "
                "walk.",
                ENV_DIRECT_SLOTS,
            )
        self.producer_stream = None
        self._last_log_tic = time.perf_counter()
        self.metrics = None  # NSAKVOffloadMetricsCollector with --enable-metrics
        self._last_idle_metrics_tic = float("-inf")

        logger.info(
            "NSA KV offload: %d logical token locs (host capacity %d), %d decode "
            "regions of %d rows (%d LRU + %d window), %d staging rows, %d GPU KV "
            "rows per layer%s.",
            sizes.num_locs,
            sizes.host_capacity_locs,
            sizes.num_regions,
            sizes.region_rows,
            buffer_size,
            recent_window,
            sizes.staging_rows,
            kv_pool.kv_buffer[0].shape[0],
            (
                f"; {sizes.num_spare_regions} spare regions, lent as units only"
                if sizes.num_spare_regions
                else ""
            ),
        )
        if max_units > 1:
            lru = self.controller.lru
            logger.info(
                "NSA KV offload: up to %d units of %d LRU rows per request; LRU "
                "state for %d units (regions and units the staging may lend), "
                "%.2f GB.",
                max_units,
                buffer_size,
                lru.num_units,
                lru.unit_state_bytes / (1 << 30),
            )

    def _side_stream(self):
        """A second CUDA stream and one event per layer of this rank (both
        None off CUDA: the work then runs inline)."""
        if torch.device(self.device).type != "cuda":
            return None, None
        events = [torch.cuda.Event() for _ in range(self.kv_pool.layer_num)]
        return torch.cuda.Stream(self.device), events

    def _new_plan_buffers(self, rows: int, k: int, q: int = 1) -> LayerSwapPlan:
        """For ``rows`` requests of up to ``q`` query tokens: a page-table row
        per query token, one copy list of ``q * k`` per request."""

        def buf(shape, dtype, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=self.device)

        return LayerSwapPlan(
            page_table=buf((rows * q, k), torch.int32, -1),
            miss_src_loc=buf((rows, q * k), torch.int64),
            miss_dst_row=buf((rows, q * k), torch.int32),
            miss_count=buf((rows,), torch.int32),
        )

    # ------------------------------------------------------------ scheduling

    def set_producer_stream(self, stream) -> None:
        """The stream forwards run on (the scheduler's forward stream)."""
        self.producer_stream = stream

    def _wait_producer(self) -> None:
        # An overlapped forward may still read or write rows and LRU state.
        if self.producer_stream is not None:
            torch.cuda.current_stream().wait_stream(self.producer_stream)

    def is_admitted(self, req: Req) -> bool:
        return self.controller.is_admitted(req.req_pool_idx)

    def admit(
        self,
        req: Req,
        num_tokens: int,
        defer_warm: bool = False,
        keep_staging: bool = False,
    ) -> Optional[torch.Tensor]:
        """Back up the prompt (unless the KV transfer already put it in host
        memory), give ``req`` a region and free its staging rows (with
        ``keep_staging`` the caller frees them). With ``defer_warm`` (warm
        units) nothing is warmed yet: returns the prompt's locs for
        ``controller.warm_admitted`` after the rebalance."""
        r = req.req_pool_idx
        if self.controller.is_admitted(r):
            return None
        self._wait_producer()
        locs = self.req_to_token[r, :num_tokens].to(torch.int64)
        rows = None
        if not self.kv_arrives_in_host:
            rows = self.kv_pool.loc_to_row[locs]
            # The host writer only, when the host pool is shared.
            self.controller.backup_prefilled_request(rows, locs)
        base = self.controller.admit_request(
            r,
            prefix_locs=None if defer_warm else locs,
            prefix_rows=rows if self.shares_host_pool else None,
            max_seq_len=longest_seq_len(req),
        )
        if base is None:
            raise RuntimeError(
                "NSA KV offload: no free decode region for request "
                f"{req.rid} ({self.sizes.num_regions} regions); this is a bug: "
                "regions are sized by --max-running-requests."
            )
        if not keep_staging:
            # Later forwards wait for the backup before writing staging rows
            # again.
            self.allocator.release_staging(locs)
        return locs if defer_warm else None

    def admit_prefilled_batch(self, batch: ScheduleBatch, chunked_req) -> None:
        """Right after a prefill forward is enqueued: admit every request whose
        prompt it completes (all but the scheduler's current chunked request).
        The copies are ordered after that forward on the GPU."""
        reqs = [
            req
            for req in batch.reqs
            if req is not chunked_req and not self.is_admitted(req)
        ]
        if not self.warm_units or not reqs:
            for req in reqs:
                self._admit_for_decode(req, len(req.fill_ids))
            return
        # Warm units: the prompts' KV is in their staging rows until they are
        # freed, so the units are granted now and filled from those rows on
        # the GPU, not read back over PCIe from the backups.
        staged = []
        for req in reqs:
            locs = self.admit(
                req, len(req.fill_ids), defer_warm=True, keep_staging=True
            )
            staged.append((req.req_pool_idx, locs))
        self._rebalance_if_wanted()
        for r, locs in staged:
            rows = self.kv_pool.loc_to_row[locs]
            self.controller.warm_admitted(r, locs, prefix_rows=rows)
            self.allocator.release_staging(locs)

    def _admit_for_decode(self, req: Req, num_tokens: int) -> None:
        """Admit ``req``; with warm units its warm-up waits for prepare_decode."""
        locs = self.admit(req, num_tokens, defer_warm=self.warm_units)
        if locs is not None:
            self._deferred_warm[req.req_pool_idx] = locs

    def _rebalance_if_wanted(self) -> None:
        if self.controller.wants_rebalance():
            # Growing rewrites LRU order an overlapped forward may still swap.
            self._wait_producer()
            self.controller.rebalance()

    def prepare_decode(self, batch: ScheduleBatch) -> None:
        """After ``prepare_for_decode`` allocated ``out_cache_loc`` and advanced
        ``seq_lens``: admit new requests and map the new tokens to ring rows."""
        for i, req in enumerate(batch.reqs):
            if not self.is_admitted(req):
                self._admit_for_decode(req, int(batch.seq_lens_cpu[i]) - 1)
        self._rebalance_if_wanted()
        # Warm units: the backups and transfers of these prompts are ordered
        # before the warm copies (side-stream issue order).
        for r, locs in self._deferred_warm.items():
            self.controller.warm_admitted(r, locs)
        self._deferred_warm.clear()
        self.lru.map_new_tokens(
            batch.req_pool_indices,
            batch.seq_lens,
            batch.out_cache_loc,
            self.kv_pool.loc_to_row,
        )

    def reclaim_staging(self, num_pages: int) -> bool:
        """A prefill needs ``num_pages`` staging pages: take staging units back
        until they are free. False when that is not enough."""
        if not self._lends_staging:
            return False
        self._wait_producer()
        staging = self.allocator.staging
        return self.controller.reclaim_units_of(
            STAGING_UNIT_SOURCE, lambda: staging.available_pages() >= num_pages
        )

    def reclaim_idle_locs(self, num_pages: int) -> bool:
        """A loc allocation needs ``num_pages`` free pages: take units lent
        from free locs back until they are free. False when that is not
        enough."""
        if not self._lends_idle_locs:
            return False
        self._wait_producer()
        allocator = self.allocator
        return self.controller.reclaim_units_of(
            IDLE_LOC_UNIT_SOURCE, lambda: allocator.free_page_count() >= num_pages
        )

    def release(self, req: Req) -> None:
        """Finish, abort or retract: free the region and LRU state of ``req``.
        Its token locs (= host slots) and staging pages are freed by the token
        allocator right after."""
        r = req.req_pool_idx
        if r is None or not self.controller.is_admitted(r):
            return
        self._deferred_warm.pop(r, None)  # finished at its prefill
        self._wait_producer()
        self.controller.release_request(r)

    def synchronize(self) -> None:
        """Block until every forward and copy issued so far is done (before
        the host reads or rewrites host slots itself: PD retraction)."""
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        self.controller.synchronize()

    # -------------------------------------------------------------- forward

    def before_forward(self, forward_batch: ForwardBatch) -> None:
        # Host rows written by prefill backups and region rows warmed at
        # admission are read by this forward; staging rows read by backups may
        # be rewritten.
        self.controller.wait_backup()

    def begin_layer_swap(
        self, layer_id: int, topk_positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> None:
        """With the early swap: start this layer's decode or verify swap and
        miss copy (on the side stream on CUDA, inline elsewhere);
        ``swap_decode_layer`` / ``swap_verify_layer`` then wait for them
        instead of running them. With the cross-layer prefetch too, the same
        stream then loads this top-k into the next layer's LRU slots, beside
        this layer's attention and MLP and before the next layer's swap."""
        if not self.early_swap:
            return
        mode = forward_batch.forward_mode
        first, last = self._layer_range
        # A decode swap's recency update (lru_order only) runs after its
        # event, beside the attention; the next layer's swap, later on this
        # stream, joins it. The last layer's has no later swap to join it
        # into the forward stream, so it runs before the event.
        defer_reorder = mode.is_decode() and layer_id < last
        if mode.is_decode():
            swap = functools.partial(self._swap_into_plan, defer_reorder=defer_reorder)
        elif mode.is_target_verify() and self.max_query_tokens > 1:
            swap = self._verify_swap_into_plan
        else:
            return
        if layer_id == first:
            self._early_page_tables.clear()  # nothing carried over a forward
        prefetch = self.cross_layer_prefetch and mode.is_decode() and layer_id < last
        # On CUDA the side stream starts after the top-k; it also runs the
        # first layer's real-row counts, which the forward stream reads only
        # at the last layer's write-back. The forward stream waits for it in
        # the swap hook, while the top-k tensor is still referenced there:
        # nothing it reads is freed early, and CUDA-graph capture sees the
        # fork joined. The prefetch reads a copy of the top-k made before that
        # join; the next layer's swap, later on this stream, joins it (the
        # last layer has none). Elsewhere all of it runs inline.
        stream = self._swap_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            page_table = swap(layer_id, topk_positions, forward_batch)
            staged = self._stage_prefetch(topk_positions) if prefetch else None
            if stream is not None:
                self._swap_done[layer_id - first].record(stream)
            if defer_reorder:
                self.controller.finish_lru_reorder()
            if prefetch:
                self._prefetch(layer_id + 1, staged, forward_batch)
        self._early_page_tables[layer_id] = page_table

    def _take_early_page_table(
        self, layer_id: int, rows: int
    ) -> Optional[torch.Tensor]:
        """The page table of this layer's early swap (the forward stream
        waits for it), or None when its swap has not begun."""
        page_table = self._early_page_tables.pop(layer_id, None)
        if page_table is None:
            return None
        if self._swap_stream is not None:
            torch.cuda.current_stream().wait_event(
                self._swap_done[layer_id - self._layer_range[0]]
            )
        return _pad_rows(page_table, rows)

    def _swap_into_plan(
        self,
        layer_id: int,
        topk_positions: torch.Tensor,
        forward_batch: ForwardBatch,
        defer_reorder: bool = False,
    ) -> torch.Tensor:
        if layer_id == self._layer_range[0]:
            self._count_real_rows(forward_batch.out_cache_loc)
        bs = topk_positions.shape[0]
        out = LayerSwapPlan(*(t[:bs] for t in self._plan_buffers))
        return self.controller.swap_one_layer(
            layer_id,
            topk_positions,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            self.req_to_token,
            self.num_real_reqs,
            out=out,
            defer_lru_reorder=defer_reorder,
        )

    def swap_decode_layer(
        self, layer_id: int, topk_positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Positions of the indexer's top-k -> GPU rows in top-k order, after
        loading the misses of this layer."""
        first, last = self._layer_range
        page_table = self._take_early_page_table(layer_id, topk_positions.shape[0])
        if page_table is not None:
            if layer_id == last:
                self._write_back_new_tokens(forward_batch.out_cache_loc)
            return page_table
        prefetch = self.cross_layer_prefetch
        if prefetch and self._prefetch_stream is not None:
            if layer_id > first:
                # The previous layer's prefetch into this layer is done.
                torch.cuda.current_stream().wait_event(
                    self._prefetch_done[layer_id - first]
                )
        page_table = self._swap_into_plan(layer_id, topk_positions, forward_batch)
        if prefetch and layer_id < last:
            self._prefetch_next_layer(layer_id + 1, topk_positions, forward_batch)
        if layer_id == last:
            self._write_back_new_tokens(forward_batch.out_cache_loc)
        return page_table

    def _count_real_rows(
        self, out_cache_loc: torch.Tensor, out: Optional[torch.Tensor] = None
    ) -> None:
        # CUDA-graph padding rows have out_cache_loc 0 (sglang zeroes it; loc 0
        # is never a request's), so the real rows are counted on the GPU.
        torch.sum(
            out_cache_loc != 0,
            dim=0,
            keepdim=True,
            dtype=torch.int32,
            out=self.num_real_reqs if out is None else out,
        )

    def _write_back_new_tokens(self, out_cache_loc: torch.Tensor) -> None:
        # Every layer has written this step's new KV to its window rows (the
        # backend saves a layer's KV before its swap); one all-layer copy on
        # the forward stream, a few us of GPU time inside the graph.
        rows = self.kv_pool.loc_to_row[out_cache_loc]
        self.controller.write_back_new_tokens(rows, out_cache_loc, self.num_real_reqs)

    def _stage_prefetch(self, topk_positions: torch.Tensor) -> torch.Tensor:
        # The prefetch's own copy of the top-k: the forward stream moves on
        # (and frees the original) while the prefetch reads it.
        topk = self._prefetch_topk[: topk_positions.shape[0]]
        topk.copy_(topk_positions)
        return topk

    def _prefetch(self, layer_id: int, topk: torch.Tensor, forward_batch) -> None:
        # Load another layer's top-k into this layer's LRU slots, on the
        # current stream.
        out = LayerSwapPlan(*(t[: topk.shape[0]] for t in self._prefetch_plan))
        args = (
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            self.req_to_token,
            self.num_real_reqs,
        )
        self.controller.prefetch_one_layer(layer_id, topk, *args, out=out)

    def _prefetch_next_layer(
        self, layer_id: int, topk_positions, forward_batch: ForwardBatch
    ) -> None:
        # The inline swap's prefetch: on its own stream, forked after this
        # layer's swap (its LRU scratch and the top-k copy are ready) and
        # joined by the next layer's swap, inside the same forward, so
        # CUDA-graph capture sees every fork joined.
        topk = self._stage_prefetch(topk_positions)
        stream = self._prefetch_stream
        if stream is None:  # CPU, or no stream of its own: inline
            self._prefetch(layer_id, topk, forward_batch)
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._prefetch(layer_id, topk, forward_batch)
            self._prefetch_done[layer_id - self._layer_range[0]].record(stream)

    def check_idle(self) -> str:
        """The offload's leaks when the scheduler is idle, as one message
        (empty when none): decode regions, lent units and prefill staging
        rows must all be back. Host slots are token locs: sglang's own check
        of the token pool covers them."""
        leaks = self.controller.idle_leaks()
        staging = self.allocator.staging
        if staging.available_pages() != staging.num_pages:
            leaks.append(
                f"staging pages free: {staging.available_pages()} of {staging.num_pages}"
            )
        self._refresh_idle_metrics()
        return "; ".join(leaks)

    def _refresh_idle_metrics(self) -> None:
        """Without decode there is no decode log to feed the metrics: at idle,
        the gauges would keep the last busy interval's state and the counters
        miss its tail. Read them once the scheduler goes idle (at most once a
        second while it stays so)."""
        if self.metrics is None:
            return
        now = time.perf_counter()
        if now - self._last_idle_metrics_tic < IDLE_METRICS_INTERVAL_S:
            return
        self._last_idle_metrics_tic = now
        self.get_stats()

    # ---------------------------------------------------------------- stats

    def enable_metrics(self, labels, registry=None) -> None:
        """Export the offload's counters and gauges to Prometheus, labelled
        like the scheduler's metrics; fed at each decode log line."""
        from sglang.srt.observability.nsa_kv_offload_metrics import (
            NSAKVOffloadMetricsCollector,
        )

        self.metrics = NSAKVOffloadMetricsCollector(labels, registry)

    def get_stats(self) -> dict:
        """The controller's counters since the last read, and the host pool's
        and staging rows' use (syncs: for logs and metrics)."""
        stats = self.controller.get_stats()
        self.controller.reset_stats()
        staging = self.allocator.staging
        # Host slot = token loc: the host pool holds what the allocator lent.
        stats["host_total_tokens"] = self.allocator.size
        stats["host_used_tokens"] = (
            self.allocator.size - self.allocator.available_size()
        )
        stats["staging_total_rows"] = staging.num_pages * staging.page_size
        stats["staging_used_rows"] = (
            staging.num_pages - staging.available_pages()
        ) * staging.page_size
        if self.metrics is not None:
            self.metrics.observe(stats)
        return stats

    def get_decode_log_msg(self) -> str:
        """`, nsa-offload ...` suffix of the decode log line (syncs; logging only)."""
        stats = self.get_stats()
        now = time.perf_counter()
        gap = max(now - self._last_log_tic, 1e-9)
        self._last_log_tic = now
        lookups = stats["lru_hits"] + stats["window_hits"] + stats["misses"]
        prefetched = (
            f"prefetched: {stats['prefetched']}, " if self.cross_layer_prefetch else ""
        )
        return (
            f", nsa-offload hit rate: "
            f"{(lookups - stats['misses']) / max(lookups, 1):.3f}, "
            f"misses: {stats['misses']}, {prefetched}"
            f"H2D: {stats['h2d_bytes'] / gap / 1e9:.2f} GB/s, "
            f"regions: {stats['regions_used']}/{stats['regions_total']}"
            + (
                f", extra units: {stats['extra_units']} "
                f"({stats['extra_units_lent']} of staging, "
                f"{stats['units_moved']} moved"
                + (
                    f", {stats['idle_loc_units_lent']} of idle locs)"
                    if self._lends_idle_locs
                    else ")"
                )
                + f", units per request: {stats['fewest_units']}-{stats['most_units']}"
                + (
                    f", units reclaimed: {stats['units_reclaimed']} "
                    f"({stats['units_kept']} kept by a copy)"
                    if stats["units_reclaimed"]
                    else ""
                )
                if self.controller.max_units > 1
                else ""
            )
            + (
                f", direct: {stats['direct_requests']}"
                if self.controller.lru.direct_slots
                else ""
            )
            + (
                f", warmed: {stats['warmed_requests']} "
                f"({stats['warmed_bytes'] / 1e9:.2f} GB)"
                if stats["warmed_requests"]
                else ""
            )
        )


# ------------------------------------------------------------ model runner glue


def nsa_kv_offload_pool_kwargs(model_runner) -> dict:
    """Extra kwargs of the NSA KV pool with the offload on: its layout for the
    resolved token and request counts, computed once by the configurator that
    sized the pools (carried by ``memory_pool_config``). The allocator and the
    coordinator read it from the pool (``sizes``)."""
    configurator = model_runner.memory_pool_config.nsa_kv_offload_configurator
    sizes = configurator.final_sizes(
        num_locs=model_runner.max_total_num_tokens,
        num_regions=model_runner.max_running_requests,
        page_size=model_runner.page_size,
    )
    return {"sizes": sizes}


def create_nsa_kv_offload_allocator(model_runner, need_sort: bool):
    sizes = model_runner.token_to_kv_pool.sizes
    return NSAKVOffloadTokenToKVPoolAllocator(
        model_runner.max_total_num_tokens,
        page_size=model_runner.page_size,
        dtype=model_runner.kv_cache_dtype,
        device=model_runner.device,
        kvcache=model_runner.token_to_kv_pool,
        need_sort=need_sort,
        staging_start_row=sizes.staging_start_row,
        staging_rows=sizes.staging_rows,
        speculative=model_runner.server_args.speculative_algorithm is not None,
    )


def cuda_graph_coverage_warning(server_args, num_regions: int) -> Optional[str]:
    """A warning when decode batches can outgrow the captured CUDA graphs: the
    offload's decode regions allow more running requests than upstream's
    default ``--cuda-graph-max-bs``, and larger batches then run eagerly (on
    the H200, 12.5 ms instead of ~4 ms per step at 257 requests)."""
    max_bs = server_args.cuda_graph_max_bs
    if server_args.disable_cuda_graph or not max_bs or num_regions <= max_bs:
        return None
    return (
        f"NSA KV offload: {num_regions} decode regions (--max-running-requests) but "
        f"CUDA graphs only up to batch {max_bs}: decode batches above it run "
        f"without CUDA graphs, several times slower per step; set "
        f"--cuda-graph-max-bs {num_regions} to capture them all."
    )


def create_nsa_kv_offload_coordinator(model_runner) -> NSAKVOffloadCoordinator:
    """The coordinator of the model runner's pools. ModelRunner keeps it
    (``nsa_kv_offload``) and builds it before its attention backends, which
    are handed it at construction; the scheduler takes it from there."""
    from sglang.srt.arg_groups.nsa_kv_offload_args import NSAKVOffloadRankLayout
    from sglang.srt.utils import get_bool_env_var

    sa = model_runner.server_args
    max_batch_size = swap_batch_rows(sa, model_runner.max_running_requests)
    speculative = sa.speculative_algorithm is not None
    host_pool_group = None
    if NSAKVOffloadRankLayout.from_server_args(sa).attn_tp_size > 1:
        # Same KV on every rank of the group: one host pool per node.
        from sglang.srt.layers.dp_attention import get_attention_tp_group

        host_pool_group = get_attention_tp_group()
    kv_pool = model_runner.token_to_kv_pool
    allocator = model_runner.token_to_kv_pool_allocator
    sizes = kv_pool.sizes
    geometry = sizes.geometry
    logger.info(
        "NSA KV offload: requests held at once by length (prompt + output): %s; "
        "--max-running-requests trades decode regions for token locs.",
        sizes.describe_capacity(model_runner.model_config.context_len),
    )
    warning = cuda_graph_coverage_warning(sa, model_runner.max_running_requests)
    if warning:
        logger.warning(warning)
    coordinator = NSAKVOffloadCoordinator(
        kv_pool=kv_pool,
        allocator=allocator,
        req_to_token=model_runner.req_to_token_pool.req_to_token,
        sizes=sizes,
        top_k=geometry.top_k,
        buffer_size=geometry.buffer_size,
        recent_window=geometry.recent_window,
        max_batch_size=max_batch_size,
        kv_arrives_in_host=sa.disaggregation_mode == "decode",
        cross_layer_prefetch=get_bool_env_var(ENV_CROSS_LAYER_PREFETCH),
        early_swap=early_swap_enabled(),
        direct_slots=direct_slots_enabled(speculative),
        warm_units=warm_units_enabled(
            geometry.max_units, speculative, host_pool_group is not None
        ),
        copy_flat_programs=gather_programs_from_env(),
        swap_after_rope=get_bool_env_var(ENV_SWAP_AFTER_ROPE),
        direct_warm_positions=direct_warm_positions_from_env(),
        slot_policy=slot_policy_from_env(),
        max_units=geometry.max_units,
        # Lend at most the staging kept for one long prompt being chunked.
        staging_reserve_pages=staging_reserve_rows(
            max(sa.chunked_prefill_size or 0, sa.max_prefill_tokens),
            sizes.num_regions,
            model_runner.page_size,
        )
        // model_runner.page_size,
        host_pool_group=host_pool_group,
        max_query_tokens=swap_query_tokens(sa),
    )
    # The pools' one link back (see NSAKVOffloadTokenToKVPoolAllocator), for
    # sglang code that holds only the allocator (get_nsa_kv_offload).
    allocator.nsa_kv_offload = coordinator
    return coordinator
