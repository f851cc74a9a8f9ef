"""Idle token locs lent as LRU units.

With the arena each layer's KV rows and indexer-key pages share one buffer
(``NSAKVOffloadTokenToKVPool``), and ``IdleLocUnitLender`` lends the bytes of
runs of free loc pages to running requests as extra units. The allocator
counts lent pages as free and takes units back when an allocation needs them.

Checked here through the real pools and coordinator (``OffloadHarness``, PD
decode: indexer keys written into every transferred
page): the arena's views and geometry; the sizing; the lender's runs; decode
steps reading exact KV from lent units while transfers write keys into other
pages; allocations that take units back; lent units moved from a request
to a poorer one; a negative control: lent runs put back on the free list
let a transfer's keys overwrite a lent unit, and the checks fail; and the
integration tests' lifecycles (colocated with staging, PD decode with
retraction) with the idle-loc units on.
"""

import functools
import unittest
from unittest import mock

import test_nsa_kv_offload_integration as integration
import torch
from offload_harness import (  # noqa: F401 (module fixtures)
    PAGE,
    OffloadHarness,
    make_pool,
    setUpModule,
    tearDownModule,
)
from sglang.srt.mem_cache.nsa_kv_offload_sizing import (
    NSAKVOffloadPoolSizes,
    compute_offload_pool_sizes,
    idle_loc_lru_units,
    lru_unit_state_bytes,
    offload_bytes_per_loc,
    offload_bytes_per_region,
)
from sglang.srt.mem_cache.nsa_kv_offload_units import (
    IDLE_LOC_UNIT_SOURCE,
    IdleLocUnitLender,
    idle_loc_unit_pages,
)

FP8_ROW_BYTES = 656
# One page of indexer keys: 64 x (128 fp8 + 4 B scale).
INDEX_PAGE_BYTES = PAGE * 132


def _sizes(num_locs, idle_loc_units, num_regions=2, region_rows=136):
    return NSAKVOffloadPoolSizes(
        num_locs=num_locs,
        num_regions=num_regions,
        region_rows=region_rows,
        staging_rows=0,
        page_size=PAGE,
        host_capacity_locs=num_locs,
        idle_loc_units=idle_loc_units,
    )


