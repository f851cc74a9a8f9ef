"""GPU memory sizing of the decode NSA KV offload.

:class:`NSAKVOffloadPoolConfigurator` splits the KV budget sglang's own pool
would take between fixed costs (staging rows, a region of ``C + W`` rows per
request slot, the swap's scratch) and token locs (indexer keys, the LRU map),
capped by the host pool; what capped locs leave becomes spare regions lent as
units (docs/ELASTIC_BUFFER.md). ``max_total_num_tokens`` is the number of locs,
``max_running_requests`` that of regions (docs/INTEGRATION.md, "Memory").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.mem_cache.lru_cache_state import lru_slot_dtype
from sglang.srt.mem_cache.nsa_kv_offload_compat import (
    SparseTokenToKVPool,
    get_index_head_dim,
    pool_builder_layout,
    resolved_args,
)
from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import TritonLRUSwap
from sglang.srt.mem_cache.nsa_kv_offload_units import staging_unit_capacity
from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

# KV layers of the MTP draft worker (DeepSeek-V3.2's one NextN layer).
NSA_KV_OFFLOAD_DRAFT_LAYERS = 1
# Without --max-running-requests: at most this budget share and count of regions.
_DEFAULT_REGION_BUDGET_FRACTION = 0.4
_DEFAULT_MAX_REGIONS = 256


def nsa_indexer_bytes(index_head_dim: int) -> int:
    """One token's indexer key bytes per layer: fp8 keys and fp32 block scales."""
    return index_head_dim + index_head_dim // SparseTokenToKVPool.quant_block_size * 4


