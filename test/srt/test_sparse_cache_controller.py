"""SparseCacheController: regions, admission/release, counters and exactness.

The end-to-end check simulates prefill backups, admissions (with warm-up),
decode steps that write each new token into its window row, one-step-late
backups of those rows, random top-k picks with eviction, CUDA-graph padding
rows and request turnover, and asserts after every layer swap that the GPU
rows listed in the page table hold exactly the KV of the picked tokens:

    device_kv[l][page_table[b, i]] == kv_of(l, req_to_token[r, topk_pos[b, i]])

On a machine without CUDA the Triton kernels run in the interpreter.
"""

import contextlib
import random
import unittest
from unittest import mock

import torch
from sglang.srt.mem_cache import sparse_cache_controller as controller_module
from sglang.srt.mem_cache.lru_cache_state import LayerSwapPlan, LRUCacheState
from sglang.srt.mem_cache.nsa_kv_offload_units import (
    REGION_UNIT_SOURCE,
    RegionAllocator,
)
from sglang.srt.mem_cache.nsa_kv_only_host_pool import NSAKVOnlyTokenToKVPoolHost
from sglang.srt.mem_cache.sparse_cache_controller import SparseCacheController

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROW_BYTES = 656


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class TestRegionAllocator(unittest.TestCase):
    def test_alloc_free(self):
        alloc = RegionAllocator(start_row=64, region_rows=10, num_regions=3)
        self.assertEqual(alloc.end_row, 94)
        bases = [alloc.alloc_contiguous() for _ in range(3)]
        self.assertEqual(bases, [64, 74, 84])
        self.assertIsNone(alloc.alloc_contiguous())
        self.assertEqual(alloc.available_size(), 0)
        alloc.free(74)
        self.assertEqual(alloc.available_size(), 1)
        self.assertEqual(alloc.alloc_contiguous(), 74)
        with self.assertRaises(ValueError):
            alloc.free(75)  # not a region base
        alloc.free(64)
        with self.assertRaises(ValueError):
            alloc.free(64)  # double free
        alloc.clear()
        self.assertEqual(alloc.available_size(), 3)


class _ControllerCase(unittest.TestCase):
    L, K, C, W = 2, 16, 24, 4
    MAX_REQS, NUM_REGIONS, STAGING = 6, 3, 256
    HOST_SIZE, PAGE, MAX_CTX = 1024, 16, 160

    def make(
        self,
        use_triton=None,
        warm_tokens=None,
        max_units=1,
        direct_slots=False,
        extra_units=0,
        lent_units=0,
    ):
        """``lent_units``: units of GPU rows past the regions that a second
        source (``"lent"``, ``self.lent``) lends, like idle staging or locs.
        ``use_triton=False``: the torch reference swap and the torch row
        copies (else the Triton kernels, interpreted on CPU)."""
        R = self.C + self.W
        lent_start = self.STAGING + self.NUM_REGIONS * R
        self.num_gpu_rows = lent_start + lent_units * self.C
        self.gpu = [
            torch.zeros(
                (self.num_gpu_rows, 1, ROW_BYTES), dtype=torch.uint8, device=DEVICE
            )
            for _ in range(self.L)
        ]
        self.host = NSAKVOnlyTokenToKVPoolHost(
            size=self.HOST_SIZE,
            page_size=self.PAGE,
            layer_num=self.L,
            row_bytes=ROW_BYTES,
        )
        copies = contextlib.nullcontext()
        if use_triton is False:
            copies = mock.patch.object(
                controller_module, "copy_kernels_interpreted", lambda: False
            )
        with copies:
            self.ctrl = self._controller(
                use_triton,
                warm_tokens,
                max_units,
                direct_slots,
                extra_units + lent_units,
            )
        if use_triton is not None:
            self.assertEqual(self.ctrl.lru.use_triton, use_triton)
            self.assertEqual(self.ctrl.use_triton_copy, use_triton)
        if lent_units:
            self.lent = ListUnitSource(
                [lent_start + i * self.C for i in range(lent_units)]
            )
            self.ctrl.add_unit_source("lent", self.lent)
        return self.ctrl

    def _controller(self, use_triton, warm_tokens, max_units, direct_slots, extra):
        return SparseCacheController(
            self.gpu,
            self.host,
            max_num_reqs=self.MAX_REQS,
            top_k=self.K,
            buffer_size=self.C,
            recent_window=self.W,
            region_start_row=self.STAGING,
            num_regions=self.NUM_REGIONS,
            max_batch_size=8,
            use_triton=use_triton,
            direct_slots=direct_slots,
            warm_tokens=warm_tokens,
            max_units=max_units,
            extra_units=extra,
        )


class ListUnitSource:
    """A unit source lending the units of C rows at the given bases."""

    def __init__(self, bases):
        self.free = list(bases)

    def available(self):
        return bool(self.free)

    def take(self):
        return self.free.pop(0)

    def give(self, base):
        self.free.append(base)


