"""The CLOCK replacement (``SGLANG_NSA_KV_OFFLOAD_POLICY=clock``): its torch
reference against a plain-Python CLOCK model (with units), the Triton kernel
against the reference state for state (interpreted on CPU; compiled, at the
served sizes too, on CUDA), the kernel under the hazard recorder, the state's
refusals, and the policy through the real coordinator (one request at a
time, shadowed; the lifecycle, PD decode, the cross-layer prefetch), every
page table checked against the KV written.
"""

import os
import random
import unittest

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import test_nsa_kv_offload_integration as integration
from sglang.srt.mem_cache import lru_cache_state as lru_mod
from sglang.srt.mem_cache.lru_cache_state import LRUCacheState
from sglang.srt.mem_cache.nsa_kv_offload_lru_reference import state_index
from test_lru_cache_state import check_invariants
from test_nsa_kv_offload_integration import (  # noqa: F401 (module fixtures)
    _OneRequestAtATime,
    setUpModule,
    tearDownModule,
)
from triton_hazards import record_hazards

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = DEVICE == "cuda" or lru_mod._swap_kernel_is_interpreted()


class ClockModel:
    """One (layer, request): slots, reference bits, hand (slot ids)."""

    def __init__(self, C0: int):
        self.C0 = C0
        self.slots = [None] * C0  # loc per slot
        self.where = {}  # slot per loc
        self.ref = [0] * C0
        self.hand = 0

    @property
    def cap(self) -> int:
        return len(self.slots)

    def slot_of(self, loc):
        return self.where.get(loc)

    def swap(self, locs):
        """``locs``: looked-up locs in top-k order. Returns each one's slot
        and the misses' (loc, slot) in top-k order."""
        hit_slots = {self.slot_of(l) for l in locs} - {None}
        misses = [l for l in locs if self.slot_of(l) is None]
        cand = [
            s
            for s in ((self.hand + i) % self.cap for i in range(self.cap))
            if s not in hit_slots
        ]
        victims = []
        for s in cand:  # first revolution
            if len(victims) == len(misses):
                break
            if self.ref[s] == 0:
                victims.append(s)
            else:
                self.ref[s] = 0  # second chance used
        for s in cand:  # second: the slots the first cleared
            if len(victims) == len(misses):
                break
            if s not in victims:
                victims.append(s)
        if victims:
            self.hand = (victims[-1] + 1) % self.cap
        for s in hit_slots:
            self.ref[s] = 1
        for loc, s in zip(misses, victims):
            self.where.pop(self.slots[s], None)
            self.slots[s], self.where[loc] = loc, s
            self.ref[s] = 0
        slot = {l: self.slot_of(l) for l in locs}
        return slot, list(zip(misses, victims))

    def grow(self):
        self.hand = self.cap
        self.slots += [None] * self.C0
        self.ref += [0] * self.C0

    def shrink(self):
        lo = self.cap - self.C0
        for loc in self.slots[lo:]:
            self.where.pop(loc, None)
        self.slots, self.ref = self.slots[:lo], self.ref[:lo]
        if self.hand >= lo:
            self.hand = 0


def clock_state(use_triton, layers=2, C0=16, K=8, W=2, units=3, max_reqs=4, locs=4000):
    return LRUCacheState(
        num_layers=layers,
        max_num_reqs=max_reqs,
        num_locs=locs,
        buffer_size=C0,
        recent_window=W,
        top_k=K,
        device=DEVICE,
        use_triton=use_triton,
        max_units=units,
        policy="clock",
    )


def held(state, layer, r):
    """(slot_loc, bits, hand) of request r in layer l, as lists."""
    cap = int(state._capacity_buf[r])
    idx = torch.arange(cap, device=state.device)[None, :]
    at = state_index(state, torch.tensor([r], device=state.device), idx)[0]
    slot_loc = state._slot_loc_buf[layer].view(-1)[at].tolist()
    bits = state._ref_buf[layer].view(-1)[at].tolist()
    return slot_loc, bits, int(state._hand_buf[layer, r])


