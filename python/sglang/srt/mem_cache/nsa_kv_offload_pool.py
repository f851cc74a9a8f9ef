"""GPU-side pools of the decode NSA KV offload.

The indexer keys stay on the GPU for every token loc; the GPU's KV rows are

    [0, page_size)                 padding rows (loc 0 of padded batches)
    [page_size, + staging_rows)    prefill staging: prompt KV until backed up
    [.., + num_regions * R)        one decode region of R = C + W rows per request
    [.., + num_spare_regions * R)  spare regions: lent as units only

Every KV write goes through ``loc_to_row``: prefill maps new pages onto
staging pages, decode each new token onto its window ring row (a PD decode
server has no staging rows: docs/INTEGRATION.md, "PD decode").
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Optional, Tuple

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.nsa_kv_offload_compat import SparseTokenToKVPool, write_locs
from sglang.srt.mem_cache.nsa_kv_offload_sizing import (
    NSAKVOffloadPoolSizes,
    _round_up,
    nsa_indexer_bytes,
)
from sglang.srt.utils import get_num_new_pages


def get_nsa_kv_offload(tree_cache):
    """The offload coordinator the scheduler gave its tree cache, or None."""
    return getattr(tree_cache, "nsa_kv_offload", None)


class NSAKVOffloadTokenToKVPool(SparseTokenToKVPool):
    """sglang's sparse-attention pool whose KV rows are addressed through ``loc_to_row``;
    ``size``: token locs; ``verify``: also keep the full KV pool."""

    def __init__(self, size: int, sizes: NSAKVOffloadPoolSizes, verify=False, **kw):
        page_size = kw["page_size"]
        self.sizes = sizes
        self.num_locs = size
        self.index_page_bytes = page_size * nsa_indexer_bytes(kw["index_head_dim"])
        # Upstream's page count for index_buf_size = size.
        self.num_index_pages = (size + page_size + 1) // page_size
        # The arena: KV rows and indexer keys in one buffer per layer.
        self.uses_arena = sizes.idle_loc_units > 0
        self.verify = verify
        self.host_pool = None  # set by the coordinator
        index_buf_size = 0 if self.uses_arena else size  # arena: a placeholder
        super().__init__(size=sizes.kv_pool_size, index_buf_size=index_buf_size, **kw)
        # Unmapped locs map to the padding rows; the last entry keeps -1 at -1.
        self.loc_to_row = torch.zeros(
            size + page_size + 1, dtype=torch.int64, device=self.device
        )
        self.loc_to_row[-1] = -1

    def _zeros(self, count: int, shape, dtype):
        # ``count`` buffers, allocated as upstream allocates its KV rows.
        pool = self.custom_mem_pool
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE), (
            torch.cuda.use_mem_pool(pool) if pool else nullcontext()
        ):
            return [
                torch.zeros(shape, dtype=dtype, device=self.device)
                for _ in range(count)
            ]

    def _create_buffers(self):
        """Upstream's KV rows, or with the arena one uint8 buffer per layer: KV
        rows to ``index_offset``, the indexer-key pages to ``index_end``, then
        padding; ``kv_buffer[layer]`` views it all as KV rows."""
        self.kv_row_bytes = self.kv_cache_dim * self.store_dtype.itemsize
        self.verify_kv_buffer = None
        if self.verify:
            shape = (self.num_locs + self.page_size, 1, self.kv_cache_dim)
            self.verify_kv_buffer = self._zeros(self.layer_num, shape, self.store_dtype)
        if not self.uses_arena:
            return super()._create_buffers()
        kv_bytes = (self.size + self.page_size) * self.kv_row_bytes
        # 4 KiB-aligned key pages, as an allocation of their own would be.
        self.index_offset = _round_up(kv_bytes, 4096)
        self.index_end = (
            self.index_offset + self.num_index_pages * self.index_page_bytes
        )
        total = _round_up(-(-self.index_end // self.kv_row_bytes), self.page_size)
        self._arenas = self._zeros(
            self.layer_num, total * self.kv_row_bytes, torch.uint8
        )
        self.kv_buffer = [
            arena.view(self.store_dtype).view(total, 1, self.kv_cache_dim)
            for arena in self._arenas
        ]

    def _arena_index_pages(self):
        keys = slice(self.index_offset, self.index_end)
        shape = (self.num_index_pages, self.index_page_bytes)
        return [a[keys].view(shape) for a in self._arenas]

    def _create_index_buffers(self):
        """Upstream's indexer-key pages, or the arena's (no placeholder page)."""
        if not self.uses_arena:
            return super()._create_index_buffers()
        self.index_k_with_scale_buffer = self._arena_index_pages()

    def _create_index_key_cache(self):
        """0.5.23: upstream's key cache, its pages the arena's with the arena."""
        cache = super()._create_index_key_cache()
        if self.uses_arena:
            cache.buffer = self._arena_index_pages()
        return cache

    def _clear_buffers(self):
        super()._clear_buffers()
        self.verify_kv_buffer = None
        if self.uses_arena:
            del self._arenas

    def rows_of_pages(self, first_page: int, num_pages: int) -> Tuple[int, int]:
        """The KV rows ``[first, end)`` within the key bytes of those loc pages."""
        start = self.index_offset + first_page * self.index_page_bytes
        end = start + num_pages * self.index_page_bytes
        return -(-start // self.kv_row_bytes), end // self.kv_row_bytes

    def translate_loc_to_row(self, loc: torch.Tensor) -> torch.Tensor:
        return self.loc_to_row[loc]

    @contextmanager
    def _into_verify_pool(self):
        # Upstream's own write into the full pool, at the token locs.
        rows, self.kv_buffer = self.kv_buffer, self.verify_kv_buffer
        try:
            yield
        finally:
            self.kv_buffer = rows

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, **kw):
        loc = write_locs(loc_info)
        super().set_kv_buffer(layer, self.loc_to_row[loc], cache_k, cache_v, **kw)
        if self.verify_kv_buffer is not None:
            with self._into_verify_pool():
                super().set_kv_buffer(layer, loc, cache_k, cache_v, **kw)

    def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope, **kw):
        loc = write_locs(loc_info)
        rows = self.loc_to_row[loc]
        super().set_mla_kv_buffer(layer, rows, cache_k_nope, cache_k_rope, **kw)
        if self.verify_kv_buffer is not None:
            with self._into_verify_pool():
                super().set_mla_kv_buffer(layer, loc, cache_k_nope, cache_k_rope, **kw)

    def get_mla_kv_buffer(self, layer, loc, dst_dtype=None):
        return super().get_mla_kv_buffer(layer, self.loc_to_row[loc], dst_dtype)

    def _retraction_targets(self, indices):
        # Syncs: the new tokens are on the host, no copy reads these slots.
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        layers = range(self.start_layer, self.start_layer + self.layer_num)
        # A request's locs are whole pages from its first token on.
        pages = indices[:: self.page_size].to(self.device, torch.int64)
        return indices.to("cpu", torch.int64), layers, pages // self.page_size

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        """PD retraction: a request's host KV rows and indexer-key pages."""
        locs, layers, pages = self._retraction_targets(indices)
        return {
            "kv_rows": [self.host_pool.get_kv_buffer(i)[locs] for i in layers],
            "index_k": [buf[pages].cpu() for buf in self.index_k_with_scale_buffer],
        }

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, **kw):
        """Resume a retracted request into its new locs (``get_cpu_copy``)."""
        locs, layers, pages = self._retraction_targets(indices)
        for layer, rows in zip(layers, kv_cache_cpu["kv_rows"]):
            self.host_pool.get_kv_buffer(layer)[locs] = rows
        for buf, saved in zip(self.index_k_with_scale_buffer, kv_cache_cpu["index_k"]):
            buf[pages] = saved.to(self.device)