class TestAdmission(_ControllerCase):
    def test_admit_release_exhaustion(self):
        ctrl = self.make()
        self.assertTrue(ctrl.can_admit(3))
        self.assertFalse(ctrl.can_admit(4))
        bases = [ctrl.admit_request(r) for r in (4, 0, 2)]
        R = self.C + self.W
        self.assertEqual(bases, [self.STAGING + i * R for i in range(3)])
        self.assertEqual(ctrl.lru.region_base[4].item(), bases[0])
        self.assertTrue(ctrl.is_admitted(0))
        self.assertEqual(ctrl.num_free_regions(), 0)
        self.assertFalse(ctrl.can_admit())
        self.assertIsNone(ctrl.admit_request(1))  # full: fails cleanly
        self.assertFalse(ctrl.is_admitted(1))
        with self.assertRaises(ValueError):
            ctrl.admit_request(0)  # twice
        ctrl.release_request(0)
        self.assertEqual(ctrl.lru.region_base[0].item(), -1)
        self.assertTrue(ctrl.can_admit())
        self.assertEqual(ctrl.admit_request(1), bases[1])  # region reused
        with self.assertRaises(ValueError):
            ctrl.release_request(0)
        stats = ctrl.get_stats()
        self.assertEqual(stats["regions_used"], 3)
        self.assertEqual(stats["regions_total"], 3)

    def test_bad_configuration(self):
        with self.assertRaises(ValueError):
            SparseCacheController(
                [torch.zeros((100, ROW_BYTES), dtype=torch.uint8, device=DEVICE)],
                NSAKVOnlyTokenToKVPoolHost(
                    size=64, page_size=16, layer_num=1, row_bytes=ROW_BYTES
                ),
                max_num_reqs=4,
                top_k=16,
                buffer_size=24,
                recent_window=4,
                region_start_row=50,
                num_regions=2,  # 50 + 2 * 28 > 100 rows
            )
        with self.assertRaises(ValueError):
            SparseCacheController(
                [torch.zeros((100, 1152), dtype=torch.uint8, device=DEVICE)],
                NSAKVOnlyTokenToKVPoolHost(
                    size=64, page_size=16, layer_num=1, row_bytes=ROW_BYTES
                ),
                max_num_reqs=4,
                top_k=16,
                buffer_size=24,
                recent_window=4,
                region_start_row=0,
                num_regions=1,
            )