class TestArena(unittest.TestCase):
    def test_views_share_one_buffer_per_layer(self):
        sizes = _sizes(40 * PAGE, idle_loc_units=3)
        pool = make_pool(sizes, layer_num=2, kv_fp8=True)
        self.assertTrue(pool.uses_arena)
        self.assertEqual(pool.kv_row_bytes, FP8_ROW_BYTES)
        self.assertEqual(pool.index_page_bytes, INDEX_PAGE_BYTES)
        for layer in range(2):
            kv = pool.kv_buffer[layer]
            keys = pool.index_k_with_scale_buffer[layer]
            self.assertEqual(keys.shape, (pool.num_index_pages, INDEX_PAGE_BYTES))
            # Upstream's page count for index_buf_size = num_locs.
            self.assertEqual(keys.shape[0], (40 * PAGE + PAGE + 1) // PAGE)
            # Whole pages of KV rows cover every byte of both.
            self.assertEqual(kv.shape[0] % PAGE, 0)
            self.assertGreaterEqual(kv.numel() * kv.element_size(), pool.index_end)
            self.assertEqual(keys.data_ptr(), kv.data_ptr() + pool.index_offset)
            # The rows upstream allocates end before the first key page.
            fixed_end = (sizes.kv_pool_size + PAGE) * FP8_ROW_BYTES
            self.assertLessEqual(fixed_end, pool.index_offset)
        # A KV row lent from pages 5..15 writes inside those pages' keys.
        first, end = pool.rows_of_pages(5, 11)
        self.assertGreaterEqual(end - first, 128)
        kv_rows = pool.kv_buffer[0].view(torch.uint8).view(-1, FP8_ROW_BYTES)
        keys = pool.index_k_with_scale_buffer[0]
        kv_rows[first:end] = 7
        touched = (keys != 0).any(dim=1).nonzero().flatten().tolist()
        self.assertEqual(touched[0], 5)
        self.assertEqual(touched[-1], 15)
        self.assertTrue(bool((keys[6:15] == 7).all()))

    def test_no_arena_without_idle_loc_units(self):
        pool = make_pool(_sizes(16 * PAGE, idle_loc_units=0), 1, kv_fp8=True)
        self.assertFalse(pool.uses_arena)
        self.assertEqual(pool.kv_buffer[0].shape[0], pool.size + PAGE)
        self.assertNotEqual(
            pool.index_k_with_scale_buffer[0].untyped_storage().data_ptr(),
            pool.kv_buffer[0].untyped_storage().data_ptr(),
        )

    def test_unit_pages_hold_a_unit_wherever_the_run_starts(self):
        pool = make_pool(_sizes(60 * PAGE, idle_loc_units=1), 1, kv_fp8=True)
        for unit_rows in (1, 64, 128, 200):
            n = idle_loc_unit_pages(unit_rows, FP8_ROW_BYTES, INDEX_PAGE_BYTES)
            for first in range(1, 60 - n):
                lo, hi = pool.rows_of_pages(first, n)
                self.assertGreaterEqual(hi - lo, unit_rows, (unit_rows, first))
                # Every byte of those rows lies in the run's pages.
                self.assertGreaterEqual(
                    lo * FP8_ROW_BYTES,
                    pool.index_offset + first * INDEX_PAGE_BYTES,
                )
                self.assertLessEqual(
                    hi * FP8_ROW_BYTES,
                    pool.index_offset + (first + n) * INDEX_PAGE_BYTES,
                )


class TestSizing(unittest.TestCase):
    def test_idle_loc_lru_units(self):
        # 1000 locs of 132 B keys hold 132000 B: 1 unit of 128 rows x 656 B.
        self.assertEqual(idle_loc_lru_units(1000, 132, 656, 128, 8, 4), 1)
        self.assertEqual(idle_loc_lru_units(10**6, 132, 656, 128, 8, 4), 24)
        self.assertEqual(idle_loc_lru_units(10**6, 132, 656, 128, 8, 4, 20), 4)
        self.assertEqual(idle_loc_lru_units(10**6, 132, 656, 128, 8, 1), 0)

    def test_state_paid_from_the_locs(self):
        kwargs = dict(
            available_bytes=3 << 30,
            num_layers=4,
            row_bytes=656,
            indexer_bytes=132,
            page_size=PAGE,
            buffer_size=2048,
            recent_window=64,
            num_regions=8,
            staging_rows=0,
            host_pool_bytes=1 << 40,
            max_units=8,
        )
        on = compute_offload_pool_sizes(**kwargs)
        # 8 slots borrow at most 7 units each; the keys hold more than that.
        self.assertEqual(on.idle_loc_units, 56)
        self.assertEqual(on.num_spare_regions, 0)  # GPU-bound
        # The locs without those units' LRU state: the budget after the
        # regions, over the bytes of a loc.
        per_loc = offload_bytes_per_loc(4, 132)
        fixed = 4 * PAGE * 656 + 8 * offload_bytes_per_region(4, 656, 2048, 64, 8)
        off_locs = ((3 << 30) - fixed) // per_loc // PAGE * PAGE
        state = 56 * lru_unit_state_bytes(4, 2048, 8)
        self.assertLess(on.num_locs, off_locs)
        self.assertLessEqual(off_locs - on.num_locs, state // per_loc + 2 * PAGE)
        self.assertEqual(on.num_locs % PAGE, 0)
        # Capped locs (the host pool) leave the bytes: no locs given up.
        capped = compute_offload_pool_sizes(
            **dict(kwargs, host_pool_bytes=4 * 656 * 100 * PAGE)
        )
        self.assertEqual(capped.num_locs, 100 * PAGE)
        # Capped a little below the budget: the bytes left pay for two spare
        # regions but not also for the idle-loc units' state. A spare region
        # gives way (the state fits in its bytes); the locs keep the cap.
        region = offload_bytes_per_region(4, 656, 2048, 64, 8)
        host_locs = (off_locs - -(-(2 * region + state // 2) // per_loc)) // PAGE * PAGE
        tight = compute_offload_pool_sizes(
            **dict(kwargs, host_pool_bytes=4 * 656 * host_locs)
        )
        self.assertEqual(tight.num_locs, host_locs)
        self.assertEqual(tight.num_spare_regions, 1)
        self.assertGreater(tight.idle_loc_units, 0)
        unit_state = lru_unit_state_bytes(4, 2048, 8)
        spent = fixed + host_locs * per_loc + region + tight.idle_loc_units * unit_state
        self.assertLessEqual(spent, 3 << 30)


def _harness(test, idle_loc_units=6, num_locs=96 * PAGE, seed=0, **kwargs):
    """PD decode, 2 request slots, no spare regions: with 4 units a request
    can only grow into the free locs' keys (11 pages per unit of 128 rows).
    The torch swap and copies: what is tested is where units live (the
    kernels: test_lru_cache_state, test_sparse_cache_controller)."""
    kwargs.setdefault("use_triton", False)
    return OffloadHarness(
        test,
        kv_fp8=True,
        seed=seed,
        kv_arrives_in_host=True,
        num_locs=num_locs,
        max_units=4,
        idle_loc_units=idle_loc_units,
        max_ctx=8192,
        **kwargs,
    )


class TestIdleLocUnits(unittest.TestCase):
    def _lent(self, h):
        return h.controller.units_lent_by(IDLE_LOC_UNIT_SOURCE)

    @staticmethod
    def _decode_with_new(h, reqs, new, steps):
        """The first step of ``new`` beside ``reqs``, then ``steps`` more."""
        h.decode_step(reqs, first_step_of=(new,))
        for _ in range(steps):
            h.decode_step(reqs)

    @staticmethod
    def _finish_all(h, *reqs):
        for r in reqs:
            h.finish(r)
        h.check_no_leaks()

    def test_lent_units_read_exact_kv(self):
        h = _harness(self, seed=1)
        lender = h.allocator.idle_loc_lender
        self.assertIsInstance(lender, IdleLocUnitLender)
        self.assertEqual(lender.pages_per_unit, 11)
        a, b = h.new_req(), h.new_req()
        h.transfer(a, 500)
        h.transfer(b, 450)
        free_before = h.allocator.available_size()
        h.decode_step([a, b], first_step_of=(a, b))
        # Both requests grew into free locs' keys, the scheduler's view of
        # free locs unchanged by it.
        self.assertEqual(h.controller.num_units(a.req_pool_idx), 4)
        self.assertEqual(h.controller.num_units(b.req_pool_idx), 4)
        self.assertEqual(self._lent(h), 6)
        self.assertEqual(h.allocator.available_size(), free_before)
        rows_end = h.sizes.region_start_row + h.sizes.total_regions * (h.C + h.W)
        for r in (a, b):
            for base in h.co.lru.unit_base[r.req_pool_idx, 1:].tolist():
                self.assertGreaterEqual(base, rows_end)
        for step in range(12):
            h.decode_step([a, b], pad_rows=step % 2)
        self.assertGreater(h.controller.get_stats()["misses"], 0)
        h.finish(a)
        h.finish(b)
        self.assertEqual(self._lent(h), 0)
        h.check_no_leaks()

    def test_transfers_take_units_back(self):
        h = _harness(self, seed=2)
        a, b = h.new_req(), h.new_req()
        h.transfer(a, 900)
        h.decode_step([a], first_step_of=(a,))
        # The free region first (b's admission takes it back), then keys.
        self.assertEqual(h.controller.num_units(a.req_pool_idx), 4)
        self.assertEqual(self._lent(h), 2)
        for _ in range(3):
            h.decode_step([a])
        # b's transfer needs pages a's units hold: taken back, then b's keys
        # land there while a keeps decoding from what it still holds.
        free_pages = h.allocator.free_page_count()
        need = -(-3900 // PAGE)
        self.assertGreater(need, free_pages)
        with mock.patch.object(
            h.co, "_wait_producer", wraps=h.co._wait_producer
        ) as wait:
            h.transfer(b, 3900)
        wait.assert_called()
        self.assertLess(self._lent(h), 2)
        self._decode_with_new(h, [a, b], b, 6)
        self._finish_all(h, a, b)

    def test_lent_units_move_to_a_later_request(self):
        """Three slots: ``a`` and ``b`` grow into the free region and free
        locs' keys; ``c``'s keys leave less than a unit free, and its
        admission takes the region back from ``a`` (its rows copied into
        ``a``'s newest unit's rows, whose slots are dropped instead), so ``b``
        holds two or more units more than ``c``: one of its idle-loc units
        moves (its rows start empty there), every request reading exact KV (rank_speed/run_h100_default_model_8k_x64/: only
        region units moved, later requests ran on one unit)."""
        h = _harness(self, seed=7, num_regions=3, max_reqs=3, num_locs=128 * PAGE)
        a, b, c = h.new_req(), h.new_req(), h.new_req()
        h.transfer(a, 500)
        h.transfer(b, 450)
        h.decode_step([a, b], first_step_of=(a, b))
        self.assertEqual(self._lent(h), 5)
        h.transfer(c, (h.allocator.free_page_count() - 12) * PAGE)
        self._decode_with_new(h, [a, b, c], c, 8)
        held = [h.controller.num_units(r.req_pool_idx) for r in (a, b, c)]
        self.assertEqual(held, [3, 3, 2])
        self.assertEqual(self._lent(h), 5)
        self.assertEqual(h.controller.get_stats()["units_moved"], 1)
        self._finish_all(h, a, b, c)

    def test_full_load_takes_every_unit_back(self):
        """Capacity is the locs': a transfer that takes all but the decode
        pages of the locs free to the scheduler gets them, every idle-loc
        unit back, and both requests decode exactly."""
        h = _harness(self, seed=6)
        a, b = h.new_req(), h.new_req()
        h.transfer(a, 700)
        h.decode_step([a], first_step_of=(a,))
        self.assertEqual(self._lent(h), 2)
        h.transfer(b, h.allocator.available_size() - 2 * PAGE)
        self.assertEqual(self._lent(h), 0)
        self.assertEqual(h.allocator.available_size(), 2 * PAGE)
        self._decode_with_new(h, [a, b], b, 4)
        self._finish_all(h, a, b)

    def test_out_of_locs_is_still_none(self):
        h = _harness(self, seed=3)
        a = h.new_req()
        h.transfer(a, 600)
        h.decode_step([a], first_step_of=(a,))
        self.assertGreater(self._lent(h), 0)
        locs_left = h.allocator.available_size()
        # One page more than the free and lent locs: nothing is taken.
        self.assertIsNone(h.allocator.alloc(locs_left + PAGE))
        self.assertEqual(h.allocator.available_size(), locs_left)
        h.decode_step([a])
        self._finish_all(h, a)

    def _fill_then_decode(self, h, leak):
        """``a`` grows into free locs' keys, then ``b``'s transfer takes the
        free list's pages, and both decode. ``leak``: before the transfer the
        lent runs leak back onto the free list, first in line (what a lender
        or allocator that lost track of them would do)."""
        a, b = h.new_req(), h.new_req()
        h.transfer(a, 300)
        h.decode_step([a], first_step_of=(a,))
        self.assertGreater(self._lent(h), 0)
        if leak:
            lender = h.allocator.idle_loc_lender
            runs = [lender.run_pages(p) for p in lender.lent_page_runs()]
            h.allocator.free_pages = torch.cat(runs + [h.allocator.free_pages])
        h.transfer(b, h.allocator.free_page_count() * PAGE - 2 * PAGE)
        self._decode_with_new(h, [a, b], b, 6)
        return a, b

    def test_fill_then_decode(self):
        h = _harness(self, seed=5)
        a, b = self._fill_then_decode(h, leak=False)
        self._finish_all(h, a, b)

    def test_negative_control_lent_runs_allocated(self):
        """The same with the lent runs back on the free list: b's transfer
        writes its keys over a's lent rows, and a decode step reads wrong KV
        (or finds b's keys overwritten by a's miss copies)."""
        h = _harness(self, seed=5)
        with self.assertRaisesRegex(AssertionError, "read wrong KV|were overwritten"):
            self._fill_then_decode(h, leak=True)


class _IdleLocLifecycles:
    """Every ``OffloadHarness`` the integration tests build gets the arena and locs
    enough to lend (64 pages: 11 per unit of 128 rows). The tests named in
    ``LENDING_TESTS`` must lend units from idle locs (else they would test
    nothing new)."""

    LENDING_TESTS = ()

    def setUp(self):
        super().setUp()
        lent = []

        def counted_lend_run(lender, first_page):
            lent.append(first_page)
            return _LEND_RUN(lender, first_page)

        for patcher in (
            mock.patch.object(
                integration,
                "OffloadHarness",
                functools.partial(OffloadHarness, idle_loc_units=6, num_locs=64 * PAGE),
            ),
            mock.patch.object(IdleLocUnitLender, "_lend_run", counted_lend_run),
        ):
            patcher.start()
            self.addCleanup(patcher.stop)
        if self._testMethodName in self.LENDING_TESTS:
            self.addCleanup(lambda: self.assertTrue(lent, "no unit lent by idle locs"))


_LEND_RUN = IdleLocUnitLender._lend_run


# Through the module: imported under their own names, pytest would run the
# integration tests' classes here a second time.
class TestOffloadLifecycleIdleLocs(
    _IdleLocLifecycles, integration.TestOffloadLifecycleUnits
):
    """Colocated lifecycles (prefill staging, admission, decode, finish) with
    idle-loc units: asked after the free regions, before the staging."""

    LENDING_TESTS = (
        "test_lifecycle_bf16",
        "test_lifecycle_fp8",
        "test_finish_at_prefill",
    )


class TestPDDecodeLifecycleIdleLocs(
    _IdleLocLifecycles, integration.TestPDDecodeLifecycleUnits
):
    """PD decode lifecycles, retraction and resume included, with idle-loc
    units."""

    LENDING_TESTS = ("test_retract_and_resume",)


if __name__ == "__main__":
    unittest.main()
