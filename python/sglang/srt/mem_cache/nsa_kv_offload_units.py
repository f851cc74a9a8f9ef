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

from typing import TYPE_CHECKING, List, Optional, Protocol

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


class _PageRunLender:
    """Lends runs of ``pages_per_unit`` free pages as units, the highest run
    first, keeping ``reserve_pages`` free. Subclasses say where the free
    list is and which row a run starts."""

    def __init__(self, pages_per_unit: int, reserve_pages: int, device):
        self.pages_per_unit = pages_per_unit
        self.reserve_pages = reserve_pages
        self.device = device
        # Free page count at which the last search found no run: no new
        # search (a host read of the free list) until the count changes.
        self._no_run_at = None

    def _free_page_count(self) -> int:
        raise NotImplementedError

    def _free_pages(self) -> List[int]:
        raise NotImplementedError

    def _set_free_pages(self, pages: List[int]) -> None:
        raise NotImplementedError

    def _lend_run(self, first_page: int) -> int:
        """Record the run from ``first_page`` as lent; its unit's first row."""
        raise NotImplementedError

    def run_pages(self, first_page: int) -> torch.Tensor:
        """The pages of the run from ``first_page``."""
        return torch.arange(
            first_page,
            first_page + self.pages_per_unit,
            dtype=torch.int64,
            device=self.device,
        )

    def available(self) -> bool:
        free = self._free_page_count()
        if free == self._no_run_at:
            return False
        return free - self.reserve_pages >= self.pages_per_unit

    def take(self) -> Optional[int]:
        """First row of a unit in the highest run of free pages, or None.
        Reads the free list on the host: only called while rebalancing."""
        if not self.available():
            return None
        n = self.pages_per_unit
        free = sorted(self._free_pages())
        for end in range(len(free) - 1, n - 2, -1):
            if free[end] - free[end - n + 1] == n - 1:
                self._set_free_pages(free[: end - n + 1] + free[end + 1 :])
                return self._lend_run(free[end - n + 1])
        self._no_run_at = len(free)
        return None


class StagingUnitLender(_PageRunLender):
    """Lends runs of idle prefill staging pages as extra LRU units
    (``SparseCacheController.add_unit_source``), keeping ``reserve_pages``
    free for the next prefills; the allocator takes units back when a
    prefill needs their pages."""

    def __init__(self, staging: StagingRowAllocator, unit_rows: int, reserve_pages):
        super().__init__(
            unit_pages(unit_rows, staging.page_size), reserve_pages, staging.device
        )
        self.staging = staging

    def _free_page_count(self) -> int:
        return self.staging.available_pages()

    def _free_pages(self) -> List[int]:
        return self.staging.free_pages.tolist()

    def _set_free_pages(self, pages: List[int]) -> None:
        self.staging.free_pages = torch.tensor(
            pages, dtype=torch.int64, device=self.device
        )

    def _lend_run(self, first_page: int) -> int:
        return self.staging.start_row + first_page * self.staging.page_size

    def give(self, base: int) -> None:
        first = (base - self.staging.start_row) // self.staging.page_size
        self.staging.free(self.run_pages(first))


def idle_loc_unit_pages(unit_rows: int, row_bytes: int, index_page_bytes: int) -> int:
    """Loc pages whose indexer-key bytes hold ``unit_rows`` whole KV rows
    wherever the run starts (a run's first row may start up to one row after
    its first byte)."""
    return -(-(unit_rows + 1) * row_bytes // index_page_bytes)


def idle_loc_reserve_pages(num_regions: int) -> int:
    """Free loc pages the idle-loc lender leaves: two decode pages per
    request slot (the overlap scheduler allocates one step ahead)."""
    return 2 * num_regions


class IdleLocUnitLender(_PageRunLender):
    """Lends the indexer-key memory of free token-loc pages as extra LRU units.

    With the arena (``NSAKVOffloadPoolSizes.idle_loc_units``) each layer's KV
    rows and indexer-key pages share one buffer, so the bytes of a run of free
    loc pages are also KV rows (``NSAKVOffloadTokenToKVPool.rows_of_pages``).
    A lent run leaves the allocator's free list; the allocator counts it as
    free for the scheduler and takes units back when an allocation needs the
    pages (``NSAKVOffloadTokenToKVPoolAllocator``). ``reserve_pages`` stay free
    for the next decode steps' pages, so that a step rarely waits for a
    take-back. The allocator hands out low pages first, so the highest runs
    stay free longest."""

    def __init__(
        self,
        allocator: NSAKVOffloadTokenToKVPoolAllocator,
        unit_rows: int,
        reserve_pages: int,
    ):
        pool = allocator.get_kvcache()
        super().__init__(
            idle_loc_unit_pages(unit_rows, pool.kv_row_bytes, pool.index_page_bytes),
            reserve_pages,
            allocator.device,
        )
        self.allocator = allocator
        self._rows_of_pages = pool.rows_of_pages
        # First page of each lent run, by the unit's first row.
        self._lent = {}

    def lent_pages(self) -> int:
        return len(self._lent) * self.pages_per_unit

    def lent_page_runs(self) -> frozenset:
        """First pages of the runs lent now (``backup_state`` keeps them)."""
        return frozenset(self._lent.values())

    def _free_page_count(self) -> int:
        return self.allocator.free_page_count()

    def _free_pages(self) -> List[int]:
        self.allocator.merge_and_sort_free()
        return self.allocator.free_pages.tolist()

    def _set_free_pages(self, pages: List[int]) -> None:
        self.allocator.free_pages = torch.tensor(
            pages, dtype=torch.int64, device=self.device
        )

    def _lend_run(self, first_page: int) -> int:
        base, _ = self._rows_of_pages(first_page, self.pages_per_unit)
        self._lent[base] = first_page
        return base

    def give(self, base: int) -> None:
        first = self._lent.pop(base)
        self.allocator.return_pages(self.run_pages(first))