class StagingRowAllocator:
    """Free list of GPU staging pages (``page_size`` rows each) for prefill KV."""

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
        pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        return pages

    def free(self, pages: torch.Tensor) -> None:
        if pages.numel():
            self.free_pages = torch.cat((pages, self.free_pages))


class NSAKVOffloadTokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Paged allocator of token locs giving every new prefill page a staging page
    until freed or admitted (``release_staging``); lent units come back through
    ``reclaim_staging(pages)`` and ``reclaim_idle_locs(pages)``."""

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
        # MTP: decoding requests extend too; telling them apart syncs.
        self.speculative = speculative
        self.staging = StagingRowAllocator(
            staging_start_row, staging_rows // page_size, page_size, device
        )
        # First staging row of each logical page, -1 when the page has none.
        self.page_to_staging_row = torch.full(
            (size // page_size + 2,), -1, dtype=torch.int64, device=device
        )
        self.reclaim_staging: Optional[Callable[[int], bool]] = None
        self.reclaim_idle_locs: Optional[Callable[[int], bool]] = None
        # Lends free loc pages as units: its runs are off the free list.
        self.idle_loc_lender = None
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)

    def clear(self):
        super().clear()
        self.staging.clear()
        self.page_to_staging_row.fill_(-1)
        if self.idle_loc_lender is not None:
            # Runs still lent stay out of the free list.
            self._drop_from_free(self.idle_loc_lender.lent_page_runs())

    def free_page_count(self) -> int:
        """Pages on the free lists (lent runs excluded)."""
        return super().available_size() // self.page_size

    def available_size(self):
        # Lent runs count as free (_alloc_or_reclaim takes them back).
        lent = self.idle_loc_lender.lent_pages() if self.idle_loc_lender else 0
        return super().available_size() + lent * self.page_size

    def return_pages(self, pages: torch.Tensor) -> None:
        """A lent run back on the free list (``IdleLocUnitLender.give``)."""
        if self.need_sort:  # sorted in at the next merge
            super()._release_page_ids(pages)
        else:
            self.free_pages = torch.cat((self.free_pages, pages))

    def _drop_from_free(self, first_pages) -> None:
        if not first_pages:
            return
        self.merge_and_sort_free()
        lender = self.idle_loc_lender
        runs = torch.cat([lender.run_pages(p) for p in sorted(first_pages)])
        self.free_pages = self.free_pages[~torch.isin(self.free_pages, runs)]

    def _alloc_or_reclaim(self, alloc, num_pages):
        """``alloc()``, after taking lent units back if fewer than ``num_pages()``
        pages are free (upstream's kernels read that many free-list entries)."""
        if self.idle_loc_lender is not None and self.reclaim_idle_locs is not None:
            needed = num_pages()
            if needed > self.free_page_count():
                self.reclaim_idle_locs(needed)
        return alloc()

    def alloc(self, need_size: int):
        upstream = super().alloc
        return self._alloc_or_reclaim(
            lambda: upstream(need_size), lambda: need_size // self.page_size
        )

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        upstream = super().alloc_decode
        return self._alloc_or_reclaim(
            lambda: upstream(seq_lens, seq_lens_cpu, last_loc),
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
        upstream = super().alloc_extend
        lens = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc)
        out = self._alloc_or_reclaim(
            lambda: upstream(*lens, extend_num_tokens, *args, **kwargs),
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
            # MTP draft / verify locs of decoding requests: no staging page.
            return out
        if self.staging.num_pages == 0:
            # KV arrives in host slots; reused locs map to the padding rows.
            self._kvcache.loc_to_row[out] = 0
            return out
        # A page is new to this extend iff its first token is in it (syncs).
        new_pages = out[out % self.page_size == 0] // self.page_size
        staging_pages = self.staging.alloc(new_pages.numel())
        if staging_pages is None and self.reclaim_staging is not None:
            if self.reclaim_staging(new_pages.numel()):
                staging_pages = self.staging.alloc(new_pages.numel())
        if staging_pages is None:
            # Only the pages this extend took (not a continued first page).
            super().free(new_pages * self.page_size)
            raise RuntimeError(
                "NSA KV offload: out of GPU staging rows for prefill "
                f"({self.staging.num_pages} pages). Lower --chunked-prefill-size "
                "or --context-length."
            )
        first_rows = self.staging.start_row + staging_pages * self.page_size
        self.page_to_staging_row[new_pages] = first_rows
        rows = self.page_to_staging_row[out // self.page_size] + out % self.page_size
        self._kvcache.loc_to_row[out] = rows
        return out

    def _extends_decoding_reqs(self, last_loc: torch.Tensor) -> bool:
        """Whether an extend continues admitted locs (last loc's page has no
        staging row; ``-1``: a new prompt). Syncs once."""
        pages = last_loc.clamp(min=0) // self.page_size
        decoding = (last_loc >= 0) & (self.page_to_staging_row[pages] < 0)
        num_decoding = int(decoding.sum())
        if 0 < num_decoding < last_loc.numel():
            # A request not admitted before its draft pass lands here.
            raise RuntimeError(
                "NSA KV offload: an extend mixes prompts and decoding requests"
            )
        return num_decoding > 0

    def release_staging(self, locs: torch.Tensor) -> None:
        """Return the staging pages behind ``locs`` (any loc of a page frees it)."""
        if locs.numel():
            self._release_staging_pages(torch.unique(locs // self.page_size))

    def _release_staging_pages(self, pages: torch.Tensor) -> None:
        rows = self.page_to_staging_row[pages]
        staged = rows >= 0
        if bool(staged.any()):
            self.staging.free((rows[staged] - self.staging.start_row) // self.page_size)
            self.page_to_staging_row[pages[staged]] = -1

    def _release_page_ids(self, *page_ids: torch.Tensor):
        # The sink of every free path (free, free_segment, groups).
        self._release_staging_pages(torch.cat(page_ids))
        super()._release_page_ids(*page_ids)


def create_nsa_kv_offload_allocator(builder, need_sort: bool, kvcache=None):
    """The allocator of ``kvcache`` (default: the builder's pool)."""
    kvcache = builder.token_to_kv_pool if kvcache is None else kvcache
    return NSAKVOffloadTokenToKVPoolAllocator(
        kvcache.num_locs,
        page_size=kvcache.page_size,
        dtype=kvcache.dtype,
        device=kvcache.device,
        kvcache=kvcache,
        need_sort=need_sort,
        staging_start_row=kvcache.sizes.staging_start_row,
        staging_rows=kvcache.sizes.staging_rows,
        speculative=builder.server_args.speculative_algorithm is not None,
    )
