"""Request lifecycle and forward hooks of the decode NSA KV offload.

One ``NSAKVOffloadCoordinator`` per rank owns the ``SparseCacheController``
and connects it to sglang: admission after the forward that completes a
prompt, every decode preparation (rebalance, new locs to ring rows), every
decode forward (each layer's swap on a side stream once its top-k exists; the
last layer writes the new tokens back) and finish / abort / retract
(docs/INTEGRATION.md, "Lifecycle"; docs/ENGINE.md).
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Dict, Optional

import torch
from sglang.srt.arg_groups.nsa_kv_offload_hook import (
    NSAKVOffloadOptions,
    NSAKVOffloadRankLayout,
)
from sglang.srt.managers.nsa_kv_offload_mtp import NSAKVOffloadMTPMixin
from sglang.srt.mem_cache.lru_cache_state import LayerSwapPlan
from sglang.srt.mem_cache.nsa_kv_offload_compat import (
    CUDA_GRAPH_MAX_BS_FIELD,
    decode_cuda_graph_max_bs,
    kv_committed_len,
    req_pool_idx,
)
from sglang.srt.mem_cache.nsa_kv_offload_shared_host import (
    SharedHostLayout,
    open_shared_host_segment,
)
from sglang.srt.mem_cache.nsa_kv_offload_sizing import (
    staging_reserve_rows,
    swap_batch_rows,
)
from sglang.srt.mem_cache.nsa_kv_offload_units import (
    IDLE_LOC_UNIT_SOURCE,
    STAGING_UNIT_SOURCE,
    IdleLocUnitLender,
    StagingUnitLender,
    idle_loc_reserve_pages,
    staging_unit_capacity,
)
from sglang.srt.mem_cache.nsa_kv_offload_verify import NSAKVOffloadVerifier
from sglang.srt.mem_cache.nsa_kv_only_host_pool import NSAKVOnlyTokenToKVPoolHost
from sglang.srt.mem_cache.sparse_cache_controller import SparseCacheController
from sglang.srt.observability.nsa_kv_offload_metrics import (
    NSAKVOffloadMetricsCollector,
    decode_log_suffix,
)

logger = logging.getLogger(__name__)

IDLE_METRICS_INTERVAL_S = 1.0  # the most often metrics refresh while idle


def longest_seq_len(req) -> Optional[int]:
    """Prompt plus ``max_new_tokens`` of ``req`` (None when unset)."""
    n = req.sampling_params.max_new_tokens
    return None if n is None else len(req.origin_input_ids) + n


class NSAKVOffloadCoordinator(NSAKVOffloadMTPMixin):
    """The offload of one rank (module doc). ``host_pool_group``: the
    attention-TP group sharing one host pool (its first rank writes it)."""

    def __init__(
        self,
        kv_pool,
        allocator,
        req_to_token: torch.Tensor,
        options: NSAKVOffloadOptions,
        max_batch_size: int,
        staging_reserve_pages: int = 0,
        host_pool_group=None,
    ):
        self.kv_pool = kv_pool
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.options = options
        self.sizes = sizes = kv_pool.sizes
        self.device = kv_pool.device
        self._host_pool_group = host_pool_group
        self.host_pool = self._create_host_pool(host_pool_group)
        kv_pool.host_pool = self.host_pool
        writer = host_pool_group is None or host_pool_group.rank_in_group == 0
        self.controller = SparseCacheController(
            device_kv_buffers=kv_pool.kv_buffer,
            host_pool=self.host_pool,
            max_num_reqs=req_to_token.shape[0],
            top_k=options.top_k,
            buffer_size=options.buffer_size,
            recent_window=options.recent_window,
            region_start_row=sizes.region_start_row,
            num_regions=sizes.total_regions,
            max_batch_size=max_batch_size,
            max_units=options.max_units,
            host_writer=writer,
            max_query_tokens=options.query_tokens,
            direct_slots=options.direct_slots,
            extra_units=sizes.idle_loc_units
            + staging_unit_capacity(
                allocator.staging.num_pages, kv_pool.page_size, options.buffer_size
            ),
        )
        self.lru = self.controller.lru
        self._add_lenders(staging_reserve_pages)
        self.verifier = None
        if options.verify:
            self.verifier = NSAKVOffloadVerifier(kv_pool, req_to_token, options.verify)
        # req_pool_idx -> prompt locs, warmed after prepare_decode's rebalance.
        self._deferred_warm: Dict[int, torch.Tensor] = {}
        # Real (not CUDA-graph padding) rows and, with MTP, query tokens.
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.num_real_tokens = torch.zeros(1, dtype=torch.int32, device=self.device)
        first = kv_pool.start_layer
        self._layer_range = (first, first + kv_pool.layer_num - 1)
        self._plan_buffers = self._new_plan_buffers(
            max_batch_size, options.top_k, options.query_tokens
        )
        self._early_page_tables = {}  # layer id -> its early swap's page table
        self._swap_stream, self._swap_done = None, None
        if torch.device(self.device).type == "cuda":
            self._swap_stream = torch.cuda.Stream(self.device)
            self._swap_done = [torch.cuda.Event() for _ in range(kv_pool.layer_num)]
        self.producer_stream = None
        self.metrics = None  # with --enable-metrics (enable_metrics)
        self._last_log_tic = time.perf_counter()
        self._last_idle_metrics_tic = float("-inf")

    def _create_host_pool(self, group) -> NSAKVOnlyTokenToKVPoolHost:
        kv_pool, num_locs = self.kv_pool, self.sizes.num_locs
        host_cls = NSAKVOnlyTokenToKVPoolHost
        row_bytes = host_cls.get_row_bytes(kv_pool.kv_cache_dim, kv_pool.store_dtype)
        segment = None
        if group is not None:
            layers = kv_pool.layer_num
            shape = host_cls.buffer_shape(
                num_locs, kv_pool.page_size, layers, row_bytes
            )
            segment = open_shared_host_segment(SharedHostLayout(*shape), group)
        tic = time.perf_counter()
        host_pool = host_cls(
            size=num_locs,
            page_size=kv_pool.page_size,
            layer_num=kv_pool.layer_num,
            row_bytes=row_bytes,
            start_layer=kv_pool.start_layer,
            shared_segment=segment,
        )
        self._pin_seconds = time.perf_counter() - tic
        return host_pool

    def _add_lenders(self, staging_reserve_pages: int) -> None:
        # After the free regions: free locs' keys, then idle staging.
        allocator, o = self.allocator, self.options
        add = self.controller.add_unit_source
        self.lends_idle_locs = o.max_units > 1 and self.kv_pool.uses_arena
        if self.lends_idle_locs:
            reserve = idle_loc_reserve_pages(self.sizes.num_regions)
            lender = IdleLocUnitLender(allocator, o.buffer_size, reserve)
            allocator.idle_loc_lender = lender
            add(IDLE_LOC_UNIT_SOURCE, lender)
            allocator.reclaim_idle_locs = self.reclaim_idle_locs
        if o.max_units > 1 and allocator.staging.num_pages > 0:
            reserve = staging_reserve_pages
            lender = StagingUnitLender(allocator.staging, o.buffer_size, reserve)
            add(STAGING_UNIT_SOURCE, lender)
            allocator.reclaim_staging = self.reclaim_staging

    def _new_plan_buffers(self, rows: int, k: int, q: int) -> LayerSwapPlan:
        # A page-table row per query token, a copy list of q * k per request.
        def buf(shape, dtype, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=self.device)

        return LayerSwapPlan(
            page_table=buf((rows * q, k), torch.int32, -1),
            miss_src_loc=buf((rows, q * k), torch.int64),
            miss_dst_row=buf((rows, q * k), torch.int32),
            miss_count=buf((rows,), torch.int32),
        )

    def describe(self) -> str:
        """The startup log line: what the offload holds per request and rank."""
        o, s = self.options, self.sizes
        text = (
            f"Decode NSA KV offload: {o.buffer_size} LRU rows + {o.recent_window} "
            f"recent-window rows per request per layer (index_topk={o.top_k}), up to "
            f"{o.max_units} x {o.buffer_size} LRU rows while GPU memory is idle; "
            f"{s.num_locs} token locs (host capacity {s.host_capacity_locs}), "
            f"{s.num_regions} decode regions, {s.num_spare_regions} spare regions, "
            f"{s.staging_rows} staging rows, {s.idle_loc_units} idle-loc units; "
            f"host pool {self.host_pool.nbytes / (1 << 30):.2f} GB pinned in "
            f"{self._pin_seconds:.1f} s"
        )
        if self._host_pool_group is not None:
            text += f", shared by {self._host_pool_group.world_size} attention-TP ranks"
        optional = {
            "warm units": o.warm_units,
            "direct slots": o.direct_slots,
            f"MTP verify of {o.query_tokens} tokens": o.query_tokens > 1,
            f"verify mode ({o.verify})": o.verify,
        }
        features = ["early swap"] + [name for name, on in optional.items() if on]
        return text + "; " + ", ".join(features) + "."

    def set_producer_stream(self, stream) -> None:
        """The stream forwards run on (the scheduler's forward stream)."""
        self.producer_stream = stream

    def _wait_producer(self) -> None:
        # An overlapped forward may still read or write rows and LRU state.
        if self.producer_stream is not None:
            torch.cuda.current_stream().wait_stream(self.producer_stream)

    def is_admitted(self, req) -> bool:
        return self.controller.is_admitted(req_pool_idx(req))

    def admit(self, req, num_tokens: int, defer_warm=False, keep_staging=False):
        """Back the prompt up (unless the transfer put it in host memory), give
        ``req`` a region and free its staging rows (``keep_staging``: the
        caller does). ``defer_warm``: nothing is warmed yet; returns the
        prompt's locs for ``controller.warm_admitted`` after the rebalance."""
        r = req_pool_idx(req)
        if self.controller.is_admitted(r):
            return None
        self._wait_producer()
        locs = self.req_to_token[r, :num_tokens].to(torch.int64)
        rows = None
        if self.options.kv_arrives_in_host:
            if self.verifier is not None:
                self.verifier.fill_from_host(self.host_pool, locs)
        else:
            rows = self.kv_pool.loc_to_row[locs]
            self.controller.backup_prefilled_request(rows, locs)
        base = self.controller.admit_request(
            r,
            prefix_locs=None if defer_warm else locs,
            prefix_rows=rows if self.options.shares_host_pool else None,
            max_seq_len=longest_seq_len(req),
        )
        if base is None:
            raise RuntimeError(
                f"NSA KV offload: no free decode region for request {req.rid} "
                f"({self.sizes.num_regions} regions); this is a bug: regions are "
                "sized by --max-running-requests."
            )
        if not keep_staging:
            # Later forwards wait for the backup before reusing staging rows.
            self.allocator.release_staging(locs)
        return locs if defer_warm else None

    def admit_prefilled_batch(self, batch, chunked_req) -> None:
        """After a prefill forward is enqueued: admit the requests whose prompt it
        completes (all but the chunked one; the copies are ordered after it)."""
        reqs = [
            r for r in batch.reqs if r is not chunked_req and not self.is_admitted(r)
        ]
        if not self.options.warm_units:
            for req in reqs:
                self._admit_for_decode(req, kv_committed_len(req))
            return
        # Warm units: grant units now, fill them from the staging rows.
        staged = [
            (req_pool_idx(req), self.admit(req, kv_committed_len(req), True, True))
            for req in reqs
        ]
        self._rebalance_if_wanted()
        for r, locs in staged:
            rows = self.kv_pool.loc_to_row[locs]
            self.controller.warm_admitted(r, locs, prefix_rows=rows)
            self.allocator.release_staging(locs)

    def _admit_for_decode(self, req, num_tokens: int) -> None:
        locs = self.admit(req, num_tokens, defer_warm=self.options.warm_units)
        if locs is not None:
            self._deferred_warm[req_pool_idx(req)] = locs

    def _rebalance_if_wanted(self) -> None:
        if self.controller.wants_rebalance():
            # Growing rewrites LRU order an overlapped forward may still swap.
            self._wait_producer()
            self.controller.rebalance()

    def prepare_decode(self, batch) -> None:
        """After ``prepare_for_decode`` allocated ``out_cache_loc`` and advanced
        ``seq_lens``: admit new requests, rebalance, warm, map the new tokens."""
        self._check_verify()
        for i, req in enumerate(batch.reqs):
            if not self.is_admitted(req):
                self._admit_for_decode(req, int(batch.seq_lens_cpu[i]) - 1)
        self._rebalance_if_wanted()
        # Backups come before the warm copies (side-stream issue order).
        for r, locs in self._deferred_warm.items():
            self.controller.warm_admitted(r, locs)
        self._deferred_warm.clear()
        self.lru.map_new_tokens(
            batch.req_pool_indices,
            batch.seq_lens,
            batch.out_cache_loc,
            self.kv_pool.loc_to_row,
        )

    def _reclaim(self, source: str, enough) -> bool:
        self._wait_producer()
        return self.controller.reclaim_units_of(source, enough)

    def reclaim_staging(self, num_pages: int) -> bool:
        """Take staging units back until ``num_pages`` are free; False if not enough."""
        staging = self.allocator.staging
        return self._reclaim(
            STAGING_UNIT_SOURCE, lambda: staging.available_pages() >= num_pages
        )

    def reclaim_idle_locs(self, num_pages: int) -> bool:
        """Take idle-loc units back until ``num_pages`` are free (False: not enough)."""
        return self._reclaim(
            IDLE_LOC_UNIT_SOURCE, lambda: self.allocator.free_page_count() >= num_pages
        )

    def release(self, req) -> None:
        """Finish, abort or retract: free the region and LRU state of ``req``."""
        r = req_pool_idx(req)
        if r is None or not self.controller.is_admitted(r):
            return
        self._deferred_warm.pop(r, None)  # finished at its prefill
        self._wait_producer()
        self.controller.release_request(r)

    def before_forward(self, forward_batch) -> None:
        # This forward reads backed-up host rows and warmed region rows.
        self.controller.wait_backup()

    def begin_layer_swap(self, layer_id: int, topk_positions, forward_batch) -> None:
        """Start this decode or verify layer's swap on the side stream."""
        mode = forward_batch.forward_mode
        first, last = self._layer_range
        if mode.is_decode():
            swap = self._swap_into_plan
        elif mode.is_target_verify() and self.options.query_tokens > 1:
            swap = self._verify_swap_into_plan
        else:
            return
        if layer_id == first:
            self._early_page_tables.clear()  # nothing carried over a forward
        # Decode: the recency update runs after the event (docs/ENGINE.md).
        defer = mode.is_decode() and layer_id < last
        stream = self._swap_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        args = (defer,) if mode.is_decode() else ()
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            page_table = swap(layer_id, topk_positions, forward_batch, *args)
            if stream is not None:
                self._swap_done[layer_id - first].record(stream)
            if defer:
                self.controller.finish_lru_reorder()
        self._early_page_tables[layer_id] = page_table

    def _take_early_page_table(self, layer_id: int, rows: int):
        # The early page table, padded to the backend's query rows, or None.
        page_table = self._early_page_tables.pop(layer_id, None)
        if page_table is None:
            return None
        if self._swap_stream is not None:
            event = self._swap_done[layer_id - self._layer_range[0]]
            torch.cuda.current_stream().wait_event(event)
        n, k = page_table.shape
        if n < rows:
            pad = page_table.new_full((rows - n, k), -1)
            page_table = torch.cat([page_table, pad])
        return page_table

    def _swap_into_plan(self, layer_id, topk_positions, forward_batch, defer=False):
        if layer_id == self._layer_range[0]:
            self._count_real_rows(forward_batch.out_cache_loc)
        bs = topk_positions.shape[0]
        return self.controller.swap_one_layer(
            layer_id,
            topk_positions,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            self.req_to_token,
            self.num_real_reqs,
            out=LayerSwapPlan(*(t[:bs] for t in self._plan_buffers)),
            defer_lru_reorder=defer,
        )

    def swap_decode_layer(self, layer_id: int, topk_positions, forward_batch):
        """Top-k positions -> GPU rows in top-k order, misses loaded."""
        page_table = self._take_early_page_table(layer_id, topk_positions.shape[0])
        if page_table is None:
            page_table = self._swap_into_plan(layer_id, topk_positions, forward_batch)
        self._verify_layer(layer_id, topk_positions, page_table, forward_batch)
        if layer_id == self._layer_range[1]:
            # One all-layer copy of the step's new KV, inside the graph.
            loc = forward_batch.out_cache_loc
            rows = self.kv_pool.loc_to_row[loc]
            self.controller.write_back_new_tokens(rows, loc, self.num_real_reqs)
        return page_table

    def _count_real_rows(self, out_cache_loc, out=None) -> None:
        # Padding rows have out_cache_loc 0 (never a request's loc).
        out = self.num_real_reqs if out is None else out
        torch.sum(out_cache_loc != 0, dim=0, keepdim=True, dtype=torch.int32, out=out)

    def _verify_layer(self, layer_id, topk_pos, page_table, forward_batch) -> None:
        if self.verifier is None:
            return
        fb = forward_batch
        if fb.forward_mode.is_target_verify():
            seq_lens, q = self._verify_seq_lens, self.options.query_tokens
        else:
            seq_lens, q = fb.seq_lens, 1
        idx, real = fb.req_pool_indices, self.num_real_reqs
        self.verifier.check(layer_id, topk_pos, page_table, idx, seq_lens, real, q)

    def _check_verify(self, sync: bool = False) -> None:
        # Mode "fail": raise at the first mismatch of a finished forward
        # (between forwards without a sync; at idle with one).
        if self.verifier is not None and self.verifier.mode == "fail":
            self.verifier.read() if sync else self.verifier.poll()

    def check_idle(self) -> str:
        """The offload's leaks when the scheduler is idle, as one message."""
        self._check_verify(sync=True)
        leaks = self.controller.idle_leaks()
        staging = self.allocator.staging
        if staging.available_pages() != staging.num_pages:
            leaks.append(
                f"staging pages free: {staging.available_pages()} of {staging.num_pages}"
            )
        # No decode log feeds the metrics while idle.
        now = time.perf_counter()
        due = now - self._last_idle_metrics_tic >= IDLE_METRICS_INTERVAL_S
        if self.metrics is not None and due:
            self._last_idle_metrics_tic = now
            self.get_stats()
        return "; ".join(leaks)

    def enable_metrics(self, labels, registry=None) -> None:
        """Export the counters and gauges to Prometheus (fed at each decode log)."""
        self.metrics = NSAKVOffloadMetricsCollector(labels, registry)

    def get_stats(self) -> dict:
        """The counters since the last call and the pools' use (syncs)."""
        stats = self.controller.get_stats()
        self.controller.reset_stats()
        staging, allocator = self.allocator.staging, self.allocator
        stats.update(
            max_units=self.options.max_units,
            host_total_tokens=allocator.size,  # host slot = token loc
            host_used_tokens=allocator.size - allocator.available_size(),
            staging_total_rows=staging.num_pages * staging.page_size,
            staging_used_rows=(staging.num_pages - staging.available_pages())
            * staging.page_size,
        )
        if self.verifier is not None:
            stats.update(self.verifier.stats_delta())
        if self.metrics is not None:
            self.metrics.observe(stats)
        return stats

    def get_decode_log_msg(self) -> str:
        """`, nsa-offload ...` suffix of the decode log line (syncs)."""
        stats = self.get_stats()
        now = time.perf_counter()
        interval, self._last_log_tic = now - self._last_log_tic, now
        return decode_log_suffix(stats, interval)


def cuda_graph_coverage_warning(server_args, num_regions: int) -> Optional[str]:
    """A warning when decode batches can outgrow the captured CUDA graphs."""
    max_bs = decode_cuda_graph_max_bs(server_args)
    if not max_bs or num_regions <= max_bs:
        return None
    return (
        f"NSA KV offload: {num_regions} decode regions (--max-running-requests) but "
        f"CUDA graphs only up to batch {max_bs}: decode batches above it run "
        f"without CUDA graphs, several times slower per step; set "
        f"--{CUDA_GRAPH_MAX_BS_FIELD.replace('_', '-')} {num_regions} to capture "
        "them all."
    )


def create_nsa_kv_offload_coordinator(model_runner) -> NSAKVOffloadCoordinator:
    """The coordinator of the model runner's pools (``model_runner.nsa_kv_offload``)."""
    sa = model_runner.server_args
    options = NSAKVOffloadOptions.from_server_args(
        sa, model_runner.model_config.hf_config
    )
    host_pool_group = None
    if NSAKVOffloadRankLayout.from_server_args(sa).attn_tp_size > 1:
        # Same KV on every rank of the group: one host pool per node.
        from sglang.srt.distributed.parallel_state import get_attn_tp_group

        host_pool_group = get_attn_tp_group()
    sizes = model_runner.token_to_kv_pool.sizes
    logger.info(
        "NSA KV offload: requests held at once by length (prompt + output): %s; "
        "--max-running-requests trades decode regions for token locs.",
        sizes.describe_capacity(model_runner.model_config.context_len),
    )
    warning = cuda_graph_coverage_warning(sa, model_runner.max_running_requests)
    if warning:
        logger.warning(warning)
    page_size = model_runner.page_size
    reserve_rows = staging_reserve_rows(
        options.prefill_budget, sizes.num_regions, page_size
    )
    coordinator = NSAKVOffloadCoordinator(
        kv_pool=model_runner.token_to_kv_pool,
        allocator=model_runner.token_to_kv_pool_allocator,
        req_to_token=model_runner.req_to_token_pool.req_to_token,
        options=options,
        max_batch_size=swap_batch_rows(options, model_runner.max_running_requests),
        # Lend at most the staging kept for one long prompt being chunked.
        staging_reserve_pages=reserve_rows // page_size,
        host_pool_group=host_pool_group,
    )
    logger.info(coordinator.describe())
    return coordinator