class TestUnits(_ControllerCase):
    def test_rebalance_and_reclaim(self):
        ctrl = self.make(max_units=3)
        R = self.C + self.W
        self.assertFalse(ctrl.wants_rebalance())  # nobody admitted
        ctrl.admit_request(2)
        self.assertTrue(ctrl.wants_rebalance())
        # One request alone takes up to max_units regions.
        self.assertEqual(ctrl.rebalance(), 2)
        self.assertEqual(ctrl.num_units(2), 3)
        self.assertEqual(ctrl.num_free_regions(), 0)
        self.assertEqual(int(ctrl.lru.capacity[2]), 3 * self.C)
        self.assertEqual(
            ctrl.lru.unit_base[2].tolist(), [self.STAGING + i * R for i in range(3)]
        )
        self.assertTrue(ctrl.can_admit(2))
        self.assertFalse(ctrl.can_admit(3))
        # Admissions take units back, newest first, from the largest holder.
        ctrl.admit_request(0)
        self.assertEqual((ctrl.num_units(2), ctrl.num_units(0)), (2, 1))
        self.assertEqual(ctrl.lru.region_base[0].item(), self.STAGING + 2 * R)
        ctrl.admit_request(5)
        self.assertEqual([ctrl.num_units(r) for r in (2, 0, 5)], [1, 1, 1])
        self.assertFalse(ctrl.can_admit())
        self.assertIsNone(ctrl.admit_request(1))
        self.assertFalse(ctrl.wants_rebalance())
        # A release frees every unit of the request.
        ctrl.release_request(0)
        self.assertEqual(ctrl.rebalance(), 1)
        self.assertEqual(ctrl.num_units(2), 2)  # lowest pool index first
        ctrl.release_request(2)
        self.assertEqual(ctrl.num_free_regions(), 2)
        self.assertEqual(ctrl.num_units(2), 0)
        self.assertEqual(ctrl.rebalance(), 2)
        self.assertEqual(ctrl.num_units(5), 3)

    def test_other_sources_and_buried_units(self):
        ctrl = self.make(max_units=3, lent_units=2)
        first_lent, second_lent = self.lent.free
        for r in (0, 1, 2):
            ctrl.admit_request(r)
        # No free region: the other source lends, fewest units first.
        self.assertEqual(ctrl.rebalance(), 2)
        self.assertEqual(ctrl.lru.free_units(), 0)
        self.assertEqual(ctrl.lru.unit_base[0, 1].item(), first_lent)
        self.assertEqual(ctrl.lru.unit_base[1, 1].item(), second_lent)
        self.assertEqual(ctrl.get_stats()["extra_units_lent"], 2)
        self.assertEqual(ctrl.admission_room(), 0)  # lent units are no regions
        ctrl.release_request(2)
        self.assertEqual(ctrl.rebalance(), 1)  # the freed region goes to 0
        self.assertEqual(ctrl.num_units(0), 3)  # region, lent, region
        region_unit = ctrl.lru.unit_base[0, 2].item()
        # What request 0's slots of its lent unit hold, in every layer.
        rows = slice(first_lent, first_lent + self.C)
        for layer, buf in enumerate(self.gpu):
            buf[rows] = torch.arange(self.C, device=DEVICE).view(-1, 1, 1) + layer
        held = [buf[rows].clone() for buf in self.gpu]
        ctrl.reset_stats()
        # Taking the lent units back: request 0's lent unit sits below its
        # region unit, so its rows are copied into the region unit's rows,
        # which back its slots from then on, and the newest slots are
        # dropped: one unit's rows lost, not two.
        ok = ctrl.reclaim_units_of("lent", lambda: len(self.lent.free) == 2)
        self.assertTrue(ok)
        ctrl.synchronize()
        self.assertEqual([ctrl.num_units(r) for r in (0, 1)], [2, 1])
        self.assertEqual(ctrl.num_free_regions(), 0)
        self.assertEqual(ctrl.lru.unit_base[0, 1].item(), region_unit)
        self.assertEqual(ctrl.lru.unit_base[0, 2].item(), -1)
        self.assertEqual(ctrl.units.units(0), [(region_unit, REGION_UNIT_SOURCE)])
        for buf, want in zip(self.gpu, held):
            self.assertTrue(torch.equal(buf[region_unit : region_unit + self.C], want))
        self.assertEqual(ctrl.lru.capacity[:2].tolist(), [2 * self.C, self.C])
        stats = ctrl.get_stats()
        self.assertEqual((stats["units_reclaimed"], stats["units_kept"]), (2, 1))
        self.assertFalse(
            ctrl.reclaim_units_of("lent", lambda: len(self.lent.free) == 3)
        )
        # An admission takes the region back (the newest unit: no copy).
        ctrl.admit_request(2)
        self.assertEqual(ctrl.num_units(0), 1)
        self.assertEqual(ctrl.get_stats()["units_kept"], 1)

    def test_units_need_lru_state(self):
        # The LRU state is held per unit: a source lending more units than
        # the controller was told of (extra_units) lends only as many.
        ctrl = self.make(max_units=3, extra_units=1)
        self.assertEqual(ctrl.lru.num_units, self.NUM_REGIONS + 1)
        extra = ListUnitSource([1000, 2000, 3000])
        ctrl.add_unit_source("extra", extra)
        for r in (0, 1, 2):
            ctrl.admit_request(r)
        self.assertEqual(ctrl.rebalance(), 1)
        self.assertEqual(extra.free, [2000, 3000])
        self.assertFalse(ctrl.wants_rebalance())
        ctrl.release_request(0)  # its region and its lent unit come back
        self.assertEqual(ctrl.lru.free_units(), 2)
        self.assertEqual(ctrl.rebalance(), 2)  # the region to 1, a lent unit to 2
        self.assertEqual(ctrl.lru.free_units(), 0)
        for r in (1, 2):
            ctrl.release_request(r)
        self.assertEqual(ctrl.idle_leaks(), [])
        self.assertEqual(ctrl.lru.free_units(), ctrl.lru.num_units)

    def test_admissions_into_a_full_pool_even_out_units(self):
        # Admissions take units back from the largest holders only: without
        # moving units, r2 would run on its own region while r0 and r1 keep
        # 5 and 4 extra units.
        self.NUM_REGIONS = 12
        ctrl = self.make(max_units=6)
        self.assertEqual(
            (ctrl.get_stats()["fewest_units"], ctrl.get_stats()["most_units"]), (0, 0)
        )
        ctrl.admit_request(0)
        ctrl.admit_request(1)
        ctrl.rebalance()
        ctrl.admit_request(2)  # takes a region unit back from 0 or 1
        stats = ctrl.get_stats()
        self.assertEqual((stats["fewest_units"], stats["most_units"]), (1, 6))
        ctrl.rebalance()
        self.assertEqual([ctrl.num_units(r) for r in (0, 1, 2)], [4, 4, 4])
        stats = ctrl.get_stats()
        self.assertEqual((stats["fewest_units"], stats["most_units"]), (4, 4))
        self.assertEqual(ctrl.get_stats()["units_moved"], 3)
        self.assertFalse(ctrl.wants_rebalance())
        self.assertEqual(ctrl.num_free_regions(), 0)
        for r in (0, 1, 2):
            self.assertEqual(int(ctrl.lru.capacity[r]), 4 * self.C)
        # Every region once: the units moved are not lost or shared.
        bases = [ctrl.region_base(r) for r in (0, 1, 2)]
        bases += [b for r in (0, 1, 2) for b, _ in ctrl.units.units(r)]
        R = self.C + self.W
        self.assertEqual(sorted(bases), [self.STAGING + i * R for i in range(12)])
        ctrl.reset_stats()
        self.assertEqual(ctrl.get_stats()["units_moved"], 0)

    def test_sized_pools_hold_every_request_whole(self):
        # The rank sizing at the default request slots with the LRU state
        # per unit (results/rank_speed/default_sizing/): 223 slots + 232
        # spare regions (7 units of 4,416 rows) give 64 requests their 7
        # units each; 239 + 247 (the default's 40 units of 4,096) give 8
        # requests 33 each. Small rows, the same counts, admitted in a burst
        # (PD decode) or one by one.
        for slots, spare, reqs, units, burst in (
            (223, 232, 64, 7, True),
            (223, 232, 64, 7, False),
            (239, 247, 8, 33, True),
        ):
            with self.subTest(reqs=reqs, units=units, burst=burst):
                self.NUM_REGIONS, self.MAX_REQS = slots + spare, slots
                ctrl = self.make(max_units=units)
                for r in range(reqs):
                    ctrl.admit_request(r)
                    if not burst:
                        ctrl.rebalance()
                ctrl.rebalance()
                held = [ctrl.num_units(r) for r in range(reqs)]
                self.assertEqual(held, [units] * reqs)
                capacity = ctrl.lru.capacity[:reqs].tolist()
                self.assertEqual(capacity, [units * self.C] * reqs)
                left = slots + spare - reqs * units
                self.assertEqual(ctrl.lru.free_units(), left)
                self.assertEqual(ctrl.num_free_regions(), left)
                for r in range(reqs):
                    ctrl.release_request(r)
                self.assertEqual(ctrl.idle_leaks(), [])
                self.assertEqual(ctrl.lru.free_units(), slots + spare)

    def test_units_move_only_between_uneven_holders(self):
        # Property: after any admissions, releases and rebalances, no region
        # is idle while a request could take it, and the requests' extra
        # units differ by at most one.
        self.NUM_REGIONS, self.MAX_REQS = 10, 8
        for seed in range(30):
            rng = random.Random(seed)
            max_units = rng.randint(2, 6)
            ctrl = self.make(max_units=max_units)
            live = set()
            for _ in range(25):
                free = sorted(set(range(self.MAX_REQS)) - live)
                if live and (rng.random() < 0.3 or not ctrl.can_admit() or not free):
                    r = rng.choice(sorted(live))
                    ctrl.release_request(r)
                    live.discard(r)
                else:
                    r = rng.choice(free)
                    self.assertIsNotNone(ctrl.admit_request(r))
                    live.add(r)
                ctrl.rebalance()
                self.assertFalse(ctrl.wants_rebalance())
                extras = [ctrl.num_units(r) - 1 for r in live]
                msg = (seed, max_units, extras)
                if extras:
                    self.assertLessEqual(max(extras) - min(extras), 1, msg)
                    if min(extras) < max_units - 1:  # someone could grow
                        self.assertEqual(ctrl.num_free_regions(), 0, msg)
                    self.assertEqual(
                        ctrl.num_free_regions() + sum(extras) + len(live),
                        self.NUM_REGIONS,
                        msg,
                    )

    def _admit_or_release(self, ctrl, rng, caps, release, longest):
        """Release a random request (``release``, or when none can be
        admitted) or admit one whose longest context is random (at most
        ``longest`` positions; or none: ``max_units``), its cap in ``caps``."""
        free = sorted(set(range(self.MAX_REQS)) - set(caps))
        if caps and (release or not ctrl.can_admit() or not free):
            r = rng.choice(sorted(caps))
            ctrl.release_request(r)
            del caps[r]
            return
        r = rng.choice(free)
        seq_len = rng.choice([None, rng.randint(1, longest)])
        self.assertIsNotNone(ctrl.admit_request(r, max_seq_len=seq_len))
        caps[r] = ctrl.max_units if seq_len is None else ctrl.units_to_hold(seq_len)

    def _rebalance_and_check_level(self, ctrl, caps, msg):
        """Rebalance; then no request is above its cap or holds two or more
        units more than the poorest one below its cap. Returns (units held
        by request, whether one is below its cap)."""
        ctrl.rebalance()
        self.assertFalse(ctrl.wants_rebalance())
        held = {r: ctrl.num_units(r) for r in caps}
        msg = (msg, held, caps)
        self.assertTrue(all(held[r] <= caps[r] for r in caps), msg)
        wanting = [held[r] for r in caps if held[r] < caps[r]]
        if wanting:
            self.assertLessEqual(max(held.values()), min(wanting) + 1, msg)
        return held, bool(wanting)

    def test_lent_units_move_between_uneven_holders(self):
        # Property, with a second source whose units a prefill takes back for
        # a while (idle staging, idle locs): after every rebalance no request
        # holds two or more extra units more than the poorest one below its
        # cap, and every unit is held once (none lost, none shared).
        self.NUM_REGIONS, self.MAX_REQS = 6, 6
        C, W = self.C, self.W
        moved_from = set()
        for seed in range(12):
            rng = random.Random(seed)
            max_units = rng.randint(2, 5)
            ctrl = self.make(max_units=max_units, lent_units=7)
            move = ctrl._move_unit

            def recording(donor, recipient, ctrl=ctrl, move=move):
                moved_from.add(ctrl.units.units(donor)[-1][1])
                move(donor, recipient)

            ctrl._move_unit = recording
            caps, held_out = {}, []
            for _ in range(30):
                roll = rng.random()
                if roll < 0.2 and self.lent.free + held_out:
                    # A prefill takes lent units back, or gives them back.
                    if held_out and rng.random() < 0.5:
                        self.lent.free += held_out
                        held_out = []
                    else:
                        want = len(self.lent.free) + rng.randint(1, 3)
                        ctrl.reclaim_units_of(
                            "lent", lambda: len(self.lent.free) >= want
                        )
                        k = min(want, len(self.lent.free))
                        held_out += self.lent.free[:k]
                        del self.lent.free[:k]
                else:
                    self._admit_or_release(ctrl, rng, caps, roll < 0.4, W + 6 * C)
                msg = (seed, max_units)
                self._rebalance_and_check_level(ctrl, caps, msg)
                lent = [
                    b
                    for u in (ctrl.units.units(r) for r in ctrl.units.requests())
                    for b, s in u
                    if s == "lent"
                ]
                self.assertEqual(len(set(lent)), len(lent), msg)
                self.assertEqual(len(lent) + len(self.lent.free) + len(held_out), 7)
            for r in list(caps):
                ctrl.release_request(r)
            self.assertEqual(ctrl.idle_leaks(), [])
        # Units of both sources moved over the seeds.
        self.assertEqual(moved_from, {"regions", "lent"})

    def test_units_to_hold_a_context(self):
        ctrl = self.make(max_units=4)
        C, W = self.C, self.W
        # Positions below the window fill the slots; at least one unit.
        for seq_len, units in (
            (0, 1),
            (W + C, 1),
            (W + C + 1, 2),
            (W + 3 * C, 3),
            (W + 9 * C, 4),  # capped by max_units
        ):
            self.assertEqual(ctrl.units_to_hold(seq_len), units, seq_len)

    def test_units_capped_by_the_context(self):
        # A request is lent no unit beyond what holds its longest context:
        # the short one keeps one, the long ones share the rest.
        self.NUM_REGIONS = 9
        ctrl = self.make(max_units=6)
        C, W = self.C, self.W
        ctrl.admit_request(0, max_seq_len=W + C // 2)
        ctrl.admit_request(1, max_seq_len=W + 3 * C)
        ctrl.admit_request(2)  # no cap: max_units
        ctrl.rebalance()
        self.assertEqual([ctrl.num_units(r) for r in (0, 1, 2)], [1, 3, 5])
        self.assertFalse(ctrl.wants_rebalance())
        # A capped request is no leveling recipient: 2 keeps its units.
        ctrl.admit_request(3, max_seq_len=W + C)
        ctrl.rebalance()
        self.assertEqual([ctrl.num_units(r) for r in (0, 1, 2, 3)], [1, 3, 4, 1])
        ctrl.release_request(1)
        self.assertEqual(ctrl.rebalance(), 2)
        self.assertEqual(ctrl.num_units(2), 6)
        self.assertEqual(ctrl.num_free_regions(), 1)  # nobody can use it
        for r in (0, 2, 3):
            ctrl.release_request(r)
        self.assertEqual(ctrl.idle_leaks(), [])

    def test_capped_units_move_only_between_uneven_holders(self):
        # Property, with each request's cap from its context: no request
        # above its cap; no region idle while one below its cap could take
        # it; no request holds two or more extra units more than the poorest
        # request below its cap.
        self.NUM_REGIONS, self.MAX_REQS = 12, 8
        C, W = self.C, self.W
        for seed in range(30):
            rng = random.Random(seed)
            max_units = rng.randint(2, 6)
            ctrl = self.make(max_units=max_units)
            caps = {}
            for _ in range(25):
                release = rng.random() < 0.3
                self._admit_or_release(ctrl, rng, caps, release, W + 7 * C)
                msg = (seed, max_units)
                held, wanting = self._rebalance_and_check_level(ctrl, caps, msg)
                if wanting:
                    self.assertEqual(ctrl.num_free_regions(), 0, msg)
                self.assertEqual(
                    ctrl.num_free_regions() + sum(held.values()), self.NUM_REGIONS, msg
                )

    def test_one_unit_never_rebalances(self):
        ctrl = self.make()
        ctrl.admit_request(0)
        self.assertFalse(ctrl.wants_rebalance())
        self.assertEqual(ctrl.rebalance(), 0)
        self.assertEqual(ctrl.num_units(0), 1)


class TestEndToEnd(_ControllerCase):
    """Random decode simulation; exactness checked after every layer swap."""

    def _run(
        self,
        use_triton,
        seed,
        steps=24,
        warm_tokens=None,
        max_units=1,
        direct_slots=False,
        initial_reqs=None,
        lent_units=0,
        reclaim_lent_every=0,
    ):
        """``reclaim_lent_every``: every that many steps, take one unit back
        from the second source (as prefill staging does)."""
        rng = random.Random(seed)
        torch.manual_seed(seed)
        ctrl = self.make(
            use_triton=use_triton,
            warm_tokens=warm_tokens,
            max_units=max_units,
            direct_slots=direct_slots,
            lent_units=lent_units,
        )
        L, K, C, W = self.L, self.K, self.C, self.W
        host_rows = self.host.num_rows
        # Ground truth KV of every (layer, loc).
        truth = torch.randint(0, 256, (L, host_rows, ROW_BYTES), dtype=torch.uint8)
        truth_dev = truth.to(DEVICE)
        req_to_token = torch.zeros((self.MAX_REQS, self.MAX_CTX), dtype=torch.int32)
        free_locs = list(range(self.PAGE, host_rows))  # loc 0..PAGE-1 reserved
        rng.shuffle(free_locs)
        free_reqs = list(range(self.MAX_REQS))
        live = {}  # req -> seq_len (tokens whose KV exists)
        prev_pick = {}
        pending_backup = None
        checked = {"window": 0, "lookup": 0, "pad": 0}
        units_granted, reclaimed = [], []
        reclaim = ctrl._reclaim_from
        ctrl._reclaim_from = (
            lambda source: reclaimed.append(reclaim(source)) or reclaimed[-1]
        )

        def in_request_rows(r, row):
            base = ctrl.region_base(r)
            if base <= row < base + C + W:
                return True
            return any(b <= row < b + C for b, _ in ctrl.units.units(r))

        def admit_new():
            r = free_reqs.pop(rng.randrange(len(free_reqs)))
            n = rng.randint(1, 70)
            locs = [free_locs.pop() for _ in range(n)]
            req_to_token[r, :n] = torch.tensor(locs, dtype=torch.int32)
            # Prefill: KV lands in GPU staging rows, then is backed up to host.
            staging = torch.randperm(self.STAGING)[:n].to(DEVICE)
            loc_t = torch.tensor(locs, dtype=torch.int64, device=DEVICE)
            for layer in range(L):
                self.gpu[layer].view(-1, ROW_BYTES)[staging] = truth_dev[layer][loc_t]
            ctrl.backup_prefilled_request(staging, loc_t)
            base = ctrl.admit_request(r, prefix_locs=loc_t)
            self.assertIsNotNone(base)
            live[r] = n

        def release(r):
            ctrl.release_request(r)
            free_locs.extend(req_to_token[r, : live[r]].tolist())
            del live[r]
            for layer in range(L):
                prev_pick.pop((r, layer), None)
            free_reqs.append(r)

        for _ in range(self.NUM_REGIONS if initial_reqs is None else initial_reqs):
            admit_new()

        for step in range(steps):
            # The previous step's new tokens go to host one step late, before
            # any of their requests is released (their locs are then freed).
            if pending_backup is not None:
                ctrl.write_back_new_tokens(*pending_backup)
            # Turnover: finish a request now and then, admit a new one.
            if step % 7 == 6:
                release(rng.choice(sorted(live)))
            while ctrl.can_admit() and free_reqs and len(live) < self.NUM_REGIONS:
                # With units, regions stay free now and then (for the others
                # to take) and admissions later have to take units back.
                if max_units > 1 and rng.random() < 0.5:
                    break
                admit_new()
            # Free regions become extra LRU units (max_units > 1); the next
            # admission takes one back.
            units_granted.append(ctrl.rebalance())
            if reclaim_lent_every and step % reclaim_lent_every == 0:
                want = len(self.lent.free) + 1
                ctrl.reclaim_units_of("lent", lambda: len(self.lent.free) >= want)

            # One decode step: each live request appends one token and writes
            # it into its window row in every layer.
            reqs = sorted(live)
            rng.shuffle(reqs)
            new_rows, new_locs = [], []
            for r in reqs:
                p = live[r]
                loc = free_locs.pop()
                req_to_token[r, p] = loc
                live[r] = p + 1
                row = ctrl.region_base(r) + C + p % W
                for layer in range(L):
                    self.gpu[layer].view(-1, ROW_BYTES)[row] = truth_dev[layer][loc]
                new_rows.append(row)
                new_locs.append(loc)
            # Padded like a CUDA-graph batch: garbage rows past num_real.
            n_pad = rng.randint(0, 2)
            pad_rows = torch.full((n_pad + 1,), 1 << 30, dtype=torch.int64)
            pad_locs = torch.full((n_pad + 1,), -(1 << 40), dtype=torch.int64)
            rows_t = torch.cat([torch.tensor(new_rows), pad_rows]).to(DEVICE)
            locs_t = torch.cat([torch.tensor(new_locs), pad_locs]).to(DEVICE)
            pending_backup = (
                rows_t,
                locs_t,
                torch.tensor([len(new_rows)], dtype=torch.int32, device=DEVICE),
            )

            bs_real = len(reqs)
            seq_lens = [live[r] for r in reqs] + [1] * n_pad
            stale = [rng.randrange(self.MAX_REQS) for _ in range(n_pad)]
            req_idx = torch.tensor(reqs + stale, dtype=torch.int64, device=DEVICE)
            seq_t = torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE)
            num_real = torch.tensor([bs_real], dtype=torch.int32, device=DEVICE)
            r2t = req_to_token.to(DEVICE)
            ctrl.wait_backup()
            for layer in range(L):
                topk = torch.full((bs_real + n_pad, K), -1, dtype=torch.int64)
                for b, r in enumerate(reqs):
                    n = live[r]
                    keep = [
                        p
                        for p in prev_pick.get((r, layer), [])
                        if p < n and rng.random() < 0.6
                    ]
                    pool = list(range(n))
                    rng.shuffle(pool)
                    pick = list(dict.fromkeys(keep + pool))[: rng.randint(1, K)]
                    prev_pick[r, layer] = pick
                    pick = pick + [-1] * (K - len(pick))
                    rng.shuffle(pick)
                    topk[b] = torch.tensor(pick)
                for b in range(bs_real, bs_real + n_pad):
                    topk[b] = torch.randint(-1, 50, (K,))
                page_table = ctrl.swap_one_layer(
                    layer, topk.to(DEVICE), req_idx, seq_t, r2t, num_real
                )
                _sync()
                pt = page_table.cpu().long()
                dev_rows = self.gpu[layer].view(-1, ROW_BYTES).cpu()
                for b, r in enumerate(reqs):
                    n = live[r]
                    for i in range(K):
                        p = int(topk[b, i])
                        if p < 0:
                            self.assertEqual(int(pt[b, i]), -1)
                            continue
                        loc = int(req_to_token[r, p])
                        row = int(pt[b, i])
                        self.assertTrue(in_request_rows(r, row), (r, row))
                        self.assertTrue(
                            torch.equal(dev_rows[row], truth[layer, loc]),
                            f"step {step} layer {layer} req {r} pos {p}/{n}",
                        )
                        checked["window" if p >= n - W else "lookup"] += 1
                for b in range(bs_real, bs_real + n_pad):
                    self.assertTrue(bool((pt[b] == -1).all()))
                    checked["pad"] += 1

        ctrl.synchronize()
        # Every token that left its window is on the host, exactly.
        for r, n in live.items():
            locs = req_to_token[r, : max(0, n - 1)].long()
            self.assertTrue(torch.equal(self.host.kv_buffer[:, locs], truth[:, locs]))
        stats = ctrl.get_stats()
        self.assertGreater(checked["lookup"], 100)
        self.assertGreater(checked["window"], 10)
        self.assertGreater(stats["misses"], 0)
        self.assertGreater(stats["lru_hits"], 0)
        self.assertEqual(stats["lru_hits"] + stats["misses"], checked["lookup"])
        self.assertEqual(stats["window_hits"], checked["window"])
        self.assertGreaterEqual(stats["h2d_rows"], stats["misses"])
        self.assertEqual(stats["h2d_bytes"], stats["h2d_rows"] * ROW_BYTES)
        self.assertEqual(stats["d2h_bytes"], stats["d2h_rows"] * ROW_BYTES)
        self.assertGreater(stats["d2h_rows"], 0)
        ctrl.reset_stats()
        self.assertEqual(ctrl.get_stats()["h2d_rows"], 0)
        # With units: some were handed out and some taken back from running
        # requests, with the exactness checks above passing throughout.
        self.assertEqual(sum(units_granted) > 0, max_units > 1)
        self.assertEqual(any(reclaimed), max_units > 1)
        return stats

    def test_exact_reference_lru(self):
        self._run(use_triton=False, seed=1, steps=40)

    def test_exact_triton_lru(self):
        self._run(use_triton=True, seed=2, steps=12)

    def test_exact_with_units_reference(self):
        # Releases leave free regions that running requests take as extra
        # units; admissions take them back (shrinking a running request).
        self._run(use_triton=False, seed=4, steps=40, max_units=3)

    def test_exact_with_units_triton(self):
        self._run(use_triton=True, seed=5, steps=12, max_units=2)

    def _run_uneven(self, check, triton_steps=0, **kwargs):
        """6 regions for up to 8 requests, 2 admitted first, up to 4 units
        each: admissions leave requests uneven and units move between them
        (their resident rows dropped, read again). The torch swap and copies
        for 40 steps, then (``triton_steps``) the Triton kernels. ``check``
        gets each run's stats."""
        self.NUM_REGIONS, self.MAX_REQS = 6, 8
        runs = [(False, 40)] + ([(True, triton_steps)] if triton_steps else [])
        for use_triton, steps in runs:
            with self.subTest(use_triton=use_triton):
                stats = self._run(
                    use_triton=use_triton,
                    steps=steps,
                    max_units=4,
                    initial_reqs=2,
                    **kwargs,
                )
                check(stats)

    def test_exact_with_units_moved(self):
        self._run_uneven(lambda s: self.assertGreater(s["units_moved"], 0), seed=6)

    def test_exact_with_lent_units_moved(self):
        # Units of a second source (idle staging, idle locs) lent to the
        # first requests move to those admitted later.
        moved_from = []
        move = SparseCacheController._move_unit

        def recording(ctrl, donor, recipient):
            moved_from.append(ctrl.units.units(donor)[-1][1])
            move(ctrl, donor, recipient)

        def check(_):
            self.assertIn("lent", moved_from)
            moved_from.clear()

        with mock.patch.object(SparseCacheController, "_move_unit", recording):
            self._run_uneven(check, seed=9, lent_units=5)

    def test_exact_with_buried_units_kept(self):
        # Units taken back from below a request's newest one (a region for
        # an admission, a lent unit for its lender): their rows are copied
        # into the newest unit's rows, whose slots are dropped instead.
        def check(stats):
            self.assertGreater(stats["units_kept"], 0)
            self.assertGreater(stats["units_reclaimed"], stats["units_kept"])

        self._run_uneven(
            check, triton_steps=6, seed=13, lent_units=5, reclaim_lent_every=3
        )

    def _run_direct(self, use_triton, seed, max_units=1, steps=30):
        # Prompts of 1-70 tokens on 24 slots: some fit and enter direct
        # mode (warmed whole), most of those outgrow it while decoding.
        entered = []
        enter = LRUCacheState.enter_direct

        def counting(state, r, num_positions):
            entered.append(r)
            enter(state, r, num_positions)

        with mock.patch.object(LRUCacheState, "enter_direct", counting):
            self._run(
                use_triton=use_triton,
                seed=seed,
                steps=steps,
                max_units=max_units,
                direct_slots=True,
            )
        self.assertGreater(len(entered), 1)

    def test_exact_direct_slots_reference(self):
        self._run_direct(use_triton=False, seed=6)

    def test_exact_direct_slots_triton(self):
        self._run_direct(use_triton=True, seed=19, steps=10)

    def test_exact_direct_slots_with_units(self):
        self._run_direct(use_triton=True, seed=8, max_units=2, steps=12)

    def test_exact_without_warmup(self):
        self._run(use_triton=False, seed=3, warm_tokens=0, steps=12)

    def test_miss_counters_match_plans(self):
        ctrl = self.make(use_triton=False, warm_tokens=0)
        r, n = 3, 60
        locs = torch.arange(100, 100 + n, dtype=torch.int64, device=DEVICE)
        req_to_token = torch.zeros((self.MAX_REQS, self.MAX_CTX), dtype=torch.int32)
        req_to_token[r, :n] = locs.cpu().to(torch.int32)
        ctrl.admit_request(r)
        topk = torch.arange(self.K, dtype=torch.int64, device=DEVICE).view(1, -1)
        args = (
            topk,
            torch.tensor([r], device=DEVICE),
            torch.tensor([n], device=DEVICE),
            req_to_token.to(DEVICE),
        )
        # The plan lands in the buffers passed as ``out`` (as the coordinator's).
        plan = LayerSwapPlan(
            torch.full((1, self.K), -1, dtype=torch.int32, device=DEVICE),
            torch.zeros((1, self.K), dtype=torch.int64, device=DEVICE),
            torch.zeros((1, self.K), dtype=torch.int32, device=DEVICE),
            torch.zeros((1,), dtype=torch.int32, device=DEVICE),
        )
        ctrl.swap_one_layer(0, *args, out=plan)
        self.assertEqual(int(plan.miss_count[0]), self.K)
        ctrl.swap_one_layer(0, *args, out=plan)  # all hits now
        self.assertEqual(int(plan.miss_count[0]), 0)
        stats = ctrl.get_stats()
        self.assertEqual(stats["misses"], self.K)
        self.assertEqual(stats["lru_hits"], self.K)
        self.assertEqual(stats["h2d_rows"], self.K)
        self.assertEqual(stats["h2d_bytes"], self.K * ROW_BYTES)


if __name__ == "__main__":
    unittest.main()
