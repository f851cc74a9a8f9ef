"""Extra LRU units of the decode NSA KV offload: who lends them.

With ``--nsa-kv-offload-max-units U > 1`` a running request may hold up to
``U`` LRU units of ``C`` rows (``docs/ELASTIC_BUFFER.md``). The
``SparseCacheController`` borrows them from unit sources, in the order they
were added: free decode regions first (:class:`RegionUnitSource`), then the
indexer-key memory of free token locs (:class:`IdleLocUnitLender`, with the
locs' arena), then idle prefill staging pages (:class:`StagingUnitLender`;
both added by the coordinator), and gives them back when an admission, a loc
allocation or a prefill needs the rows.

Every source implements :class:`NSAKVOffloadUnitSource` and is known to the
controller by its name (``REGION_UNIT_SOURCE``, ``STAGING_UNIT_SOURCE``,
``IDLE_LOC_UNIT_SOURCE``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

import torch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.nsa_kv_offload_pool import (
        NSAKVOffloadTokenToKVPoolAllocator,
        StagingRowAllocator,
    )
    from sglang.srt.mem_cache.sparse_cache_controller import RegionAllocator


REGION_UNIT_SOURCE = "regions"  # free decode regions (always there)
STAGING_UNIT_SOURCE = "staging"  # idle prefill staging pages (coordinator)
IDLE_LOC_UNIT_SOURCE = "idle_locs"  # indexer keys of free locs (the arena)


def units_for_context(seq_len: int, buffer_size: int, recent_window: int) -> int:
    """LRU units of ``buffer_size`` slots that hold every position of a
    ``seq_len`` context below its recent window (what direct slots need; at
    least one)."""
    return max(1, -(-max(seq_len - recent_window, 0) // buffer_size))


def unit_pages(unit_rows: int, page_size: int) -> int:
    """Staging pages of one unit of ``unit_rows`` rows (a run of whole pages)."""
    return -(-unit_rows // page_size)


def staging_unit_capacity(num_pages: int, page_size: int, unit_rows: int) -> int:
    """Units of ``unit_rows`` rows ``num_pages`` staging pages hold at once."""
    return num_pages // unit_pages(unit_rows, page_size)


class NSAKVOffloadUnitSource(Protocol):
    """A lender of extra LRU units (``buffer_size`` rows each)."""

    def available(self) -> bool:
        """Whether :meth:`take` may find a unit (host only, cheap)."""

    def take(self) -> Optional[int]:
        """First GPU row of a unit now lent, or None."""

    def give(self, base: int) -> None:
        """Take back the unit starting at row ``base``."""


class RegionUnitSource:
    """Free regions, lent as extra LRU units (the first unit source)."""

    def __init__(self, regions: RegionAllocator):
        self.regions = regions

    def available(self) -> bool:
        return self.regions.available_size() > 0

    def take(self) -> Optional[int]:
        return self.regions.alloc_contiguous()

    def give(self, base: int) -> None:
        self.regions.free(base)


class StagingUnitLender:
    """Lends runs of idle prefill staging pages as extra LRU units
    (``SparseCacheController.add_unit_source``), keeping ``reserve_pages``
    free for the next prefills; the allocator takes units back when a
    prefill needs their pages."""

    def __init__(self, staging: StagingRowAllocator, unit_rows: int, reserve_pages):
        self.staging = staging
        self.pages_per_unit = unit_pages(unit_rows, staging.page_size)
        self.reserve_pages = reserve_pages
        # Free page count at which the last search found no run: no new
        # search (a host read of the free list) until the count changes.
        self._no_run_at = None

    def available(self) -> bool:
        free = self.staging.available_pages()
        if free == self._no_run_at:
            return False
        return free - self.reserve_pages >= self.pages_per_unit

    def take(self) -> Optional[int]:
        """First row of a run of free pages (the highest run), or None.
        Reads the free list on the host: only called while rebalancing."""
        if not self.available():
            return None
        n = self.pages_per_unit
        free = sorted(self.staging.free_pages.tolist())
        for end in range(len(free) - 1, n - 2, -1):
            if free[end] - free[end - n + 1] == n - 1:
                first = free[end - n + 1]
                rest = free[: end - n + 1] + free[end + 1 :]
                self.staging.free_pages = torch.tensor(
                    rest, dtype=torch.int64, device=self.staging.device
                )
                return self.staging.start_row + first * self.staging.page_size
        self._no_run_at = len(free)
        return None

    def give(self, base: int) -> None:
        first = (base - self.staging.start_row) // self.staging.page_size
        self.staging.free(
            torch.arange(
                first,
                first + self.pages_per_unit,
                dtype=torch.int64,
                device=self.staging.device,
            )
        )


def idle_loc_unit_pages(unit_rows: int, row_bytes: int, index_page_bytes: int) -> int:
    """Loc pages whose indexer-key bytes hold ``unit_rows`` whole KV rows
    wherever the run starts (a run's first row may start up to one row after
    its first byte)."""
    return -(-(unit_rows + 1) * row_bytes // index_page_bytes)


def idle_loc_reserve_pages(num_regions: int) -> int:
    """Free loc pages the idle-loc lender leaves: two decode pages per
    request slot (the overlap scheduler allocates one step ahead)."""
    return 2 * num_regions


class IdleLocUnitLender:
    """Lends the indexer-key memory of free token-loc pages as extra LRU units.

    With the arena (``NSAKVOffloadPoolSizes.idle_loc_units``) each layer's KV
    rows and indexer-key pages share one buffer, so the bytes of a run of free
    loc pages are also KV rows (``NSAKVOffloadTokenToKVPool.rows_of_pages``).
    A lent run leaves the allocator's free list; the allocator counts it as
    free for the scheduler and takes units back when an allocation needs the
    pages (``NSAKVOffloadTokenToKVPoolAllocator``). ``reserve_pages`` stay free
    for the next decode steps' pages, so that a step rarely waits for a
    take-back."""

    def __init__(
        self,
        allocator: NSAKVOffloadTokenToKVPoolAllocator,
        unit_rows: int,
        reserve_pages: int,
    ):
        pool = allocator.get_kvcache()
        self.allocator = allocator
        self.unit_rows = unit_rows
        self.pages_per_unit = idle_loc_unit_pages(
            unit_rows, pool.kv_row_bytes, pool.index_page_bytes
        )
        self.reserve_pages = reserve_pages
        self._rows_of_pages = pool.rows_of_pages
        # First page of each lent run, by the unit's first row.
        self._lent = {}
        self._no_run_at = None

    def lent_pages(self) -> int:
        return len(self._lent) * self.pages_per_unit

    def lent_page_runs(self) -> frozenset:
        """First pages of the runs lent now (``backup_state`` keeps them)."""
        return frozenset(self._lent.values())

    def run_pages(self, first_page: int) -> torch.Tensor:
        return torch.arange(
            first_page,
            first_page + self.pages_per_unit,
            dtype=torch.int64,
            device=self.allocator.device,
        )

    def available(self) -> bool:
        free = self.allocator.free_page_count()
        if free == self._no_run_at:
            return False
        return free - self.reserve_pages >= self.pages_per_unit

    def take(self) -> Optional[int]:
        """First row of a unit in the highest run of free pages, or None (the
        allocator hands out low pages first). Reads the free list on the
        host: only called while rebalancing."""
        if not self.available():
            return None
        allocator, n = self.allocator, self.pages_per_unit
        allocator.merge_and_sort_free()
        free = allocator.free_pages.tolist()
        free.sort()
        for end in range(len(free) - 1, n - 2, -1):
            if free[end] - free[end - n + 1] == n - 1:
                first = free[end - n + 1]
                allocator.free_pages = torch.tensor(
                    free[: end - n + 1] + free[end + 1 :],
                    dtype=torch.int64,
                    device=allocator.device,
                )
                base, _ = self._rows_of_pages(first, n)
                self._lent[base] = first
                return base
        self._no_run_at = len(free)
        return None

    def give(self, base: int) -> None:
        first = self._lent.pop(base)
        self.allocator.return_pages(self.run_pages(first))
