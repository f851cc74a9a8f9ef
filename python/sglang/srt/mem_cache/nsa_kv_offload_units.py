"""Extra LRU units of the decode NSA KV offload: who lends them.

With ``--nsa-kv-offload-max-units U > 1`` a running request may hold up to
``U`` LRU units of ``C`` rows (``docs/ELASTIC_BUFFER.md``). The
``SparseCacheController`` borrows them from unit sources, in the order they
were added: free decode regions first (:class:`RegionUnitSource`), then idle
prefill staging pages (:class:`StagingUnitLender`, added by the coordinator),
and gives them back when an admission or a prefill needs the rows.

Every source implements :class:`NSAKVOffloadUnitSource` and is known to the
controller by its name (``REGION_UNIT_SOURCE``, ``STAGING_UNIT_SOURCE``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

import torch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.nsa_kv_offload_pool import StagingRowAllocator
    from sglang.srt.mem_cache.sparse_cache_controller import RegionAllocator


REGION_UNIT_SOURCE = "regions"  # free decode regions (always there)
STAGING_UNIT_SOURCE = "staging"  # idle prefill staging pages (coordinator)


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
