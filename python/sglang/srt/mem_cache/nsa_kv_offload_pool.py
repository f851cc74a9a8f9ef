"""GPU-side pools of the decode NSA KV offload.

With the offload on, the two per-token caches of an NSA model stop sharing one
size: the indexer keys stay on the GPU for every logical token loc (the indexer
scores all tokens), while the MLA KV rows on the GPU shrink to

    [0, page_size)                 padding rows (loc 0 of padded batches)
    [page_size, + staging_rows)    prefill staging: prompt KV until it is backed up
    [.., + num_regions * R)        one decode region of R = C + W rows per request slot
    [.., + num_spare_regions * R)  spare regions (optional): lent as units only

Every KV write goes through ``loc_to_row`` (token loc -> GPU row). Prefill maps
a request's new pages onto staging pages; the decode step maps each new token
onto its request's recent-window ring row (``NSAKVOffloadCoordinator``).

A PD decode server (``--disaggregation-mode decode``) runs no prefill: the
prefill server writes a prompt's KV rows straight into the host pool (host slot
= token loc), so it has no staging rows and its locs map to no GPU row until
the decode step writes them.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.lru_cache_state import lru_slot_dtype
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.mem_cache.nsa_kv_offload_units import staging_unit_capacity
from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig
from sglang.srt.utils import get_num_new_pages

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.managers.nsa_kv_offload_coordinator import (
        NSAKVOffloadCoordinator,
    )
    from sglang.srt.mem_cache.nsa_kv_offload_units import IdleLocUnitLender

logger = logging.getLogger(__name__)


def nsa_indexer_bytes(index_head_dim: int) -> int:
    """Bytes of one token's indexer key in a layer, as ``NSATokenToKVPool``
    stores them: fp8 keys, then an fp32 scale per quantization block."""
    return index_head_dim + index_head_dim // NSATokenToKVPool.quant_block_size * 4


class NSAKVOffloadTokenToKVPool(NSATokenToKVPool):
    """``NSATokenToKVPool`` whose KV rows are addressed through ``loc_to_row``.

    ``size`` is the number of logical token locs (indexer keys, host slots);
    ``sizes`` the layout of its GPU rows (padding page, staging, decode
    regions: ``sizes.kv_pool_size`` MLA KV rows), computed once when the pools
    are sized. The allocator and the coordinator built on this pool take their
    parts of the layout from ``self.sizes``.
    """

    def __init__(self, size: int, sizes: NSAKVOffloadPoolSizes, **kwargs):
        page_size = kwargs["page_size"]
        num_gpu_rows = sizes.kv_pool_size
        self.sizes = sizes
        self.num_locs = size
        self.num_gpu_rows = num_gpu_rows
        self.index_page_bytes = page_size * nsa_indexer_bytes(kwargs["index_head_dim"])
        # Upstream's page count for index_buf_size = size.
        self.num_index_pages = (size + page_size + 1) // page_size
        # The arena: each layer's KV rows and indexer keys in one buffer, so
        # that the keys of free locs can be lent as KV rows (_create_buffers).
        self.uses_arena = sizes.idle_loc_units > 0
        super().__init__(
            size=num_gpu_rows,
            index_buf_size=0 if self.uses_arena else size,
            **kwargs,
        )
        if self.uses_arena:
            # Upstream allocated one placeholder page per layer; the keys
            # live in the arena.
            self.index_k_with_scale_buffer = [
                arena[self.index_offset : self.index_end].view(
                    self.num_index_pages, self.index_page_bytes
                )
                for arena in self._arenas
            ]
        # Unmapped locs write into the padding rows, like loc 0 does upstream;
        # the extra last entry keeps a -1 (padding) index at -1.
        self.loc_to_row = torch.zeros(
            size + page_size + 1, dtype=torch.int64, device=self.device
        )
        self.loc_to_row[-1] = -1

    def _create_buffers(self):
        """Upstream's KV rows, or with the arena one uint8 buffer per layer:

            [0, index_offset)          the KV rows upstream allocates
            [index_offset, index_end)  the indexer-key pages (the locs')
            [index_end, ..)            padding to whole pages of KV rows

        ``kv_buffer[layer]`` views the whole buffer as KV rows, so a run of
        free loc pages is also a run of rows (:meth:`rows_of_pages`)."""
        self.kv_row_bytes = self.kv_cache_dim * self.store_dtype.itemsize
        if not self.uses_arena:
            return super()._create_buffers()
        kv_bytes = (self.size + self.page_size) * self.kv_row_bytes
        # 4 KiB-aligned key pages, as an allocation of their own would be.
        self.index_offset = _round_up(kv_bytes, 4096)
        self.index_end = (
            self.index_offset + self.num_index_pages * self.index_page_bytes
        )
        total_rows = _round_up(-(-self.index_end // self.kv_row_bytes), self.page_size)
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE), (
            torch.cuda.use_mem_pool(self.custom_mem_pool)
            if self.custom_mem_pool
            else nullcontext()
        ):
            self._arenas = [
                torch.zeros(
                    total_rows * self.kv_row_bytes,
                    dtype=torch.uint8,
                    device=self.device,
                )
                for _ in range(self.layer_num)
            ]
        self.kv_buffer = [
            arena.view(self.store_dtype).view(total_rows, 1, self.kv_cache_dim)
            for arena in self._arenas
        ]

    def _clear_buffers(self):
        super()._clear_buffers()
        if self.uses_arena:
            del self._arenas

    def rows_of_pages(self, first_page: int, num_pages: int) -> Tuple[int, int]:
        """The KV rows ``[first, end)`` whose bytes lie within the indexer-key
        bytes of loc pages ``first_page .. first_page + num_pages - 1``."""
        start = self.index_offset + first_page * self.index_page_bytes
        end = start + num_pages * self.index_page_bytes
        return -(-start // self.kv_row_bytes), end // self.kv_row_bytes

    def translate_loc_to_row(self, loc: torch.Tensor) -> torch.Tensor:
        return self.loc_to_row[loc]

    def set_kv_buffer(self, layer: RadixAttention, loc, cache_k, cache_v):
        super().set_kv_buffer(layer, self.loc_to_row[loc], cache_k, cache_v)

    def set_mla_kv_buffer(self, layer: RadixAttention, loc, cache_k_nope, cache_k_rope):
        super().set_mla_kv_buffer(
            layer, self.loc_to_row[loc], cache_k_nope, cache_k_rope
        )

    def get_mla_kv_buffer(self, layer: RadixAttention, loc, dst_dtype=None):
        return super().get_mla_kv_buffer(layer, self.loc_to_row[loc], dst_dtype)


def get_nsa_kv_offload(
    token_to_kv_pool_allocator,
) -> Optional[NSAKVOffloadCoordinator]:
    """The offload coordinator behind an allocator, or None when it is off.

    For sglang code that holds only the allocator (``prepare_for_decode``,
    ``release_kv_cache``); everything else is handed the coordinator
    (``ModelRunner.nsa_kv_offload``)."""
    return getattr(token_to_kv_pool_allocator, "nsa_kv_offload", None)


class StagingRowAllocator:
    """Free list of GPU staging pages (page_size rows each) for prefill KV."""

    def __init__(self, start_row: int, num_pages: int, page_size: int, device):
        self.start_row = start_row
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = device
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(
            self.num_pages, dtype=torch.int64, device=self.device
        )

    def available_pages(self) -> int:
        return self.free_pages.numel()

    def alloc(self, num_pages: int) -> Optional[torch.Tensor]:
        if num_pages > self.free_pages.numel():
            return None
        pages, self.free_pages = (
            self.free_pages[:num_pages],
            self.free_pages[num_pages:],
        )
        return pages

    def free(self, pages: torch.Tensor) -> None:
        if pages.numel():
            self.free_pages = torch.cat((pages, self.free_pages))


class NSAKVOffloadTokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Paged allocator of logical token locs that also gives every new page of
    a prefill a GPU staging page, and takes it back when the page is freed or
    the request is admitted for decode (``release_staging``). Without staging
    rows (PD decode: KV arrives in host memory) it hands out locs only."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache: NSAKVOffloadTokenToKVPool,
        need_sort: bool,
        staging_start_row: int,
        staging_rows: int,
        speculative: bool = False,
    ):
        # MTP: decoding requests extend too (draft pass, verify); telling them
        # from prompts costs a host sync, so only speculative servers pay it.
        self.speculative = speculative
        self.staging = StagingRowAllocator(
            staging_start_row, staging_rows // page_size, page_size, device
        )
        # First staging row of each logical page, -1 when the page has none.
        self.page_to_staging_row = torch.full(
            (size // page_size + 2,), -1, dtype=torch.int64, device=device
        )
        # The coordinator, set by create_nsa_kv_offload_coordinator: ModelRunner
        # builds it after its pools, on this allocator. The pools' one link
        # back to it, because sglang code that holds only the allocator must
        # reach it (prepare_for_decode, release_kv_cache, retraction's
        # get/load_cpu_copy), and so must a prefill short of staging pages.
        self.nsa_kv_offload: Optional[NSAKVOffloadCoordinator] = None
        # The lender of free loc pages as units (the arena), set with the
        # coordinator: its runs are out of the free list but count as free.
        self.idle_loc_lender: Optional[IdleLocUnitLender] = None
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)

    def clear(self):
        super().clear()
        self.staging.clear()
        self.page_to_staging_row.fill_(-1)
        if self.idle_loc_lender is not None:
            # Runs still lent stay out of the free list.
            self._drop_from_free(self.idle_loc_lender.lent_page_runs())

    # ------------------------------------------------ loc pages lent as units

    def free_page_count(self) -> int:
        """Pages on the free lists (lent runs excluded)."""
        return len(self.free_pages) + len(self.release_pages)

    def available_size(self):
        # Lent runs are free locs to the scheduler: an allocation that needs
        # them takes their units back (_alloc_or_reclaim).
        lent = self.idle_loc_lender.lent_pages() if self.idle_loc_lender else 0
        return super().available_size() + lent * self.page_size

    def return_pages(self, pages: torch.Tensor) -> None:
        """A lent run back on the free list (``IdleLocUnitLender.give``)."""
        if self.need_sort:
            self.release_pages = torch.cat((self.release_pages, pages))
        else:
            self.free_pages = torch.cat((self.free_pages, pages))

    def _drop_from_free(self, first_pages) -> None:
        if not first_pages:
            return
        self.merge_and_sort_free()
        lender = self.idle_loc_lender
        runs = torch.cat([lender.run_pages(p) for p in sorted(first_pages)])
        self.free_pages = self.free_pages[~torch.isin(self.free_pages, runs)]

    def backup_state(self):
        lender = self.idle_loc_lender
        runs = lender.lent_page_runs() if lender is not None else frozenset()
        return super().backup_state(), runs

    def restore_state(self, state):
        """Back to the free lists of :meth:`backup_state`, less the runs lent
        since and plus those given back since (they were lent then)."""
        upstream_state, lent_then = state
        super().restore_state(upstream_state)
        lender = self.idle_loc_lender
        if lender is None:
            return
        lent_now = lender.lent_page_runs()
        self._drop_from_free(lent_now - lent_then)
        for first in sorted(lent_then - lent_now):
            self.return_pages(lender.run_pages(first))

    def _alloc_or_reclaim(self, alloc, num_pages):
        """``alloc()``, after taking lent units back when fewer pages are free
        than it needs (``num_pages()``; upstream's kernels read that many
        entries of the free list before they check its length)."""
        offload = self.nsa_kv_offload
        if self.idle_loc_lender is not None and offload is not None:
            needed = num_pages()
            if needed > self.free_page_count():
                offload.reclaim_idle_locs(needed)
        return alloc()

    def alloc(self, need_size: int):
        return self._alloc_or_reclaim(
            lambda: super(NSAKVOffloadTokenToKVPoolAllocator, self).alloc(need_size),
            lambda: need_size // self.page_size,
        )

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        return self._alloc_or_reclaim(
            lambda: super(NSAKVOffloadTokenToKVPoolAllocator, self).alloc_decode(
                seq_lens, seq_lens_cpu, last_loc
            ),
            lambda: get_num_new_pages(
                seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True
            ),
        )

    def alloc_extend(
        self,
        prefix_lens,
        prefix_lens_cpu,
        seq_lens,
        seq_lens_cpu,
        last_loc,
        extend_num_tokens,
        *args,
        **kwargs,
    ):
        out = self._alloc_or_reclaim(
            lambda: super(NSAKVOffloadTokenToKVPoolAllocator, self).alloc_extend(
                prefix_lens,
                prefix_lens_cpu,
                seq_lens,
                seq_lens_cpu,
                last_loc,
                extend_num_tokens,
                *args,
                **kwargs,
            ),
            lambda: get_num_new_pages(
                seq_lens=seq_lens_cpu,
                page_size=self.page_size,
                prefix_lens=prefix_lens_cpu,
            ),
        )
        if out is None or out.numel() == 0:
            return out
        if (
            self.speculative
            and self.staging.num_pages > 0
            and self._extends_decoding_reqs(last_loc)
        ):
            # MTP draft / verify locs of decoding requests: the verify
            # preparation maps them to window ring rows (the draft pass only
            # writes the NextN layer's own pool), so no staging page.
            return out
        if self.staging.num_pages == 0:
            # KV arrives in host slots; a freed decode token's window row must
            # not stay mapped (unmapped locs point at the padding rows).
            self._kvcache.loc_to_row[out] = 0
            return out
        # A page is new to this extend iff its first token is in it. Prefill is
        # off the decode hot path, so the host sync of the mask is fine here.
        new_pages = out[out % self.page_size == 0] // self.page_size
        staging_pages = self.staging.alloc(new_pages.numel())
        offload = self.nsa_kv_offload
        if staging_pages is None and offload is not None:
            # Idle staging pages lent to running requests as extra units.
            if offload.reclaim_staging(new_pages.numel()):
                staging_pages = self.staging.alloc(new_pages.numel())
        if staging_pages is None:
            # Give back only the pages this extend took: the first one may
            # continue a page the request still owns.
            super().free(new_pages * self.page_size)
            raise RuntimeError(
                "NSA KV offload: out of GPU staging rows for prefill "
                f"({self.staging.num_pages} pages). Lower --chunked-prefill-size "
                "or --context-length."
            )
        self.page_to_staging_row[new_pages] = (
            self.staging.start_row + staging_pages * self.page_size
        )
        rows = self.page_to_staging_row[out // self.page_size] + out % self.page_size
        self._kvcache.loc_to_row[out] = rows
        return out

    def _extends_decoding_reqs(self, last_loc: torch.Tensor) -> bool:
        """Whether the requests of an extend continue admitted locs: a request's
        last loc's page has no staging row (admission returned it; a prompt's
        pages keep theirs until then; ``-1``: a new prompt). Syncs once."""
        pages = last_loc.clamp(min=0) // self.page_size
        decoding = (last_loc >= 0) & (self.page_to_staging_row[pages] < 0)
        num_decoding = int(decoding.sum())
        if 0 < num_decoding < last_loc.numel():
            # sglang never mixes them (--enable-mixed-chunk is refused); a
            # request not admitted before its draft pass would land here.
            raise RuntimeError(
                "NSA KV offload: an extend mixes prompts and decoding requests"
            )
        return num_decoding > 0

    def release_staging(self, locs: torch.Tensor) -> None:
        """Return the staging pages behind ``locs`` (any loc of a page frees it)."""
        if locs.numel() == 0:
            return
        pages = torch.unique(locs // self.page_size)
        rows = self.page_to_staging_row[pages]
        staged = rows >= 0
        if bool(staged.any()):
            self.staging.free((rows[staged] - self.staging.start_row) // self.page_size)
            self.page_to_staging_row[pages[staged]] = -1

    def free(self, free_index: torch.Tensor):
        if free_index.numel() and self.is_not_in_free_group:
            self.release_staging(free_index)
        super().free(free_index)

    def _retraction_copy_targets(self, indices):
        """(host pool, locs, layers, indexer-key pages) of a request's locs,
        once every GPU copy issued so far is done: its last step's new tokens
        are on the host, and nothing still reads host slots about to be
        rewritten."""
        offload = self.nsa_kv_offload
        offload.synchronize()
        kvcache = self._kvcache
        layers = range(kvcache.start_layer, kvcache.start_layer + kvcache.layer_num)
        locs = indices.to("cpu", torch.int64)
        # A request's locs are whole pages from its first token on.
        pages = indices[:: self.page_size].to(self.device, torch.int64)
        return offload.host_pool, locs, layers, pages // self.page_size

    def get_cpu_copy(self, indices, mamba_indices=None):
        """Retraction on a PD decode server (sglang keeps the KV of a retracted
        request in CPU memory): the KV rows from their host slots and the
        indexer-key pages, copied before the locs are freed."""
        host, locs, layers, pages = self._retraction_copy_targets(indices)
        index_k = self._kvcache.index_k_with_scale_buffer
        return {
            "kv_rows": [host.get_kv_buffer(layer)[locs] for layer in layers],
            "index_k": [buf[pages].cpu() for buf in index_k],
        }

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        """Resume a retracted request into its new locs (see ``get_cpu_copy``);
        the decode step that follows admits it and warms its region."""
        host, locs, layers, pages = self._retraction_copy_targets(indices)
        for layer, rows in zip(layers, kv_cache_cpu["kv_rows"]):
            host.get_kv_buffer(layer)[locs] = rows
        index_k = self._kvcache.index_k_with_scale_buffer
        for buf, saved in zip(index_k, kv_cache_cpu["index_k"]):
            buf[pages] = saved.to(self.device)


@dataclass(frozen=True)
class NSAKVOffloadGeometry:
    """The per-request GPU layout of the offload, fixed at startup: read once
    from the server args and the model config, then passed down (pool sizing,
    coordinator, controller, LRU state)."""

    top_k: int  # K, the indexer's top-k width
    buffer_size: int  # C, LRU slots per unit (--nsa-kv-offload-gpu-buffer-size)
    recent_window: int  # W, ring rows of the newest tokens
    max_units: int  # U, LRU units one request may hold

    @property
    def region_rows(self) -> int:
        """R = C + W: the GPU rows of one decode region."""
        return self.buffer_size + self.recent_window

    @classmethod
    def from_server_args(cls, server_args, hf_config) -> "NSAKVOffloadGeometry":
        from sglang.srt.configs.model_config import get_nsa_index_topk

        return cls(
            top_k=get_nsa_index_topk(hf_config),
            buffer_size=server_args.nsa_kv_offload_gpu_buffer_size,
            recent_window=server_args.nsa_kv_offload_recent_window,
            max_units=server_args.nsa_kv_offload_max_units,
        )


@dataclass
class NSAKVOffloadPoolSizes:
    """How the offload splits the GPU KV budget (all counts per rank)."""

    num_locs: int  # logical token locs = host slots
    num_regions: int  # decode regions = request slots
    region_rows: int  # R = C + W
    staging_rows: int
    page_size: int
    host_capacity_locs: int
    # The layout the sizes were computed for (None: sizes built by hand).
    geometry: Optional[NSAKVOffloadGeometry] = None
    # Regions beyond the request slots, only ever lent as extra units: GPU
    # memory the host pool left without locs to hold (spare_region_count).
    num_spare_regions: int = 0
    # Units of LRU state for units lent from the indexer keys of free locs
    # (IdleLocUnitLender); > 0 puts KV rows and keys in one arena per layer.
    idle_loc_units: int = 0

    @property
    def total_regions(self) -> int:
        """Regions the controller manages: request slots plus spare ones."""
        return self.num_regions + self.num_spare_regions

    @property
    def kv_pool_size(self) -> int:
        """``size`` of the KV pool: rows after the leading padding page."""
        return _round_up(
            self.staging_rows + self.total_regions * self.region_rows, self.page_size
        )

    @property
    def staging_start_row(self) -> int:
        return self.page_size

    @property
    def region_start_row(self) -> int:
        return self.page_size + self.staging_rows

    def requests_that_fit(self, tokens: int) -> int:
        """Requests of ``tokens`` tokens (prompt + output) held at once: each
        needs a decode region and its token locs (whole pages)."""
        return min(self.num_regions, self.num_locs // _round_up(tokens, self.page_size))

    def describe_capacity(self, context_len: int) -> str:
        """``16K x 254, 32K x 177, ..., 131584 x 62`` (the last: the context
        length), for the startup log: what ``--max-running-requests`` traded
        decode regions for."""
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
    """GPU bytes per logical token loc: indexer keys, the LRU residency map
    (a slot id per layer: ``lru_slot_id_bytes``) and ``loc_to_row`` (int64)."""
    return num_layers * (indexer_bytes + slot_id_bytes) + 8


def lru_unit_state_bytes(num_layers: int, buffer_size: int, max_units: int) -> int:
    """GPU bytes of the LRU state of one unit (``LRUCacheState`` holds it per
    unit): ``slot_loc`` int32 and an ``lru_order`` slot id per slot and layer
    (``lru_slot_id_bytes``: wide enough for ``max_units`` units)."""
    return num_layers * buffer_size * (4 + lru_slot_id_bytes(buffer_size, max_units))


def offload_bytes_per_region(
    num_layers: int,
    row_bytes: int,
    buffer_size: int,
    recent_window: int,
    max_units: int = 1,
) -> int:
    """GPU bytes per region (a request slot, or a spare region): its KV rows
    plus the LRU state of the one unit it is. More units per request cost
    no bytes per request slot: the units are regions and staging rows,
    each counted where it exists."""
    rows = buffer_size + recent_window
    return num_layers * rows * row_bytes + lru_unit_state_bytes(
        num_layers, buffer_size, max_units
    )


def sglang_pool_footprint(
    available_bytes: int, nominal_cell_bytes: int, real_cell_bytes: int
) -> int:
    """GPU bytes sglang's own NSA pool takes for ``available_bytes``: it
    counts ``available_bytes // nominal_cell_bytes`` tokens, its nominal cell
    being (kv_lora_rank + qk_rope_head_dim) KV elements plus the indexer keys
    per layer, and allocates each a ``real_cell_bytes`` cell (the fp8
    FlashMLA row is 656 B, not 576: ~11% more than the budget)."""
    return available_bytes // nominal_cell_bytes * real_cell_bytes


def max_spare_regions(num_regions: int, max_units: int) -> int:
    """What the request slots can borrow: ``max_units - 1`` extra units each."""
    return num_regions * max(0, max_units - 1)


def spare_region_count(
    leftover_bytes: int, region_bytes: int, num_regions: int, max_units: int
) -> int:
    """Spare regions the GPU bytes left after the locs pay for (the host pool
    or ``--max-total-tokens`` capped the locs), up to what the request slots
    can borrow (``max_spare_regions``). A spare region costs
    ``region_bytes`` (``offload_bytes_per_region``: its KV rows and its
    unit's LRU state)."""
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
    """Units of LRU state for units lent from free locs' indexer keys: as
    many as the keys of all ``num_locs`` hold (``buffer_size`` rows each),
    at most what the request slots can borrow beyond the spare regions."""
    if max_units <= 1:
        return 0
    fit = num_locs * indexer_bytes // ((buffer_size + 1) * row_bytes)
    room = max_spare_regions(num_regions, max_units) - num_spare_regions
    return int(max(0, min(fit, room)))


def staging_lru_units(
    staging_rows: int, page_size: int, buffer_size: int, max_units: int
) -> int:
    """Units idle prefill staging may lend at once (``StagingUnitLender``),
    each with a unit of LRU state: none with one unit per request."""
    if max_units <= 1:
        return 0
    return staging_unit_capacity(staging_rows // page_size, page_size, buffer_size)


def staging_reserve_rows(prefill_budget: int, num_regions: int, page_size: int) -> int:
    """Staging rows for two prefill batches (the overlap scheduler prepares one
    while another runs) and the partly used last page of every request in a
    batch (at most one per decode region; 64 at least)."""
    return 2 * prefill_budget + max(64, num_regions) * page_size


def prefill_staging_rows(
    context_len: int, prefill_budget: int, num_regions: int, page_size: int
) -> int:
    """GPU rows colocated prefills hold until their KV is backed up: one prompt
    being chunked (up to the context length) and ``staging_reserve_rows``.
    Sized for the worst case: running out would fail a prefill."""
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
    draft_bytes_per_loc: int = 0,
    spare_regions: bool = False,
    swap_scratch_bytes: int = 0,
    lend_idle_locs: bool = False,
) -> NSAKVOffloadPoolSizes:
    """Split ``available_bytes`` between fixed costs (regions, staging) and
    logical token locs, and cap the locs by what the host pool holds.
    ``draft_bytes_per_loc``: the MTP draft worker's KV pool (its NextN layer
    stays whole on the GPU, one row per token loc). ``spare_regions``: bytes
    the capped locs leave go to spare regions (``spare_region_count``).
    ``swap_scratch_bytes``: the LRU swap's per-batch-row scratch
    (``TritonLRUSwap.scratch_bytes``), a fixed cost. ``lend_idle_locs``: the
    locs' indexer keys may be lent as units (``idle_loc_lru_units`` units of
    LRU state, paid from the locs' share)."""
    staging_rows = _round_up(staging_rows, page_size)
    region_bytes = offload_bytes_per_region(
        num_layers, row_bytes, buffer_size, recent_window, max_units
    )
    # The staging rows, the regions and the LRU state of the units the
    # staging may lend.
    staging_units = staging_lru_units(staging_rows, page_size, buffer_size, max_units)
    fixed = (
        num_layers * (page_size + staging_rows) * row_bytes
        + num_regions * region_bytes
        + staging_units * lru_unit_state_bytes(num_layers, buffer_size, max_units)
        + swap_scratch_bytes
    )
    per_loc = offload_bytes_per_loc(
        num_layers, indexer_bytes, lru_slot_id_bytes(buffer_size, max_units)
    )
    per_loc += draft_bytes_per_loc
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
    num_spare = 0
    if spare_regions:
        num_spare = spare_region_count(
            available_bytes - fixed - num_locs * per_loc,
            region_bytes,
            num_regions,
            max_units,
        )
    num_idle_loc_units = 0
    if lend_idle_locs:
        num_idle_loc_units = idle_loc_lru_units(
            num_locs,
            num_layers * indexer_bytes,
            num_layers * row_bytes,
            buffer_size,
            num_regions,
            max_units,
            num_spare,
        )
        # Their LRU state comes out of the locs' bytes when those are short.
        state = num_idle_loc_units * lru_unit_state_bytes(
            num_layers, buffer_size, max_units
        )
        spare_bytes = num_spare * region_bytes
        short = fixed + num_locs * per_loc + spare_bytes + state - available_bytes
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


# KV layers of the MTP draft worker (DeepSeek-V3.2's one NextN layer).
NSA_KV_OFFLOAD_DRAFT_LAYERS = 1

# Default decode regions when --max-running-requests is not set: at most this
# share of the KV budget goes to regions, and at most this many regions.
_DEFAULT_REGION_BUDGET_FRACTION = 0.4
_DEFAULT_MAX_REGIONS = 256


class NSAKVOffloadPoolConfigurator:
    """Memory-pool sizing with the decode NSA KV offload on (see module doc).

    Plugs into ModelRunner's pool sizing like upstream's configurators:
    ``max_total_num_tokens`` is the number of logical token locs and
    ``max_running_requests`` the number of decode regions.
    """

    def __init__(self, mr):
        from sglang.srt.arg_groups.nsa_kv_offload_args import (
            idle_loc_units_enabled,
            spare_regions_enabled,
            swap_query_tokens,
        )
        from sglang.srt.configs.model_config import get_nsa_index_head_dim

        sa = mr.server_args
        self.geometry = NSAKVOffloadGeometry.from_server_args(
            sa, mr.model_config.hf_config
        )
        self.num_layers = mr.num_effective_layers
        self.row_bytes = mr.calculate_mla_kv_cache_dim() * torch._utils._element_size(
            mr.kv_cache_dtype
        )
        index_head_dim = get_nsa_index_head_dim(mr.model_config.hf_config)
        self.indexer_bytes = nsa_indexer_bytes(index_head_dim)
        # The KV row sglang's pool sizing counts (see sglang_pool_footprint).
        mc = mr.model_config
        self.nominal_row_bytes = (
            mc.kv_lora_rank + mc.qk_rope_head_dim
        ) * torch._utils._element_size(mr.kv_cache_dtype)
        self.buffer_size = self.geometry.buffer_size
        self.recent_window = self.geometry.recent_window
        self.host_pool_bytes = int(sa.nsa_kv_offload_host_pool_gb * (1 << 30))
        # Per rank: with DP attention --max-running-requests counts all DP
        # ranks, as in ModelRunner._resolve_max_num_reqs.
        self.user_max_running_requests = (
            None
            if sa.max_running_requests is None
            else sa.max_running_requests // max(mr.dp_size, 1)
        )
        self.context_len = mr.model_config.context_len
        self.prefill_budget = max(sa.chunked_prefill_size or 0, sa.max_prefill_tokens)
        self.max_total_tokens = sa.max_total_tokens
        self.kv_arrives_in_host = sa.disaggregation_mode == "decode"
        self.max_units = self.geometry.max_units
        # MTP: the draft worker's plain NSA pool (its NextN layer, KV and
        # indexer keys per token loc) shares this budget, like sglang's
        # configurators count a draft layer.
        self.draft_bytes_per_loc = (
            NSA_KV_OFFLOAD_DRAFT_LAYERS * (self.row_bytes + self.indexer_bytes)
            if sa.speculative_algorithm is not None
            else 0
        )
        self.spare_regions = spare_regions_enabled()
        self._spare_regions_resolved = 0
        self.lend_idle_locs = idle_loc_units_enabled()
        self._idle_loc_units_resolved = 0
        # The swap's scratch rows and width, as the coordinator sizes them.
        self.server_args = sa
        self.max_query_tokens = swap_query_tokens(sa)

    def staging_rows(self, num_regions: int, page_size: int) -> int:
        if self.kv_arrives_in_host:
            return 0
        return prefill_staging_rows(
            self.context_len, self.prefill_budget, num_regions, page_size
        )

    def _num_regions(self, available_bytes: int) -> int:
        if self.user_max_running_requests is not None:
            return self.user_max_running_requests
        per_region = offload_bytes_per_region(
            self.num_layers,
            self.row_bytes,
            self.buffer_size,
            self.recent_window,
            self.max_units,
        )
        share = int(_DEFAULT_REGION_BUDGET_FRACTION * available_bytes) // per_region
        return max(1, min(_DEFAULT_MAX_REGIONS, share))

    def compute_sizes(
        self, available_bytes: int, page_size: int, num_regions: Optional[int] = None
    ) -> NSAKVOffloadPoolSizes:
        if num_regions is None:
            num_regions = self._num_regions(available_bytes)
        sizes = compute_offload_pool_sizes(
            available_bytes=available_bytes,
            num_layers=self.num_layers,
            row_bytes=self.row_bytes,
            indexer_bytes=self.indexer_bytes,
            page_size=page_size,
            buffer_size=self.buffer_size,
            recent_window=self.recent_window,
            num_regions=num_regions,
            staging_rows=self.staging_rows(num_regions, page_size),
            host_pool_bytes=self.host_pool_bytes,
            max_total_tokens=self.max_total_tokens,
            max_units=self.max_units,
            draft_bytes_per_loc=self.draft_bytes_per_loc,
            spare_regions=self.spare_regions,
            swap_scratch_bytes=self.swap_scratch_bytes(num_regions),
            lend_idle_locs=self.lend_idle_locs,
        )
        sizes.geometry = self.geometry
        return sizes

    def swap_scratch_bytes(self, num_regions: int) -> int:
        """The LRU swap's scratch, sized as the coordinator sizes it."""
        from sglang.srt.arg_groups.nsa_kv_offload_args import swap_batch_rows
        from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import TritonLRUSwap

        g = self.geometry
        return TritonLRUSwap.scratch_bytes(
            rows=swap_batch_rows(self.server_args, num_regions),
            top_k=g.top_k,
            buffer_size=g.buffer_size,
            max_units=g.max_units,
            slot_id_bytes=lru_slot_id_bytes(g.buffer_size, g.max_units),
            max_query_tokens=self.max_query_tokens,
        )

    def budget_bytes(self, available_bytes: int) -> int:
        """The GPU bytes the offload's pools take: what sglang's own pool
        would take for the same ``--mem-fraction-static``, so that a server
        with the offload on uses the GPU memory it would use without."""
        return sglang_pool_footprint(
            available_bytes,
            self.num_layers * (self.nominal_row_bytes + self.indexer_bytes),
            self.num_layers * (self.row_bytes + self.indexer_bytes),
        )

    def calculate_pool_sizes(
        self, available_bytes: int, page_size: int
    ) -> NSAKVOffloadMemoryPoolConfig:
        budget = self.budget_bytes(available_bytes)
        if self.nominal_row_bytes != self.row_bytes:
            logger.info(
                "NSA KV offload: pools sized to %.2f GiB, what sglang's own pool "
                "takes for the %.2f GiB that --mem-fraction-static leaves (it "
                "counts %d B KV rows and allocates %d B ones).",
                budget / (1 << 30),
                available_bytes / (1 << 30),
                self.nominal_row_bytes,
                self.row_bytes,
            )
        sizes = self.compute_sizes(budget, page_size)
        self._num_regions_resolved = sizes.num_regions
        self._spare_regions_resolved = sizes.num_spare_regions
        self._idle_loc_units_resolved = sizes.idle_loc_units
        if self.lend_idle_locs and not sizes.idle_loc_units:
            from sglang.srt.arg_groups.nsa_kv_offload_args import ENV_IDLE_LOC_UNITS
            from sglang.srt.utils import get_bool_env_var

            # Asked for by name ("1", as the startup checks read it): a
            # warning; on by default: a note.
            asked = get_bool_env_var(ENV_IDLE_LOC_UNITS)
            (logger.warning if asked else logger.info)(
                "NSA KV offload: %s lends nothing here: %s.",
                ENV_IDLE_LOC_UNITS,
                (
                    "a request holds one unit (--nsa-kv-offload-max-units 1)"
                    if self.max_units <= 1
                    else "the locs' indexer keys hold no unit of "
                    f"{self.buffer_size} rows, or the spare regions give the "
                    "request slots every unit they can hold"
                ),
            )
        return NSAKVOffloadMemoryPoolConfig(
            max_total_num_tokens=sizes.num_locs,
            max_running_requests=sizes.num_regions,
            nsa_kv_offload_configurator=self,
        )

    def calculate_pool_sizes_from_max_tokens(
        self, max_total_num_tokens: int, page_size: int
    ) -> NSAKVOffloadMemoryPoolConfig:
        return NSAKVOffloadMemoryPoolConfig(
            max_total_num_tokens=max_total_num_tokens // page_size * page_size,
            max_running_requests=getattr(self, "_num_regions_resolved", None),
            nsa_kv_offload_configurator=self,
        )

    def final_sizes(
        self, num_locs: int, num_regions: int, page_size: int
    ) -> NSAKVOffloadPoolSizes:
        """Pool layout for the resolved token and request counts."""
        return NSAKVOffloadPoolSizes(
            num_locs=num_locs,
            num_regions=num_regions,
            region_rows=self.geometry.region_rows,
            staging_rows=_round_up(
                self.staging_rows(num_regions, page_size), page_size
            ),
            page_size=page_size,
            host_capacity_locs=self.host_pool_bytes
            // (self.num_layers * self.row_bytes),
            geometry=self.geometry,
            # Sized from the bytes of calculate_pool_sizes; never more than
            # the final request slots can borrow.
            num_spare_regions=min(
                self._spare_regions_resolved,
                max_spare_regions(num_regions, self.max_units),
            ),
            idle_loc_units=min(
                self._idle_loc_units_resolved,
                max_spare_regions(num_regions, self.max_units),
            ),
        )


@dataclass
class NSAKVOffloadMemoryPoolConfig(MemoryPoolConfig):
    """Upstream's resolved pool sizes plus the configurator that computed them.

    ModelRunner keeps it (``memory_pool_config``) until it builds the pools;
    the pool layout for the final token and request counts is then computed
    from the same configurator, once (``nsa_kv_offload_pool_kwargs``).
    """

    nsa_kv_offload_configurator: Optional[NSAKVOffloadPoolConfigurator] = None