@dataclass
class NSAKVOffloadPoolSizes:
    """How the offload splits the GPU KV budget (all counts per rank)."""

    num_locs: int  # logical token locs = host slots
    num_regions: int  # decode regions = request slots
    region_rows: int  # R = C + W
    staging_rows: int
    page_size: int
    host_capacity_locs: int
    num_spare_regions: int = 0  # lent as units only (spare_region_count)
    # LRU state for units lent by free locs' indexer keys; > 0: the arena.
    idle_loc_units: int = 0

    @property
    def total_regions(self) -> int:
        """Regions the controller manages: request slots plus spare ones."""
        return self.num_regions + self.num_spare_regions

    @property
    def kv_pool_size(self) -> int:
        """``size`` of the KV pool: rows after the leading padding page."""
        rows = self.staging_rows + self.total_regions * self.region_rows
        return _round_up(rows, self.page_size)

    @property
    def staging_start_row(self) -> int:
        return self.page_size

    @property
    def region_start_row(self) -> int:
        return self.page_size + self.staging_rows

    def requests_that_fit(self, tokens: int) -> int:
        """Requests of ``tokens`` tokens (prompt + output) held at once."""
        return min(self.num_regions, self.num_locs // _round_up(tokens, self.page_size))

    def describe_capacity(self, context_len: int) -> str:
        """``16K x 254, ..., 131584 x 62`` (the last: the context length):
        ``requests_that_fit`` by length, for the startup log."""
        held = [
            f"{n // 1024}K x {self.requests_that_fit(n)}"
            for n in (16384, 32768, 65536, 131072)
            if n < context_len
        ]
        held.append(f"{context_len} x {self.requests_that_fit(context_len)}")
        return ", ".join(held)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def lru_slot_id_bytes(buffer_size: int, max_units: int) -> int:
    """Bytes of one LRU slot id (``lru_slot_dtype``)."""
    return lru_slot_dtype(buffer_size * max_units).itemsize


def offload_bytes_per_loc(
    num_layers: int, indexer_bytes: int, slot_id_bytes: int = 2
) -> int:
    """GPU bytes per token loc: indexer keys, LRU slot ids and ``loc_to_row``."""
    return num_layers * (indexer_bytes + slot_id_bytes) + 8


def lru_unit_state_bytes(num_layers: int, buffer_size: int, max_units: int) -> int:
    """GPU bytes of one unit's LRU state (``slot_loc``, ``lru_order``)."""
    return num_layers * buffer_size * (4 + lru_slot_id_bytes(buffer_size, max_units))


def offload_bytes_per_region(
    num_layers: int,
    row_bytes: int,
    buffer_size: int,
    recent_window: int,
    max_units: int = 1,
) -> int:
    """GPU bytes per region: its KV rows and its one unit's LRU state."""
    state = lru_unit_state_bytes(num_layers, buffer_size, max_units)
    return num_layers * (buffer_size + recent_window) * row_bytes + state


def max_spare_regions(num_regions: int, max_units: int) -> int:
    """What the request slots can borrow: ``max_units - 1`` extra units each."""
    return num_regions * max(0, max_units - 1)


def spare_region_count(
    leftover_bytes: int, region_bytes: int, num_regions: int, max_units: int
) -> int:
    """Spare regions the bytes capped locs leave pay for (<= max_spare_regions)."""
    if max_units <= 1 or leftover_bytes <= 0:
        return 0
    fit = leftover_bytes // region_bytes
    return int(min(fit, max_spare_regions(num_regions, max_units)))


def idle_loc_lru_units(
    num_locs: int,
    indexer_bytes: int,
    row_bytes: int,
    buffer_size: int,
    num_regions: int,
    max_units: int,
    num_spare_regions: int = 0,
) -> int:
    """Units of LRU state for units lent by free locs' indexer keys: as many
    as all keys hold, at most what the slots borrow beyond spare regions."""
    if max_units <= 1:
        return 0
    fit = num_locs * indexer_bytes // ((buffer_size + 1) * row_bytes)
    room = max_spare_regions(num_regions, max_units) - num_spare_regions
    return int(max(0, min(fit, room)))


def staging_lru_units(
    staging_rows: int, page_size: int, buffer_size: int, max_units: int
) -> int:
    """Units idle staging may lend at once (none with one unit per request)."""
    if max_units <= 1:
        return 0
    return staging_unit_capacity(staging_rows // page_size, page_size, buffer_size)


def staging_reserve_rows(prefill_budget: int, num_regions: int, page_size: int) -> int:
    """Staging rows for two prefill batches (overlap scheduling) and a partly
    used last page per request of a batch (one per region, 64 at least)."""
    return 2 * prefill_budget + max(64, num_regions) * page_size


def prefill_staging_rows(
    context_len: int, prefill_budget: int, num_regions: int, page_size: int
) -> int:
    """GPU rows prefills hold until backed up, for the worst case: one prompt
    being chunked (the context length) and ``staging_reserve_rows``."""
    return context_len + staging_reserve_rows(prefill_budget, num_regions, page_size)


def compute_offload_pool_sizes(
    available_bytes: int,
    num_layers: int,
    row_bytes: int,
    indexer_bytes: int,
    page_size: int,
    buffer_size: int,
    recent_window: int,
    num_regions: int,
    staging_rows: int,
    host_pool_bytes: int,
    max_total_tokens: Optional[int] = None,
    max_units: int = 1,
    extra_bytes_per_loc: int = 0,
    swap_scratch_bytes: int = 0,
) -> NSAKVOffloadPoolSizes:
    """Split ``available_bytes`` between fixed costs and token locs (module
    doc); idle-loc units' LRU state is paid by spare regions, then the locs.
    ``extra_bytes_per_loc``: the MTP draft worker's NextN KV, the verify pool."""
    staging_rows = _round_up(staging_rows, page_size)
    unit_state = lru_unit_state_bytes(num_layers, buffer_size, max_units)
    region_bytes = offload_bytes_per_region(
        num_layers, row_bytes, buffer_size, recent_window, max_units
    )
    staging_units = staging_lru_units(staging_rows, page_size, buffer_size, max_units)
    fixed = (
        num_layers * (page_size + staging_rows) * row_bytes
        + num_regions * region_bytes
        + staging_units * unit_state
        + swap_scratch_bytes
    )
    slot_id_bytes = lru_slot_id_bytes(buffer_size, max_units)
    per_loc = offload_bytes_per_loc(num_layers, indexer_bytes, slot_id_bytes)
    per_loc += extra_bytes_per_loc
    host_capacity = host_pool_bytes // (num_layers * row_bytes)
    num_locs = min((available_bytes - fixed) // per_loc, host_capacity)
    if max_total_tokens is not None:
        num_locs = min(num_locs, max_total_tokens)
    num_locs = num_locs // page_size * page_size
    if num_locs <= 0:
        raise RuntimeError(
            "NSA KV offload: not enough GPU memory for "
            f"{num_regions} decode regions of {buffer_size + recent_window} rows and "
            f"{staging_rows} staging rows ({fixed / (1 << 30):.2f} GB of "
            f"{available_bytes / (1 << 30):.2f} GB available). Lower "
            "--max-running-requests or --nsa-kv-offload-gpu-buffer-size, or raise "
            "--mem-fraction-static."
        )
    leftover = available_bytes - fixed - num_locs * per_loc
    num_spare = spare_region_count(leftover, region_bytes, num_regions, max_units)
    while True:
        num_idle_loc_units = idle_loc_lru_units(
            num_locs,
            num_layers * indexer_bytes,
            num_layers * row_bytes,
            buffer_size,
            num_regions,
            max_units,
            num_spare,
        )
        state = num_idle_loc_units * unit_state
        short = fixed + num_locs * per_loc + num_spare * region_bytes + state
        short -= available_bytes
        if short <= 0 or num_spare == 0:
            break
        # Spare regions pay for that LRU state first: capped locs are
        # requests held, a spare region only a unit lent.
        num_spare -= min(num_spare, -(-short // region_bytes))
    # Then the locs' bytes, when those are short.
    if short > 0:
        num_locs -= _round_up(-(-short // per_loc), page_size)
    return NSAKVOffloadPoolSizes(
        num_locs=num_locs,
        num_regions=num_regions,
        region_rows=buffer_size + recent_window,
        staging_rows=staging_rows,
        page_size=page_size,
        host_capacity_locs=host_capacity,
        num_spare_regions=num_spare,
        idle_loc_units=num_idle_loc_units,
    )


class NSAKVOffloadPoolConfigurator:
    """The pools' sizing with the offload on (module doc; ``pool_builder_layout``)."""

    def __init__(self, builder):
        from sglang.srt.arg_groups.nsa_kv_offload_hook import NSAKVOffloadOptions

        sa, mc = resolved_args(builder.server_args), builder.model_config
        self.options = NSAKVOffloadOptions.from_server_args(sa, mc.hf_config)
        self.num_layers, kv_dim, attn_dp_size = pool_builder_layout(builder)
        elem = torch._utils._element_size(builder.kv_cache_dtype)
        self.row_bytes = kv_dim * elem
        self.indexer_bytes = nsa_indexer_bytes(get_index_head_dim(mc.hf_config))
        self.host_pool_bytes = int(self.options.host_pool_gb * (1 << 30))
        # Per rank: with DP attention --max-running-requests counts all ranks.
        mrr = sa.max_running_requests
        self.user_max_running_requests = (
            None if mrr is None else mrr // max(attn_dp_size, 1)
        )
        self.context_len = mc.context_len
        self.max_total_tokens = sa.max_total_tokens
        # Per-loc bytes of the MTP draft worker's NextN layer and the verify pool.
        self.extra_bytes_per_loc = 0
        if sa.speculative_algorithm is not None:
            self.extra_bytes_per_loc += NSA_KV_OFFLOAD_DRAFT_LAYERS * (
                self.row_bytes + self.indexer_bytes
            )
        if self.options.verify:
            self.extra_bytes_per_loc += self.num_layers * self.row_bytes
        self._resolved: Optional[NSAKVOffloadPoolSizes] = None

    def staging_rows(self, num_regions: int, page_size: int) -> int:
        if self.options.kv_arrives_in_host:
            return 0
        return prefill_staging_rows(
            self.context_len, self.options.prefill_budget, num_regions, page_size
        )

    def _num_regions(self, available_bytes: int) -> int:
        if self.user_max_running_requests is not None:
            return self.user_max_running_requests
        o = self.options
        per_region = offload_bytes_per_region(
            self.num_layers, self.row_bytes, o.buffer_size, o.recent_window, o.max_units
        )
        share = int(_DEFAULT_REGION_BUDGET_FRACTION * available_bytes) // per_region
        return max(1, min(_DEFAULT_MAX_REGIONS, share))

    def compute_sizes(
        self, available_bytes: int, page_size: int, num_regions: Optional[int] = None
    ) -> NSAKVOffloadPoolSizes:
        o = self.options
        if num_regions is None:
            num_regions = self._num_regions(available_bytes)
        return compute_offload_pool_sizes(
            available_bytes=available_bytes,
            num_layers=self.num_layers,
            row_bytes=self.row_bytes,
            indexer_bytes=self.indexer_bytes,
            page_size=page_size,
            buffer_size=o.buffer_size,
            recent_window=o.recent_window,
            num_regions=num_regions,
            staging_rows=self.staging_rows(num_regions, page_size),
            host_pool_bytes=self.host_pool_bytes,
            max_total_tokens=self.max_total_tokens,
            max_units=o.max_units,
            extra_bytes_per_loc=self.extra_bytes_per_loc,
            swap_scratch_bytes=self.swap_scratch_bytes(num_regions),
        )

    def swap_scratch_bytes(self, num_regions: int) -> int:
        """The LRU swap's scratch, for the batch rows the coordinator sizes."""
        o = self.options
        return TritonLRUSwap.scratch_bytes(
            rows=swap_batch_rows(o, num_regions),
            top_k=o.top_k,
            buffer_size=o.buffer_size,
            max_units=o.max_units,
            slot_id_bytes=lru_slot_id_bytes(o.buffer_size, o.max_units),
            max_query_tokens=o.query_tokens,
        )

    def budget_bytes(self, available_bytes: int) -> int:
        """What sglang's pool takes for the same ``--mem-fraction-static``: the
        whole cells (a real KV row and indexer key per layer) that fit."""
        cell = self.num_layers * (self.row_bytes + self.indexer_bytes)
        return available_bytes // cell * cell

    def calculate_pool_sizes(
        self, available_bytes: int, page_size: int
    ) -> "NSAKVOffloadMemoryPoolConfig":
        sizes = self.compute_sizes(self.budget_bytes(available_bytes), page_size)
        self._resolved = sizes
        return NSAKVOffloadMemoryPoolConfig(
            max_total_num_tokens=sizes.num_locs,
            max_running_requests=sizes.num_regions,
            nsa_kv_offload_configurator=self,
        )

    def calculate_pool_sizes_from_max_tokens(
        self, max_total_num_tokens: int, page_size: int
    ) -> "NSAKVOffloadMemoryPoolConfig":
        resolved = self._resolved
        return NSAKVOffloadMemoryPoolConfig(
            max_total_num_tokens=max_total_num_tokens // page_size * page_size,
            max_running_requests=resolved.num_regions if resolved else None,
            nsa_kv_offload_configurator=self,
        )

    def finalize_with_max_running_requests(self, config):
        """At most the request slots the sizing gave regions (``config``'s
        configurator sized it: sglang may ask a fresh one)."""
        regions = config.nsa_kv_offload_configurator._resolved.num_regions
        config.max_running_requests = min(config.max_running_requests, regions)
        return config

    def final_sizes(
        self, num_locs: int, num_regions: int, page_size: int
    ) -> NSAKVOffloadPoolSizes:
        """The pool layout for the resolved token and request counts (spare
        regions and idle-loc units as sized, capped by the final slots)."""
        resolved = self._resolved
        most = max_spare_regions(num_regions, self.options.max_units)
        staging_rows = _round_up(self.staging_rows(num_regions, page_size), page_size)
        return NSAKVOffloadPoolSizes(
            num_locs=num_locs,
            num_regions=num_regions,
            region_rows=self.options.region_rows,
            staging_rows=staging_rows,
            page_size=page_size,
            host_capacity_locs=self.host_pool_bytes
            // (self.num_layers * self.row_bytes),
            num_spare_regions=min(resolved.num_spare_regions if resolved else 0, most),
            idle_loc_units=min(resolved.idle_loc_units if resolved else 0, most),
        )


def swap_batch_rows(options, max_running_requests: int) -> int:
    """Batch rows the swap is sized for: request slots or CUDA-graph batches."""
    return max(max_running_requests, options.cuda_graph_max_bs)


@dataclass
class NSAKVOffloadMemoryPoolConfig(MemoryPoolConfig):
    """Upstream's pool sizes plus their configurator (nsa_kv_offload_pool_kwargs)."""

    nsa_kv_offload_configurator: Optional[NSAKVOffloadPoolConfigurator] = None


def nsa_kv_offload_pool_kwargs(builder) -> dict:
    """Extra kwargs of the offload's KV pool: its ``memory_pool_config``'s layout."""
    config = builder.memory_pool_config
    configurator = config.nsa_kv_offload_configurator
    sizes = configurator.final_sizes(
        num_locs=config.max_total_num_tokens,
        num_regions=config.max_running_requests,
        page_size=builder.page_size,
    )
    return {"sizes": sizes, "verify": configurator.options.verify is not None}
