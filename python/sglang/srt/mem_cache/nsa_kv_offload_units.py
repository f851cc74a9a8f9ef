"""LRU units of the decode NSA KV offload: who holds which GPU rows.

An admitted request holds its region (unit 0: ``C`` LRU rows and a ``W``-row
window ring) and extra units of ``C`` rows lent by named sources: free regions
(:class:`RegionAllocator`), free locs' indexer keys (:class:`IdleLocUnitLender`)
and idle staging pages (:class:`StagingUnitLender`). :class:`UnitLedger` keeps
the host bookkeeping and decides who grows, moves and gives back;
``SparseCacheController`` carries it out (docs/ELASTIC_BUFFER.md).
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Protocol, Tuple

import torch

REGION_UNIT_SOURCE = "regions"  # free decode regions
IDLE_LOC_UNIT_SOURCE = "idle_locs"  # indexer keys of free locs (the arena)
STAGING_UNIT_SOURCE = "staging"  # idle prefill staging pages


def units_for_context(seq_len: int, buffer_size: int, recent_window: int) -> int:
    """Units holding a ``seq_len`` context below its recent window (at least 1)."""
    return max(1, -(-max(seq_len - recent_window, 0) // buffer_size))


def unit_pages(unit_rows: int, page_size: int) -> int:
    """Staging pages of one unit of ``unit_rows`` rows (a run of whole pages)."""
    return -(-unit_rows // page_size)


def staging_unit_capacity(num_pages: int, page_size: int, unit_rows: int) -> int:
    """Units of ``unit_rows`` rows ``num_pages`` staging pages hold at once."""
    return num_pages // unit_pages(unit_rows, page_size)


def idle_loc_unit_pages(unit_rows: int, row_bytes: int, index_page_bytes: int) -> int:
    """Loc pages whose key bytes hold ``unit_rows`` KV rows wherever they start."""
    return -(-(unit_rows + 1) * row_bytes // index_page_bytes)


def idle_loc_reserve_pages(num_regions: int) -> int:
    """Free loc pages the idle-loc lender leaves: two decode pages per slot."""
    return 2 * num_regions


class UnitSource(Protocol):
    """A lender of LRU units (``buffer_size`` rows each)."""

    def available(self) -> bool:
        """Whether :meth:`take` may find a unit (host only, cheap)."""

    def take(self) -> Optional[int]:
        """First GPU row of a unit now lent, or None."""

    def give(self, base: int) -> None:
        """Take back the unit starting at row ``base``."""


class RegionAllocator:
    """Free list of ``num_regions`` regions of ``region_rows`` GPU rows from
    ``start_row``, lowest first; as a unit source it lends whole regions."""

    def __init__(self, start_row: int, region_rows: int, num_regions: int):
        if start_row < 0 or region_rows <= 0 or num_regions < 0:
            raise ValueError(
                f"bad regions: start_row={start_row} region_rows={region_rows} "
                f"num_regions={num_regions}"
            )
        self.start_row = start_row
        self.region_rows = region_rows
        self.num_regions = num_regions
        self.clear()

    def clear(self) -> None:
        self._free: List[int] = list(range(self.num_regions))
        self._used = set()

    @property
    def end_row(self) -> int:
        return self.start_row + self.num_regions * self.region_rows

    def available_size(self) -> int:
        return len(self._free)

    def alloc_contiguous(self) -> Optional[int]:
        """First row of a free region, or None when every region is taken."""
        if not self._free:
            return None
        region = heapq.heappop(self._free)
        self._used.add(region)
        return self.start_row + region * self.region_rows

    def free(self, base_row: int) -> None:
        region, rem = divmod(base_row - self.start_row, self.region_rows)
        if rem != 0 or region not in self._used:
            raise ValueError(f"row {base_row} is not the base of an allocated region")
        self._used.remove(region)
        heapq.heappush(self._free, region)

    available = available_size
    take = alloc_contiguous
    give = free


class _PageRunLender:
    """Lends runs of ``pages_per_unit`` free pages as units, the highest run
    first, keeping ``reserve_pages`` free (subclasses: the free list, rows)."""

    def __init__(self, pages_per_unit: int, reserve_pages: int, device):
        self.pages_per_unit = pages_per_unit
        self.reserve_pages = reserve_pages
        self.device = device
        # Free page count of the last search that found no run.
        self._no_run_at = None

    def run_pages(self, first_page: int) -> torch.Tensor:
        end = first_page + self.pages_per_unit
        return torch.arange(first_page, end, dtype=torch.int64, device=self.device)

    def _set_free_pages(self, pages: List[int]) -> None:
        # The free list's owner: the staging or the loc allocator.
        owner, dev = self._free_list_owner, self.device
        owner.free_pages = torch.tensor(pages, dtype=torch.int64, device=dev)

    def available(self) -> bool:
        free = self._free_page_count()
        fits = free - self.reserve_pages >= self.pages_per_unit
        return fits and free != self._no_run_at

    def take(self) -> Optional[int]:
        """First row of a unit in the highest free run, or None (host read)."""
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
    """Idle staging pages lent as units, ``reserve_pages`` kept free."""

    def __init__(self, staging, unit_rows: int, reserve_pages: int):
        pages = unit_pages(unit_rows, staging.page_size)
        super().__init__(pages, reserve_pages, staging.device)
        self.staging = self._free_list_owner = staging

    def _free_page_count(self) -> int:
        return self.staging.available_pages()

    def _free_pages(self) -> List[int]:
        return self.staging.free_pages.tolist()

    def _lend_run(self, first_page: int) -> int:
        return self.staging.start_row + first_page * self.staging.page_size

    def give(self, base: int) -> None:
        first = (base - self.staging.start_row) // self.staging.page_size
        self.staging.free(self.run_pages(first))


class IdleLocUnitLender(_PageRunLender):
    """Free loc pages' indexer-key bytes lent as units (``rows_of_pages``): a
    lent run is off the free list but counts as free; ``reserve_pages`` stay
    free and high runs are lent (low pages go first)."""

    def __init__(self, allocator, unit_rows: int, reserve_pages: int):
        pool = allocator.get_kvcache()
        pages = idle_loc_unit_pages(unit_rows, pool.kv_row_bytes, pool.index_page_bytes)
        super().__init__(pages, reserve_pages, allocator.device)
        self.allocator = self._free_list_owner = allocator
        self._rows_of_pages = pool.rows_of_pages
        # First page of each lent run, by the unit's first row.
        self._lent = {}

    def lent_pages(self) -> int:
        return len(self._lent) * self.pages_per_unit

    def lent_page_runs(self) -> frozenset:
        """First pages of the runs lent now."""
        return frozenset(self._lent.values())

    def _free_page_count(self) -> int:
        return self.allocator.free_page_count()

    def _free_pages(self) -> List[int]:
        self.allocator.merge_and_sort_free()
        return self.allocator.free_pages.tolist()

    def _lend_run(self, first_page: int) -> int:
        base, _ = self._rows_of_pages(first_page, self.pages_per_unit)
        self._lent[base] = first_page
        return base

    def give(self, base: int) -> None:
        first = self._lent.pop(base)
        self.allocator.return_pages(self.run_pages(first))


Unit = Tuple[int, str]  # (first GPU row, name of its source)


class UnitLedger:
    """Host bookkeeping of every admitted request's units and the decisions on
    them (grow, move, give back); it changes no GPU state."""

    def __init__(self, regions: RegionAllocator, max_units: int):
        self.regions = regions
        self.max_units = max_units
        # Lenders by name, asked in this order: free regions first.
        self.sources: Dict[str, UnitSource] = {REGION_UNIT_SOURCE: regions}
        self._base: Dict[int, int] = {}  # request -> its region's first row
        self._units: Dict[int, List[Unit]] = {}  # extra units, oldest first
        self._cap: Dict[int, int] = {}  # most units lent: its longest context's

    def add_source(self, name: str, source: UnitSource) -> None:
        if name in self.sources:
            raise ValueError(f"unit source {name!r} is already added")
        self.sources[name] = source

    def requests(self) -> List[int]:
        return list(self._base)

    def is_admitted(self, r: int) -> bool:
        return r in self._base

    def base(self, r: int) -> Optional[int]:
        return self._base.get(r)

    def units(self, r: int) -> List[Unit]:
        """Request ``r``'s extra units, oldest first (a live list)."""
        return self._units[r]

    def num_units(self, r: int) -> int:
        """Units request ``r`` holds, its region included (0: not admitted)."""
        return 1 + len(self._units[r]) if r in self._base else 0

    def admit(self, r: int, base: int, cap: int) -> None:
        if r in self._base:
            raise ValueError(f"request {r} is already admitted")
        self._base[r], self._units[r], self._cap[r] = base, [], cap

    def release(self, r: int) -> None:
        """Forget request ``r``; its region and extra units go back."""
        self.regions.free(self._base.pop(r))
        del self._cap[r]
        for base, source in self._units.pop(r):
            self.sources[source].give(base)

    def lent_by(self, source: str) -> int:
        """Extra units running requests hold from ``source``."""
        return sum(src == source for u in self._units.values() for _, src in u)

    def admission_room(self) -> int:
        """Requests that can be admitted now: free regions plus the regions
        held as extra units (an admission takes one back)."""
        return self.regions.available_size() + self.lent_by(REGION_UNIT_SOURCE)

    def _wanting(self) -> List[Tuple[int, int]]:
        # (units held, request) of the requests below their cap.
        return [
            (len(u) + 1, r) for r, u in self._units.items() if len(u) + 1 < self._cap[r]
        ]

    def grow_candidate(self) -> Optional[int]:
        """The request with the fewest units below its cap, if a source can lend."""
        if self.max_units == 1 or not any(s.available() for s in self.sources.values()):
            return None
        wanting = self._wanting()
        return min(wanting)[1] if wanting else None

    def lend(self) -> Optional[Unit]:
        """A unit from the first source that lends one, or None."""
        for name, source in self.sources.items():
            base = source.take() if source.available() else None
            if base is not None:
                return base, name
        return None

    def level_move(self) -> Optional[Tuple[int, int]]:
        """(donor, recipient): a request with two or more extra units more than
        the poorest request below its cap, and that one; else None (an even
        split misses least: docs/ELASTIC_BUFFER.md)."""
        wanting = self._wanting() if len(self._units) > 1 else []
        if self.max_units == 1 or not wanting:
            return None
        held, recipient = min(wanting)
        donors = [(len(u), r) for r, u in self._units.items() if len(u) > held]
        return (max(donors)[1], recipient) if donors else None

    def reclaim_choice(self, source: str) -> Optional[Tuple[int, int]]:
        """(request, k): the newest extra unit ``k`` of ``source`` held by the
        request holding the most units (highest index first), or None."""
        donors = [
            (len(u), r)
            for r, u in self._units.items()
            if any(s == source for _, s in u)
        ]
        if not donors:
            return None
        r = max(donors)[1]
        return r, max(i for i, (_, s) in enumerate(self._units[r]) if s == source)

    def add(self, r: int, unit: Unit) -> int:
        """Give request ``r`` ``unit``; returns the units it holds now."""
        self._units[r].append(unit)
        return len(self._units[r]) + 1

    def pop_last(self, r: int) -> Unit:
        """Take request ``r``'s newest extra unit off its list."""
        return self._units[r].pop()

    def swap_with_last(self, r: int, k: int) -> None:
        """Extra unit ``k`` of request ``r`` and its newest trade places."""
        units = self._units[r]
        units[k], units[-1] = units[-1], units[k]

    def spread(self) -> Tuple[int, int]:
        """Units of the poorest and the richest admitted request (0, 0: none)."""
        held = [self.num_units(r) for r in self._units]
        return min(held, default=0), max(held, default=0)

    def idle_leaks(self) -> List[str]:
        """What is still held although no request should be left."""
        leaks = []
        if self._base:
            held = sorted(self._base)
            leaks.append(f"{len(held)} request(s) still admitted (req pool {held[:8]})")
        free = self.regions.available_size()
        if free != self.regions.num_regions:
            leaks.append(f"decode regions free: {free} of {self.regions.num_regions}")
        for name in self.sources:
            if self.lent_by(name):
                leaks.append(f"{self.lent_by(name)} unit(s) still lent by {name}")
        return leaks