class ClockSim:
    """Random decode steps over a few requests: admissions with warm-ups,
    units grown and shrunk, releases, padding rows; states and models in
    lockstep."""

    def __init__(self, test, states, seed):
        self.t, self.states = test, states
        self.rng = random.Random(seed)
        s = states[0]
        self.C0, self.K, self.W = s.buffer_size, s.top_k, s.recent_window
        self.units, self.max_reqs = s.max_units, s.max_num_reqs
        # Lengths scale with the slots (C0 = 16: prompts of 5-120 tokens).
        self.scale = max(1, self.C0 // 16)
        self.ctx = 200 * self.scale
        self.reqs = {}  # r -> [seq_len, {layer: ClockModel}]
        self.r2t = torch.arange(self.max_reqs * self.ctx, dtype=torch.int32)
        self.r2t = self.r2t.reshape(self.max_reqs, self.ctx).to(DEVICE)
        self.layers = states[0].num_layers

    def row_base(self, r, unit):
        # Disjoint GPU rows per (request, unit); the region has its window.
        return (r * self.units + unit) * (self.C0 + self.W)

    def admit(self, r):
        n = self.rng.randrange(5, 120 * self.scale)
        models = {l: ClockModel(self.C0) for l in range(self.layers)}
        warm = [
            r * self.ctx + p
            for p in range(
                max(0, n - self.W - self.rng.randrange(0, 12 * self.scale)), n - self.W
            )
        ]
        for s in self.states:
            s.admit_request(r, self.row_base(r, 0))
            if warm:
                s.warm_request(range(self.layers), r, torch.tensor(warm))
        for m in models.values():
            if warm:
                m.swap(warm)
        self.reqs[r] = [n, models]

    def step(self):
        rng = self.rng
        for r in range(self.max_reqs):
            if r not in self.reqs and rng.random() < 0.4:
                self.admit(r)
            elif r in self.reqs and rng.random() < 0.05:
                for s in self.states:
                    s.release_request(r)
                del self.reqs[r]
        for r, (n, models) in self.reqs.items():
            units = models[0].cap // self.C0
            if units < self.units and rng.random() < 0.2:
                for s in self.states:
                    s.grow_request(r, units, self.row_base(r, units))
                for m in models.values():
                    m.grow()
            elif units > 1 and rng.random() < 0.1:
                for s in self.states:
                    s.shrink_request(r, units - 1)
                for m in models.values():
                    m.shrink()
        batch = [r for r in self.reqs if rng.random() < 0.8]
        if not batch:
            return
        for r in batch:
            self.reqs[r][0] += 1
        pad = rng.randrange(0, 3)
        seq = [self.reqs[r][0] for r in batch]
        idx = torch.tensor(batch + [0] * pad, device=DEVICE)
        lens = torch.tensor(seq + [1] * pad, device=DEVICE)
        for layer in range(self.layers):
            rows = []
            for r, n in zip(batch, seq):
                hot = list(range(0, n, 3))
                picks = rng.sample(range(n), min(n, self.K // 2))
                picks += rng.sample(hot, min(len(hot), self.K - len(picks)))
                picks = list(dict.fromkeys(picks))[: self.K]
                rows.append(picks + [-1] * (self.K - len(picks)))
            rows += [[-1] * self.K for _ in range(pad)]
            topk = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
            plans = [
                s.swap_layer(layer, topk, idx, lens, self.r2t, num_real_reqs=len(batch))
                for s in self.states
            ]
            for b, (r, n) in enumerate(zip(batch, seq)):
                model = self.reqs[r][1][layer]
                looked = [p for p in rows[b] if 0 <= p < n - self.W]
                slot, loaded = model.swap([r * self.ctx + p for p in looked])
                for s, plan in zip(self.states, plans):
                    self.check(s, plan, b, r, layer, rows[b], n, slot, loaded)
            for s, plan in zip(self.states, plans):
                for b in range(len(batch), len(batch) + pad):
                    self.t.assertEqual(int(plan.miss_count[b]), 0)
        for s in self.states:
            check_invariants(self.t, s)

    def check(self, state, plan, b, r, layer, row, n, slot, loaded):
        model = self.reqs[r][1][layer]
        slot_loc, bits, hand = held(state, layer, r)
        self.t.assertEqual(slot_loc, [-1 if x is None else x for x in model.slots])
        self.t.assertEqual(bits, model.ref)
        self.t.assertEqual(hand, model.hand)
        count = int(plan.miss_count[b])
        self.t.assertEqual(count, len(loaded))
        self.t.assertEqual(
            plan.miss_src_loc[b, :count].tolist(), [l for l, _ in loaded]
        )
        unit_base = state._unit_base_buf[r].tolist()
        rows = [unit_base[s // self.C0] + s % self.C0 for _, s in loaded]
        self.t.assertEqual(plan.miss_dst_row[b, :count].tolist(), rows)
        base = unit_base[0]
        expect = []
        for p in row:
            if p < 0 or p >= n:
                expect.append(-1)
            elif p >= n - self.W:
                expect.append(base + self.C0 + p % self.W)
            else:
                s = slot[r * self.ctx + p]
                expect.append(unit_base[s // self.C0] + s % self.C0)
        self.t.assertEqual(plan.page_table[b].tolist(), expect)


def assert_same_state(test, a, b):
    for name in ("_loc_to_slot_buf", "_slot_loc_buf", "_ref_buf", "_hand_buf"):
        # Sink entries (the last loc, chunk, request) may differ: masked
        # scatters land there.
        x, y = getattr(a, name)[:, :-1], getattr(b, name)[:, :-1]
        test.assertTrue(torch.equal(x, y), name)


class TestClockPolicy(unittest.TestCase):
    def _run(self, impls, seed, steps=40, **sizes):
        states = [clock_state(u, **sizes) for u in impls]
        sim = ClockSim(self, states, seed)
        for _ in range(steps):
            sim.step()
        return states

    def test_reference_against_model(self):
        for seed in range(4):
            with self.subTest(seed=seed):
                self._run([False], seed)

    @unittest.skipUnless(TRITON_OK, "Triton not interpreted")
    def test_triton_against_model_and_reference(self):
        for seed in range(2):
            with self.subTest(seed=seed):
                assert_same_state(self, *self._run([False, True], seed, steps=25))

    @unittest.skipUnless(DEVICE == "cuda", "the served sizes: compiled kernels")
    def test_served_sizes(self):
        # 4,096-row units, top-k 2,048, window 64: the kernel's blocks as a
        # server compiles them (1,024-position sweep blocks, 2,048 entries).
        sizes = dict(C0=4096, K=2048, W=64, units=3, max_reqs=4, locs=4 * 51200)
        for seed in range(2):
            with self.subTest(seed=seed):
                states = self._run([False, True], seed, steps=10, **sizes)
                assert_same_state(self, *states)

    def test_second_revolution(self):
        # Every slot referenced: the first revolution clears all the bits,
        # the second takes the victims from the hand on.
        for use_triton in [False] + ([True] if TRITON_OK else []):
            s = clock_state(use_triton, layers=1, C0=8, K=8, W=2, units=1)
            s.admit_request(0, 100)
            r2t = torch.arange(64, dtype=torch.int32, device=DEVICE)[None, :]

            def swap(positions):
                topk = torch.tensor([positions], dtype=torch.int32, device=DEVICE)
                return s.swap_layer(
                    0,
                    topk,
                    torch.tensor([0], device=DEVICE),
                    torch.tensor([40], device=DEVICE),
                    r2t,
                )

            swap(list(range(8)))  # fill slots 0..7, bits clear, hand 0
            swap(list(range(8)))  # all hits: every bit set
            self.assertEqual(held(s, 0, 0)[1], [1] * 8)
            plan = swap([8, 9, 0, 1, -1, -1, -1, -1])  # 2 misses, slots 0, 1 hit
            slot_loc, bits, hand = held(s, 0, 0)
            # Hits 0 and 1 skipped; 2..7 cleared in the first revolution; the
            # second takes 2 and 3.
            self.assertEqual(slot_loc, [0, 1, 8, 9, 4, 5, 6, 7])
            self.assertEqual(bits, [1, 1, 0, 0, 0, 0, 0, 0])
            self.assertEqual(hand, 4)
            self.assertEqual(plan.miss_dst_row[0, :2].tolist(), [102, 103])

    def test_refusals(self):
        with self.assertRaisesRegex(ValueError, "policy"):
            LRUCacheState(1, 2, 10, 8, 2, 4, device=DEVICE, policy="lfu")
        with self.assertRaisesRegex(ValueError, "clock"):
            LRUCacheState(
                1, 2, 10, 8, 2, 4, device=DEVICE, policy="clock", direct_slots=True
            )
        with self.assertRaisesRegex(ValueError, "clock"):
            LRUCacheState(
                1, 2, 10, 8, 2, 4, device=DEVICE, policy="clock", max_query_tokens=2
            )


@unittest.skipUnless(
    lru_mod._swap_kernel_is_interpreted(), "the recorder hooks the interpreter"
)
class TestClockKernelHazards(unittest.TestCase):
    """No data race in the CLOCK kernel that the interpreter could hide
    (``triton_hazards``); without its barriers it races (the control)."""

    def _recorded(self, ignore_barriers):
        with record_hazards(ignore_barriers=ignore_barriers) as log:
            sim = ClockSim(self, [clock_state(True)], seed=5)
            for _ in range(12):
                sim.step()
        self.assertGreater(log.launches.get("_clock_swap_kernel", 0), 0)
        return log

    def test_no_race(self):
        log = self._recorded(False)
        self.assertEqual(log.counts(), {}, log.report())

    def test_barriers_ignored(self):
        log = self._recorded(True)
        self.assertIn(("_clock_swap_kernel", "threads"), log.counts())


class TestOneRequestAtATimeClock(_OneRequestAtATime):
    """Through the real coordinator: walkers over their units and requests
    that fit them, one after another in one slot, every page table checked
    against the KV written."""

    PROMPTS_IN_UNITS = (2.3, 0.7, 5.5, 1.95, 0.45)

    def harness_ready(self, h):
        self.assertTrue(h.co.lru.uses_clock)

    def test_default_units(self):
        self._run(4, early_swap=True, slot_policy="clock")

    def test_warm_units_two_units(self):
        self._run(2, early_swap=True, warm_units=True, slot_policy="clock")

    def test_shadowed(self):
        # Every Triton swap against the torch reference on a copy of the
        # state (lru_shadow): bits, hands, maps, page tables.
        self._run(2, shadow=True, early_swap=True, slot_policy="clock")


class TestLifecycleClock(integration.TestOffloadLifecycleDefaults):
    """The lifecycle with the server's defaults (units, lent staging, the
    early swap), CLOCK instead of LRU: admission, decode, retraction."""

    SLOT_POLICY = "clock"


class TestPDDecodeLifecycleClock(integration.TestPDDecodeLifecycleDefaults):
    """PD decode (KV arrives in host slots, retraction) with CLOCK."""

    SLOT_POLICY = "clock"


class TestCrossLayerPrefetchClock(integration.TestCrossLayerPrefetchEarlySwap):
    """The cross-layer prefetch (another layer's top-k into this layer's
    slots) with CLOCK."""

    SLOT_POLICY = "clock"

    def check_prefetched(self, prefetched: int, first_layer_misses: int) -> None:
        # A prefetched row is hit by its layer's own swap (its bit set) while
        # layer 0's loads start clear: the layers' victims part, and the
        # loads differ a little from twice layer 0's misses.
        self.assertGreater(prefetched, 0)


if __name__ == "__main__":
    unittest.main()
