"""LRUCacheState: torch reference vs the Triton kernels vs a plain-Python model.

On a CPU-only machine the Triton kernel runs under the interpreter: set
TRITON_INTERPRET=1 before anything imports triton-jitted sglang modules (this
file sets it when it is first and CUDA is absent). Sizes are kept small so the
interpreter finishes quickly; benchmark/nsa_offload/engine/gpu_check_lru.py repeats the
differential check at production sizes on a GPU.
"""

import os
import random
import unittest
from dataclasses import dataclass
from typing import List
from unittest import mock

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lru_model import LRUModel
from sglang.srt.mem_cache import lru_cache_state as lru_mod
from sglang.srt.mem_cache import nsa_kv_offload_lru_reference as lru_reference
from sglang.srt.mem_cache.lru_cache_state import LayerSwapPlan, LRUCacheState
from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import TritonLRUSwap

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = DEVICE == "cuda" or lru_mod.swap_kernel_is_interpreted()
TRITON_SKIP_REASON = (
    "Triton kernel not interpreted on this CPU machine: set TRITON_INTERPRET=1 "
    "before sglang.srt.mem_cache.lru_cache_state is first imported"
)


def new_state(cfg, use_triton: bool, **kwargs) -> LRUCacheState:
    kwargs.setdefault("max_units", cfg.units)
    kwargs.setdefault("direct_slots", getattr(cfg, "direct", False))
    return LRUCacheState(
        num_layers=cfg.layers,
        max_num_reqs=cfg.max_reqs,
        num_locs=cfg.num_locs,
        buffer_size=cfg.C,
        recent_window=cfg.W,
        top_k=cfg.K,
        device=DEVICE,
        use_triton=use_triton,
        **kwargs,
    )


# ---------------------------------------------------------------- checks


def check_invariants(test: unittest.TestCase, state: LRUCacheState) -> None:
    C = state.num_slots
    lru = state.lru_order.long().cpu()
    cap = state.capacity.long().cpu()[None, :, None]
    ar = torch.arange(C)
    # Each request's order: its held slots once each, then -1.
    expect = torch.where(ar < cap, ar, -1).expand_as(lru)
    held_sorted = torch.where(lru >= 0, lru, C).sort(-1).values
    test.assertTrue(
        torch.equal(torch.where(held_sorted < C, held_sorted, -1), expect),
        "lru_order not a permutation of the held slots",
    )
    # Unit chunks: each free or held once; unit_index names the held ones
    # (the sink chunk past them); a held chunk's slots are the only ones
    # with locs (free chunks are empty).
    held = [c for cs in state._req_chunks.values() for c in cs]
    test.assertEqual(
        sorted(held + state._free_chunks), list(range(state.num_units)), "chunks"
    )
    index = state.unit_index.cpu().tolist()
    for r in range(state.max_num_reqs):
        cs = state._req_chunks.get(r, [])
        expect = cs + [state.num_units] * (state.max_units - len(cs))
        test.assertEqual(index[r], expect, f"unit_index of request {r}")
        test.assertEqual(int(state.capacity[r]), len(cs) * state.buffer_size)
    free = torch.tensor(state._free_chunks, dtype=torch.int64)
    test.assertTrue(bool((state._slot_loc_buf[:, free.to(DEVICE)] == -1).all()))
    slot_loc = state.slot_loc.long().cpu()
    l2s = state.loc_to_slot.long().cpu()
    for layer in range(state.num_layers):
        sl = slot_loc[layer]
        r_idx, s_idx = (sl >= 0).nonzero(as_tuple=True)
        locs = sl[r_idx, s_idx]
        test.assertEqual(locs.unique().numel(), locs.numel(), "loc in two slots")
        test.assertTrue(
            torch.equal(l2s[layer, locs], s_idx), "slot_loc -> loc_to_slot mismatch"
        )
        test.assertEqual(
            int((l2s[layer] >= 0).sum()), locs.numel(), "stale loc_to_slot entries"
        )


def check_plan(test, state, plan, inp, layer) -> None:
    """Structural checks of one swap result (no model needed)."""
    C, W = state.buffer_size, state.recent_window
    pt = plan.page_table.long().cpu()
    unit_base = state.unit_base.long().cpu()
    cnt = plan.miss_count.long().cpu()
    bs = pt.shape[0]
    for b in range(bs):
        if b >= inp.num_real:
            test.assertTrue(bool((pt[b] == -1).all()))
            test.assertEqual(int(cnt[b]), 0)
            continue
        r, n = inp.req_pool_indices[b], inp.seq_lens[b]
        base = int(state.region_base[r])
        pos = torch.tensor(inp.topk[b])
        pad = (pos < 0) | (pos >= n)
        test.assertTrue(torch.equal(pt[b] == -1, pad), "page table -1 != padding")
        units = [int(u) for u in unit_base[r] if u >= 0]
        test.assertEqual(units[0], base)

        def unit_of(rows, size):
            """Unit index of each row (-1: in none of the request's units)."""
            u = torch.full_like(rows, -1)
            for i, ub in enumerate(units):
                u = torch.where((rows >= ub) & (rows < ub + size), i, u)
            return u

        rows = pt[b][~pad]
        window = (rows >= base + C) & (rows < base + C + W)
        test.assertTrue(bool(((unit_of(rows, C) >= 0) | window).all()))
        c = int(cnt[b])
        dst = plan.miss_dst_row[b, :c].long().cpu()
        src = plan.miss_src_loc[b, :c].long().cpu()
        test.assertEqual(dst.unique().numel(), c, "two misses share a victim")
        dst_unit = unit_of(dst, C)
        test.assertTrue(bool((dst_unit >= 0).all()), "miss row outside the units")
        test.assertEqual(src.unique().numel(), c)
        # The victim now holds the loaded loc.
        slots = dst_unit * C + dst - unit_base[r][dst_unit.clamp(min=0)]
        test.assertTrue(
            torch.equal(state.slot_loc[layer, r, slots].long().cpu(), src),
            "victim slot does not hold the missed loc",
        )


def plan_rows(plan: LayerSwapPlan, bs: int):
    pt = plan.page_table.cpu().tolist()
    cnt = plan.miss_count.cpu().tolist()
    src = plan.miss_src_loc.cpu().tolist()
    dst = plan.miss_dst_row.cpu().tolist()
    return [(pt[b], list(zip(src[b][: cnt[b]], dst[b][: cnt[b]]))) for b in range(bs)]


def assert_state_matches_model(test, state: LRUCacheState, model: LRUModel) -> None:
    L, C, N = state.num_layers, state.num_slots, state.num_locs
    l2s = torch.full((L, N), -1, dtype=torch.int64)
    slot_loc = torch.full((L, state.max_num_reqs, C), -1, dtype=torch.int64)
    lru = torch.full((L, state.max_num_reqs, C), -1, dtype=torch.int64)
    for layer in range(L):
        for loc, s in model.loc_to_slot[layer].items():
            l2s[layer, loc] = s
    for (layer, r), locs in model.slot_loc.items():
        slot_loc[layer, r] = torch.tensor(locs)
        order = model.lru_order[layer, r]
        lru[layer, r, : len(order)] = torch.tensor(order, dtype=torch.int64)
    test.assertTrue(torch.equal(state.loc_to_slot.long().cpu(), l2s), "loc_to_slot")
    test.assertTrue(torch.equal(state.slot_loc.long().cpu(), slot_loc), "slot_loc")
    test.assertTrue(torch.equal(state.lru_order.long().cpu(), lru), "lru_order")
    test.assertEqual(state.counters.cpu().tolist(), model.counters, "counters")
    direct = [int(r in model.direct) for r in range(state.max_num_reqs)]
    test.assertEqual(state.direct.cpu().tolist(), direct, "direct")
    for r, base in model.region_base.items():
        test.assertEqual(int(state.region_base[r]), base)
    for r, units in model.units.items():
        expect = units + [-1] * (state.max_units - len(units))
        test.assertEqual(state.unit_base[r].tolist(), expect, "unit_base")
        test.assertEqual(int(state.capacity[r]), len(units) * state.buffer_size)


def assert_states_equal(test, a: LRUCacheState, b: LRUCacheState) -> None:
    names = ("loc_to_slot", "slot_loc", "lru_order", "region_base", "counters")
    for name in names + ("unit_base", "capacity", "direct"):
        test.assertTrue(
            torch.equal(getattr(a, name), getattr(b, name)), f"{name} differs"
        )


def swap_request_0(state, positions, seq_len, r2t) -> LayerSwapPlan:
    """Layer 0's swap of request 0 alone (the hand-written examples)."""
    topk = torch.tensor([positions], dtype=torch.int32, device=DEVICE)
    return state.swap_layer(
        0,
        topk,
        torch.tensor([0], device=DEVICE),
        torch.tensor([seq_len], device=DEVICE),
        r2t,
    )


# ---------------------------------------------------------------- workload


@dataclass
class SimConfig:
    layers: int = 2
    C: int = 64
    K: int = 32
    W: int = 4
    max_reqs: int = 6
    num_locs: int = 1500
    max_ctx: int = 320
    max_batch: int = 4
    max_prompt: int = 160
    p_keep: float = 0.7  # reuse of the previous step's pick
    p_recent: float = 0.8  # pick of a token just outside the window
    p_admit: float = 0.3
    p_release: float = 0.12
    p_warm: float = 0.5
    max_pad_rows: int = 2
    check_every: int = 1
    units: int = 1  # max_units; > 1: requests grow and shrink between steps
    p_grow: float = 0.3
    p_shrink: float = 0.15
    direct: bool = False  # direct_slots; admissions that fit may enter it
    p_direct: float = 0.6


@dataclass
class StepInput:
    topk: List[List[int]]
    req_pool_indices: List[int]
    seq_lens: List[int]
    num_real: int


class Sim:
    """Random decode workload driving LRUCacheStates and an LRUModel in lockstep.

    Growing sequences, top-k with locality, admission/release churn with token
    locs and regions reused by new requests, CUDA-graph padding rows.
    """

    def __init__(self, test, cfg: SimConfig, states, model, seed: int):
        self.test, self.cfg, self.states, self.model = test, cfg, states, model
        self.deferred_states = []  # states whose swaps defer their reorder
        self.rng = random.Random(seed)
        self.free_locs = list(range(cfg.num_locs))
        self.rng.shuffle(self.free_locs)
        self.free_reqs = list(range(cfg.max_reqs))
        self.rng.shuffle(self.free_reqs)
        self.region_size = cfg.C + cfg.W
        self.free_regions = list(range(cfg.max_reqs))
        # Extra units live past the regions (C rows each, no window).
        units_start = 3 + cfg.max_reqs * self.region_size
        self.free_units = [
            units_start + i * cfg.C for i in range(cfg.max_reqs * (cfg.units - 1))
        ]
        self.rng.shuffle(self.free_units)
        self.req_to_token = torch.zeros((cfg.max_reqs, cfg.max_ctx), dtype=torch.int32)
        self.reqs = {}  # r -> {"locs": [...], "region": int, "prev": {layer: [...]}}
        self.steps = 0
        self.direct_entered = 0
        self.direct_units_entered = 0  # of those, past one unit's slots

    # -- lifecycle

    def admit(self) -> None:
        cfg, rng = self.cfg, self.rng
        if not self.free_reqs or len(self.reqs) >= cfg.max_batch:
            return
        n = rng.randint(1, min(cfg.max_prompt, cfg.max_ctx - 1))
        if len(self.free_locs) < n + 64:
            return
        r = self.free_reqs.pop()
        region = self.free_regions.pop(rng.randrange(len(self.free_regions)))
        # Most recently freed locs first, so released locs get reused.
        locs = [self.free_locs.pop() for _ in range(n)]
        self.req_to_token[r, :n] = torch.tensor(locs, dtype=torch.int32)
        self.reqs[r] = {"locs": locs, "region": region, "prev": {}, "units": []}
        base = 3 + region * self.region_size
        for i, state in enumerate(self.states):
            # Exercise int and tensor arguments.
            if i % 2:
                state.admit_request(torch.tensor([r]), torch.tensor([base]))
            else:
                state.admit_request(r, base)
        self.model.admit(r, base)
        below_window = max(0, n + 1 - cfg.W)
        if cfg.direct and below_window <= cfg.C and rng.random() < cfg.p_direct:
            self.warm_direct(r)
        elif cfg.direct and cfg.units > 1 and rng.random() < cfg.p_direct:
            self.warm_direct_units(r, below_window)
        elif rng.random() < cfg.p_warm:
            self.warm(r)

    def warm_direct(self, r: int) -> None:
        """As the controller admits a request that fits: every position below
        its first window installed in order, then direct mode."""
        locs = self.reqs[r]["locs"]
        older = locs[: max(0, len(locs) + 1 - self.cfg.W)]
        layers = list(range(self.cfg.layers))
        expect = self.model.warm(layers, r, [older] * len(layers)) if older else []
        self.model.enter_direct(r)
        self.direct_entered += 1
        for state in self.states:
            if older:
                arg = torch.tensor(older, dtype=torch.int64, device=DEVICE)
                rows = state.warm_request(range(self.cfg.layers), r, arg)
                self.test.assertEqual(rows.cpu().tolist(), expect)
            state.enter_direct(r, len(older))

    def warm_direct_units(self, r: int, below_window: int) -> None:
        """As the controller warms a request after its units are granted
        (warm units): when the positions below its first window fit what it
        holds then, each in its own slot across the units (warm_direct)."""
        cfg, rng = self.cfg, self.rng
        units = self.reqs[r]["units"]
        want = rng.randint(1, cfg.units - 1)
        while len(units) < want and self.free_units:
            units.append(self.free_units.pop())
            for state in self.states:
                state.grow_request(r, len(units), units[-1])
            self.model.grow(r, units[-1])
        if below_window > (len(units) + 1) * cfg.C:
            return
        older = self.reqs[r]["locs"][:below_window]
        layers = list(range(cfg.layers))
        expect = self.model.warm_direct(layers, r, older)
        self.direct_entered += 1
        self.direct_units_entered += below_window > cfg.C
        for state in self.states:
            arg = torch.tensor(older, dtype=torch.int64, device=DEVICE)
            rows = state.warm_direct(layers, r, arg)
            self.test.assertEqual(rows.cpu().tolist(), expect)

    def warm(self, r: int) -> None:
        cfg, rng = self.cfg, self.rng
        locs = self.reqs[r]["locs"]
        older = locs[: max(0, len(locs) - cfg.W)]
        count = rng.randint(0, min(len(older), cfg.C))
        layers = list(range(cfg.layers))
        if rng.random() < 0.5:
            if rng.random() < 0.5:
                layers = layers[rng.randrange(cfg.layers) :]
            chosen = older[len(older) - count :]
            chosen = [-1 if rng.random() < 0.1 else x for x in chosen]
            per_layer = [chosen] * len(layers)
            arg = torch.tensor(chosen, dtype=torch.int64)
        else:
            per_layer = [
                [x if rng.random() < 0.8 else -1 for x in rng.sample(older, count)]
                for _ in layers
            ]
            arg = torch.tensor(per_layer, dtype=torch.int64)
        expect = self.model.warm(layers, r, per_layer)
        layer_arg = range(layers[0], cfg.layers) if len(layers) > 1 else layers
        for state in self.states:
            rows = state.warm_request(layer_arg, r, arg.to(DEVICE))
            self.test.assertEqual(rows.cpu().tolist(), expect)

    def release(self, rs: List[int]) -> None:
        for r in rs:
            req = self.reqs.pop(r)
            self.free_locs.extend(req["locs"])
            self.free_regions.append(req["region"])
            self.free_units.extend(req["units"])
            self.free_reqs.append(r)
            self.model.release(r)
        for i, state in enumerate(self.states):
            if len(rs) == 1 and i % 2 == 0:
                state.release_request(rs[0])
            else:
                state.release_request(torch.tensor(rs, device=DEVICE))

    def grow_or_shrink(self) -> None:
        """Random unit changes of live requests, as the coordinator would
        make between decode steps."""
        cfg, rng = self.cfg, self.rng
        for r in sorted(self.reqs):
            units = self.reqs[r]["units"]
            if units and rng.random() < cfg.p_shrink:
                self.free_units.append(units.pop())
                for state in self.states:
                    state.shrink_request(r, len(units) + 1)
                self.model.shrink(r)
            elif (
                len(units) + 1 < cfg.units
                and self.free_units
                and rng.random() < cfg.p_grow
            ):
                base = self.free_units.pop()
                units.append(base)
                for state in self.states:
                    state.grow_request(r, len(units), base)
                self.model.grow(r, base)

    # -- decode

    def pick_topk(self, r: int, layer: int) -> List[int]:
        cfg, rng = self.cfg, self.rng
        req = self.reqs[r]
        n = len(req["locs"])
        chosen, seen = [], set()

        def add(p):
            if p not in seen and len(chosen) < cfg.K:
                seen.add(p)
                chosen.append(p)

        for p in req["prev"].get(layer, []):
            if 0 <= p < n and rng.random() < cfg.p_keep:
                add(p)
        for p in range(n - 1, max(-1, n - cfg.W - 4), -1):
            if rng.random() < cfg.p_recent:
                add(p)
        want = rng.randint(len(chosen), cfg.K)
        others = rng.sample(range(n), min(n, cfg.K))
        for p in others:
            if len(chosen) >= want:
                break
            add(p)
        rng.shuffle(chosen)
        req["prev"][layer] = list(chosen)
        out = chosen + [-1] * (cfg.K - len(chosen))
        # Some padding -1 and out-of-range positions mixed in.
        for _ in range(rng.randint(0, 3)):
            i = rng.randrange(cfg.K)
            out[i] = -1 if rng.random() < 0.5 else n + rng.randrange(4)
        if len(set(p for p in out if p >= 0)) != len([p for p in out if p >= 0]):
            out = [p if p < n else -1 for p in out]
        return out

    def step(self) -> None:
        cfg, rng = self.cfg, self.rng
        self.steps += 1
        if rng.random() < cfg.p_admit or not self.reqs:
            self.admit()
        if self.reqs and rng.random() < cfg.p_release:
            k = rng.randint(1, min(2, len(self.reqs)))
            self.release(rng.sample(sorted(self.reqs), k))
        if rng.random() < cfg.p_admit:
            self.admit()
        if cfg.units > 1:
            self.grow_or_shrink()
        # Grow each request by one token (its new loc).
        for r in sorted(self.reqs):
            req = self.reqs[r]
            if len(req["locs"]) >= cfg.max_ctx or not self.free_locs:
                self.release([r])
                continue
            loc = self.free_locs.pop()
            self.req_to_token[r, len(req["locs"])] = loc
            req["locs"].append(loc)
        batch = list(self.reqs)
        rng.shuffle(batch)
        if not batch:
            return
        num_real = len(batch)
        pad = rng.randint(0, cfg.max_pad_rows)
        rpi = batch + [rng.randrange(cfg.max_reqs) for _ in range(pad)]
        seq_lens = [len(self.reqs[r]["locs"]) for r in batch] + [1] * pad
        r2t = self.req_to_token.to(DEVICE)
        r2t_list = self.req_to_token.tolist()
        idx_dtype = rng.choice([torch.int32, torch.int64])
        for layer in range(cfg.layers):
            topk = [self.pick_topk(r, layer) for r in batch]
            topk += [
                [rng.choice([-1, 0, 1, 5]) for _ in range(cfg.K)] for _ in range(pad)
            ]
            inp = StepInput(topk, rpi, seq_lens, num_real)
            expect = self.model.swap(layer, topk, rpi, seq_lens, r2t_list, num_real)
            for state in self.states:
                plan = self.run_swap(state, layer, inp, r2t, idx_dtype)
                got = plan_rows(plan, len(rpi))
                self.test.assertEqual(got, expect, f"step {self.steps} layer {layer}")
                check_plan(self.test, state, plan, inp, layer)
        if self.steps % cfg.check_every == 0:
            for state in self.states:
                assert_state_matches_model(self.test, state, self.model)
                check_invariants(self.test, state)

    def run_swap(self, state, layer, inp, r2t, idx_dtype) -> LayerSwapPlan:
        rng, bs = self.rng, len(inp.req_pool_indices)
        topk = torch.tensor(inp.topk, dtype=idx_dtype, device=DEVICE)
        rpi = torch.tensor(inp.req_pool_indices, dtype=idx_dtype, device=DEVICE)
        seq_lens = torch.tensor(inp.seq_lens, dtype=idx_dtype, device=DEVICE)
        if inp.num_real == bs and rng.random() < 0.3:
            num_real = None
        else:
            num_real = torch.tensor([inp.num_real], dtype=torch.int32, device=DEVICE)
        out = None
        if rng.random() < 0.5:
            # Preallocated (CUDA-graph style) buffers, larger than bs, dirty.
            rows, k = bs + rng.randint(0, 2), state.top_k
            out = LayerSwapPlan(
                torch.full((rows, k), 777, dtype=torch.int32, device=DEVICE),
                torch.full((rows, k), 777, dtype=torch.int64, device=DEVICE),
                torch.full((rows, k), 777, dtype=torch.int32, device=DEVICE),
                torch.full((rows,), 777, dtype=torch.int32, device=DEVICE),
            )
        defer = any(state is s for s in self.deferred_states)
        plan = state.swap_layer(
            layer, topk, rpi, seq_lens, r2t, num_real, out=out, defer_reorder=defer
        )
        if defer and state.swap_backend.reorder_pending:
            # The plan is final before the reorder; the state refuses changes.
            before = plan_rows(plan, bs)
            with self.test.assertRaisesRegex(RuntimeError, "finish_reorder"):
                state.release_request(inp.req_pool_indices[0])
            state.finish_reorder()
            self.test.assertEqual(plan_rows(plan, bs), before)
        backend = state.swap_backend
        if state.use_triton and backend.max_query_tokens == 1:
            # The reorder leaves the hit flags zero for the next select (the
            # multi-token kernels zero them before use instead).
            flags = state.swap_backend._hit_flags
            self.test.assertEqual(int(flags.ne(0).sum()), 0)
        self.test.assertEqual(tuple(plan.page_table.shape), (bs, state.top_k))
        if out is not None:
            self.test.assertEqual(plan.page_table.data_ptr(), out.page_table.data_ptr())
        return plan


def impl_state(cfg, impl) -> LRUCacheState:
    """``impl``: False (reference), True (Triton) or "deferred" (Triton, every
    swap's reorder deferred, the victim scan in blocks of 8 lru positions)."""
    if impl == "deferred":
        state = new_state(cfg, True)
        state.swap_backend.SELECT_BLOCK = 8
        return state
    return new_state(cfg, impl)


def run_sim(
    test, cfg: SimConfig, use_triton, steps: int, seed: int, after_step=None
) -> Sim:
    states = [impl_state(cfg, u) for u in use_triton]
    model = LRUModel(cfg.layers, cfg.C, cfg.W, max_units=cfg.units)
    sim = Sim(test, cfg, states, model, seed)
    sim.deferred_states = [s for s, u in zip(states, use_triton) if u == "deferred"]
    for _ in range(steps):
        sim.step()
        if after_step is not None:
            after_step(sim)
    for state in states:
        assert_state_matches_model(test, state, sim.model)
    for a in states[1:]:
        assert_states_equal(test, states[0], a)
    return sim


# ---------------------------------------------------------------- tests


class TestLRUCacheStateBasics(unittest.TestCase):
    def _impls(self):
        return [False, True] if TRITON_OK else [False]

    def test_validation(self):
        with self.assertRaises(ValueError):
            LRUCacheState(1, 2, 10, 8, 2, 16, device=DEVICE, use_triton=False)
        with self.assertRaises(ValueError):
            LRUCacheState(1, 2, 10, 8, 8, 4, device=DEVICE, use_triton=False)
        with self.assertRaises(ValueError):
            LRUCacheState(1, 2, 10, 1 << 31, 8, 4, device=DEVICE, use_triton=False)
        # Slot ids: int16 while units x buffer fit (the default sizes), int32
        # beyond.
        self.assertEqual(lru_mod.lru_slot_dtype(32767), torch.int16)
        self.assertEqual(lru_mod.lru_slot_dtype(32768), torch.int32)
        s = LRUCacheState(1, 2, 10, 8192, 8, 4, max_units=4, device=DEVICE)
        self.assertEqual(s.loc_to_slot.dtype, torch.int32)
        self.assertEqual(s.lru_order.dtype, torch.int32)
        s.admit_request(0, 0)
        for u in range(1, 4):
            s.grow_request(0, u, u * 9000)
        # The grown units' slots first, the newest unit's lowest.
        self.assertEqual(s.lru_order[0, 0, 0].item(), 3 * 8192)
        self.assertEqual(s.lru_order[0, 0, -1].item(), 8191)
        self.assertEqual(s.lru_order.shape[-1], 32768)
        # Unit chunks: two requests at four units by default, fewer if asked.
        self.assertEqual(s.num_units, 8)
        # What the pool sizing pays per unit (int32 ids here), the sink too.
        from sglang.srt.mem_cache.nsa_kv_offload_sizing import lru_unit_state_bytes

        per_unit = lru_unit_state_bytes(1, 8192, 4)
        self.assertEqual(per_unit, 8192 * (4 + 4))
        self.assertEqual(s.unit_state_bytes, 9 * per_unit)
        with self.assertRaisesRegex(ValueError, "num_units"):
            LRUCacheState(1, 2, 10, 8, 2, 4, num_units=0, device=DEVICE)

    def test_default_use_triton(self):
        s = LRUCacheState(1, 2, 10, 8, 2, 4, device=DEVICE)
        self.assertEqual(s.use_triton, TRITON_OK)

    def test_hand_example(self):
        # C=4, W=2, K=4, one request at base 100, positions p hold loc 10 + p.
        for use_triton in self._impls():
            s = LRUCacheState(1, 2, 64, 4, 2, 4, device=DEVICE, use_triton=use_triton)
            s.admit_request(1, 100)
            r2t = (torch.arange(32, dtype=torch.int32) + 10).repeat(2, 1).to(DEVICE)
            r2t[0] = 0  # another request's row, must never be read

            def swap(pos, n):
                topk = torch.tensor([pos], device=DEVICE)
                seq = torch.tensor([n], device=DEVICE)
                rpi = torch.tensor([1], device=DEVICE)
                plan = s.swap_layer(0, topk, rpi, seq, r2t)
                c = int(plan.miss_count[0])
                return (
                    plan.page_table[0].tolist(),
                    list(
                        zip(
                            plan.miss_src_loc[0, :c].tolist(),
                            plan.miss_dst_row[0, :c].tolist(),
                        )
                    ),
                    s.lru_order[0, 1].tolist(),
                )

            # n=10: window = positions 8, 9 -> rows 104 + p % 2.
            pt, copies, order = swap([3, 9, -1, 1], 10)
            self.assertEqual(pt, [100, 105, -1, 101])
            self.assertEqual(copies, [(13, 100), (11, 101)])
            self.assertEqual(order, [2, 3, 0, 1])
            # Hit on 1 (slot 1), misses 5, 6 take slots 2, 3; hit 3 (slot 0).
            pt, copies, order = swap([5, 1, 6, 3], 11)
            self.assertEqual(pt, [102, 101, 103, 100])
            self.assertEqual(copies, [(15, 102), (16, 103)])
            # No evictables left untaken: victims (2, 3), then the hits in
            # their old order (0 before 1) as the most recent.
            self.assertEqual(order, [2, 3, 0, 1])
            # One miss (position 7) evicts slot 2 (loc 15), the least recent
            # slot not hit; hit 6 (slot 3) becomes the most recent.
            pt, copies, order = swap([6, 7, 11, 12], 12)
            self.assertEqual(pt, [103, 102, 105, -1])
            self.assertEqual(copies, [(17, 102)])
            self.assertEqual(order, [0, 1, 2, 3])
            self.assertEqual(int(s.loc_to_slot[0, 15]), -1)
            self.assertEqual(int(s.loc_to_slot[0, 13]), 0)
            self.assertEqual(s.counters[0].tolist(), [3, 2, 5])
            s.release_request(1)
            self.assertTrue(bool((s.loc_to_slot == -1).all()))
            # Its unit chunk is given back: it holds no slot.
            self.assertEqual(s.lru_order[0, 1].tolist(), [-1] * 4)
            self.assertEqual(s.free_units(), s.num_units)

    def test_warm_then_hit(self):
        for use_triton in self._impls():
            s = LRUCacheState(2, 3, 100, 8, 2, 4, device=DEVICE, use_triton=use_triton)
            s.admit_request(2, 50)
            rows = s.warm_request(range(2), 2, torch.tensor([40, -1, 41, 42]))
            self.assertEqual(rows.tolist(), [[50, -1, 51, 52]] * 2)
            self.assertEqual(s.lru_order[0, 2].tolist(), [3, 4, 5, 6, 7, 0, 1, 2])
            # Re-warming a resident loc is a hit: it becomes the most recent.
            rows = s.warm_request(1, 2, torch.tensor([41, 43]))
            self.assertEqual(rows.tolist(), [[51, 53]])
            self.assertEqual(s.lru_order[1, 2].tolist(), [4, 5, 6, 7, 0, 2, 3, 1])
            r2t = torch.zeros((3, 16), dtype=torch.int32, device=DEVICE)
            r2t[2, :4] = torch.tensor([40, 41, 42, 43])
            plan = s.swap_layer(
                1,
                torch.tensor([[0, 1, 2, 3]], device=DEVICE),
                torch.tensor([2], device=DEVICE),
                torch.tensor([10], device=DEVICE),
                r2t,
            )
            self.assertEqual(plan.page_table.tolist(), [[50, 51, 52, 53]])
            self.assertEqual(plan.miss_count.tolist(), [0])
            self.assertEqual(s.counters[1].tolist(), [4, 0, 0])
            check_invariants(self, s)

    def test_padding_rows_are_noops(self):
        # Stale padding rows point at a live request with positions it holds.
        for use_triton in self._impls():
            cfg = SimConfig(layers=1, C=8, K=4, W=2, max_reqs=2, num_locs=64)
            s = new_state(cfg, use_triton)
            s.admit_request(0, 0)
            r2t = torch.arange(2 * 32, dtype=torch.int32, device=DEVICE).view(2, 32)
            topk = torch.tensor(
                [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]], device=DEVICE
            )
            # Row 2: a garbage pool index must not be dereferenced either.
            rpi = torch.tensor([0, 0, 1 << 20], device=DEVICE)
            seq = torch.tensor([20, 20, 1], device=DEVICE)
            num_real = torch.tensor([1], dtype=torch.int32, device=DEVICE)
            plan = s.swap_layer(0, topk, rpi, seq, r2t, num_real)
            self.assertEqual(plan.page_table[1:].tolist(), [[-1] * 4] * 2)
            self.assertEqual(plan.miss_count.tolist(), [4, 0, 0])
            self.assertEqual(sorted(s.slot_loc[0, 0].tolist()), [-1] * 4 + [0, 1, 2, 3])
            num_real.zero_()
            before = [t.clone() for t in (s.loc_to_slot, s.slot_loc, s.lru_order)]
            plan = s.swap_layer(0, topk, rpi, seq, r2t, num_real)
            self.assertEqual(plan.page_table.tolist(), [[-1] * 4] * 3)
            self.assertEqual(plan.miss_count.tolist(), [0, 0, 0])
            for a, b in zip(before, (s.loc_to_slot, s.slot_loc, s.lru_order)):
                self.assertTrue(torch.equal(a, b))
            self.assertEqual(s.counters[0].tolist(), [0, 0, 4])

    def test_reference_steps_compose_to_swap_layer(self):
        # The three public reference steps compose to swap_layer.
        cfg = SimConfig(layers=1, C=8, K=4, W=2, max_reqs=2, num_locs=64)
        a, b = new_state(cfg, False), new_state(cfg, False)
        for s in (a, b):
            s.admit_request([0, 1], [0, 10])
        r2t = torch.arange(64, dtype=torch.int32, device=DEVICE).view(2, 32)
        args = (
            torch.tensor([[0, 3, 19, 5], [1, 2, -1, 7]], device=DEVICE),
            torch.tensor([1, 0], device=DEVICE),
            torch.tensor([20, 9], device=DEVICE),
            r2t,
        )
        work = lru_reference.prepare_layer_swap(a, 0, *args)
        pt = lru_reference.build_gpu_page_table(a, work)
        plan_a = lru_reference.post_process_layer_swap(a, work, pt)
        plan_b = b.swap_layer(0, *args)
        self.assertEqual(plan_rows(plan_a, 2), plan_rows(plan_b, 2))
        assert_states_equal(self, a, b)

    def test_map_new_tokens(self):
        # Each decode step's new token goes to its request's window ring row:
        # region_base + C + (seq_len - 1) % W, written at loc_to_row[loc]; the
        # other entries stay. 300 rows: more than one Triton block.
        C, W, reqs, n = 8, 3, 400, 300
        gen = torch.Generator().manual_seed(0)
        bases = torch.randperm(reqs, generator=gen)[:reqs] * (C + W) + 5
        idx = torch.randperm(reqs, generator=gen)[:n].to(DEVICE)
        seq = torch.randint(1, 50, (n,), generator=gen).to(DEVICE)
        locs = (torch.randperm(1000, generator=gen)[:n] + 1).to(DEVICE)
        expect = torch.full((1001,), -7, dtype=torch.int64, device=DEVICE)
        expect[locs] = bases.to(DEVICE)[idx] + C + (seq - 1) % W
        for use_triton in self._impls():
            s = LRUCacheState(
                1, reqs, 64, C, W, 4, device=DEVICE, use_triton=use_triton
            )
            s.admit_request(list(range(reqs)), bases.tolist())
            loc_to_row = torch.full((1001,), -7, dtype=torch.int64, device=DEVICE)
            s.map_new_tokens(idx, seq, locs, loc_to_row)
            self.assertTrue(torch.equal(loc_to_row, expect), f"triton={use_triton}")
            self.assertTrue(torch.equal(s.window_rows(idx, seq), expect[locs]))
            s.map_new_tokens(idx[:0], seq[:0], locs[:0], loc_to_row)  # empty batch
            self.assertTrue(torch.equal(loc_to_row, expect))


@unittest.skipUnless(TRITON_OK, TRITON_SKIP_REASON)
class TestTritonMatchesReference(unittest.TestCase):
    """Reference, Triton and the model in lockstep over seeded workloads.

    Small buffers (8 to 20 slots a unit) and one layer unless the layer index
    matters: under the CPU interpreter a kernel launch costs the same at any
    size, and small buffers fill within a few steps, so every run evicts
    (each asserts it did: the eviction path is what these hold to the
    model). benchmark/nsa_offload/engine/gpu_check_lru.py runs the same
    check at production sizes on a GPU."""

    def _run(self, cfg, steps, seed, impls=(False, True), after_step=None):
        sim = run_sim(self, cfg, impls, steps, seed, after_step)
        self.assertGreater(sim.model.evictions, 0, "no eviction: a weak workload")
        return sim

    def test_pow2_two_layers(self):
        cfg = SimConfig(
            layers=2, C=16, K=8, W=4, max_batch=3, p_keep=0.2, p_recent=0.5,
            p_release=0.05,
        )  # fmt: skip
        self._run(cfg, steps=12, seed=1)

    def test_non_pow2_c_and_odd_k(self):
        cfg = SimConfig(
            layers=2, C=20, K=11, W=6, max_batch=3, p_keep=0.3, p_recent=0.3
        )
        self._run(cfg, steps=12, seed=2)

    def test_c_equals_k_full_pressure(self):
        cfg = SimConfig(
            layers=1, C=12, K=12, W=5, max_batch=3, p_keep=0.3, p_recent=0.3
        )
        self._run(cfg, steps=12, seed=4)

    def test_heavy_churn_and_padding(self):
        cfg = SimConfig(
            layers=1,
            C=8,
            K=8,
            W=7,
            max_reqs=5,
            num_locs=700,
            max_batch=5,
            p_keep=0.2,
            p_admit=0.6,
            p_release=0.4,
            max_pad_rows=3,
        )
        self._run(cfg, steps=12, seed=5)

    def test_units_grow_and_shrink(self):
        # Requests gain and lose units between steps; the window stays in unit 0.
        cfg = SimConfig(
            layers=1, C=8, K=8, W=5, units=3, max_batch=3, p_keep=0.3,
            p_release=0.05,
        )  # fmt: skip
        self._run(cfg, steps=14, seed=6)

    def test_units_non_pow2_full_pressure(self):
        cfg = SimConfig(
            layers=1, C=10, K=10, W=4, units=4, max_batch=2, p_keep=0.3,
            p_recent=0.3, p_release=0.05,
        )  # fmt: skip
        self._run(cfg, steps=12, seed=7)

    def test_units_deferred_reorder_multi_block_scan(self):
        # The select kernel finds victims a block at a time (8 positions of
        # up to 24 held: most swaps scan several); the reorder runs after the
        # plan is read.
        cfg = SimConfig(
            layers=1, C=8, K=8, W=5, units=3, max_batch=3, p_keep=0.4,
            p_release=0.05,
        )  # fmt: skip
        self._run(cfg, steps=14, seed=6, impls=(False, "deferred"))

    def test_many_units_reuse_scattered_chunks(self):
        # Up to 9 small units per request with churn: a request's chunks of
        # LRU state come back out of order and interleaved with others'.
        cfg = SimConfig(
            layers=1, C=8, K=8, W=3, units=9, max_reqs=5, max_batch=3,
            max_prompt=60, p_grow=0.6, p_shrink=0.2, p_release=0.2, p_keep=0.2,
        )  # fmt: skip
        seen = {"most_units": 0, "scattered_steps": 0}

        def after_step(sim):
            chunks = list(sim.states[0]._req_chunks.values())
            seen["most_units"] = max([seen["most_units"]] + [len(c) for c in chunks])
            seen["scattered_steps"] += any(c != sorted(c) for c in chunks)

        self._run(cfg, 16, 23, impls=(False, "deferred"), after_step=after_step)
        self.assertGreaterEqual(seen["most_units"], 5, seen)
        self.assertGreater(seen["scattered_steps"], 5, seen)


@unittest.skipUnless(TRITON_OK, TRITON_SKIP_REASON)
class TestSwapScratch(unittest.TestCase):
    def test_scratch_bytes_bound_the_allocation(self):
        # The pool sizing counts TritonLRUSwap.scratch_bytes: what the
        # backend allocates, exactly with units, at most without.
        for units, q, exact in ((1, 1, False), (3, 1, True), (1, 2, False)):
            cfg = SimConfig(C=64, K=16, W=4, units=units)
            state = new_state(cfg, True, max_query_tokens=q, max_batch_size=5)
            tri = state.swap_backend
            got = sum(t.numel() * t.element_size() for t in tri._scratch)
            bound = TritonLRUSwap.scratch_bytes(
                5, cfg.K, cfg.C, units, state.slot_dtype.itemsize, q
            )
            with self.subTest(units=units, q=q):
                self.assertLessEqual(got, bound)
                if exact:
                    self.assertEqual(got, bound)


class TestWideSlotIds(unittest.TestCase):
    """int32 slot ids (units x buffer above 32767) through every swap path:
    the small shapes here forced to int32, against the model."""

    def _run(self, impls, seed, steps):
        cfg = SimConfig(
            layers=1, C=8, K=8, W=5, units=3, max_batch=3, p_keep=0.3,
            p_release=0.05,
        )  # fmt: skip
        int32 = mock.patch.object(lru_mod, "lru_slot_dtype", lambda n: torch.int32)
        with int32:
            sim = run_sim(self, cfg, impls, steps=steps, seed=seed)
        self.assertGreater(sim.model.evictions, 0)
        for state in sim.states:
            self.assertEqual(state.loc_to_slot.dtype, torch.int32)
            self.assertEqual(state.lru_order.dtype, torch.int32)

    def test_reference(self):
        self._run((False,), seed=9, steps=30)

    @unittest.skipUnless(TRITON_OK, "Triton unavailable")
    def test_kernels(self):
        self._run((True, "deferred", False), seed=6, steps=10)

    def test_slot_ids_above_int16(self):
        # 5 units of 8192 LRU slots: ids up to 40959. 9 steps of fresh
        # positions fill 36864 of them; reading positions held in slots above
        # 32767 again must hit in every engine (an id cut to int16 would read
        # as not resident) with the same rows.
        C, K, W, U = 8192, 4096, 8, 5
        n = 9 * K + W + 1
        impls = (False, True) if TRITON_OK else (False,)
        states = [
            LRUCacheState(
                num_layers=1,
                max_num_reqs=1,
                num_locs=n + 1,
                buffer_size=C,
                recent_window=W,
                top_k=K,
                max_units=U,
                device=DEVICE,
                use_triton=use_triton,
            )
            for use_triton in impls
        ]
        r2t = torch.arange(n, dtype=torch.int32, device=DEVICE).view(1, -1)
        one = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        seq = torch.full((1,), n, dtype=torch.int64, device=DEVICE)
        plans = []
        for state in states:
            self.assertEqual(state.loc_to_slot.dtype, torch.int32)
            state.admit_request(0, 0)
            for u in range(1, U):
                state.grow_request(0, u, C + W + (u - 1) * C)
            misses = []
            for step in list(range(9)) + [1]:
                topk = torch.arange(step * K, (step + 1) * K, device=DEVICE)
                before = int(state.counters[0, 2])
                plan = state.swap_layer(0, topk.view(1, -1), one, seq, r2t)
                misses.append(int(state.counters[0, 2]) - before)
            # Every fresh step misses all K; the re-read of step 1, none: its
            # positions sit in slots above 32767 (the units grown last are
            # filled first).
            self.assertEqual(misses, [K] * 9 + [0])
            self.assertGreater(int(state.loc_to_slot[0, K : 2 * K].min()), 32767)
            plans.append(plan_rows(plan, 1))
        for other in plans[1:]:
            self.assertEqual(other, plans[0])


class TestDirectSlots(unittest.TestCase):
    """Direct mode: a request whose context fits its slots keeps position p
    in slot p and swaps without the LRU walk, until it outgrows them."""

    def _impls(self):
        return [False, True, "deferred"] if TRITON_OK else [False]

    def _swap(self, state, positions, seq_len, r2t):
        return swap_request_0(state, positions, seq_len, r2t)

    def test_hand_example(self):
        cfg = SimConfig(layers=1, C=8, K=4, W=2, max_reqs=2, num_locs=64, direct=True)
        r2t = (10 + torch.arange(32, dtype=torch.int32, device=DEVICE)).repeat(2, 1)
        for impl in self._impls():
            with self.subTest(impl=impl):
                state = impl_state(cfg, impl)
                state.admit_request(0, 100)
                # A 6-token prompt: its first step (length 7) reads positions
                # 5, 6 from the window, 0..4 through the slots.
                state.warm_request(0, 0, r2t[0, :5].long())
                state.enter_direct(0, 5)
                order = state.lru_order[0, 0].tolist()
                plan = self._swap(state, [0, 4, 6, -1], 7, r2t)
                self.assertEqual(plan.page_table[0].tolist(), [100, 104, 108 + 0, -1])
                self.assertEqual(int(plan.miss_count[0]), 0)
                # Position 5 left the window: a miss into slot 5.
                plan = self._swap(state, [5, 1, 7, 6], 8, r2t)
                self.assertEqual(plan.page_table[0].tolist(), [105, 101, 109, 108])
                self.assertEqual(int(plan.miss_count[0]), 1)
                self.assertEqual(plan.miss_src_loc[0, 0].item(), 15)
                self.assertEqual(plan.miss_dst_row[0, 0].item(), 105)
                self.assertEqual(state.lru_order[0, 0].tolist(), order)
                self.assertEqual(state.direct[0].item(), 1)
                # Length 11: positions 0..8 below the window, 9 > 8 slots:
                # direct mode ends, the LRU swap goes on from the order left.
                plan = self._swap(state, [8, 0, 2, 10], 11, r2t)
                self.assertEqual(state.direct[0].item(), 0)
                self.assertEqual(int(plan.miss_count[0]), 1)
                # The order's first evictable slot is 5 (warm-up put 5..7
                # first): position 5's loc is evicted for position 8's.
                self.assertEqual(plan.miss_dst_row[0, 0].item(), 105)
                self.assertEqual(state.loc_to_slot[0, 15].item(), -1)
                self.assertNotEqual(state.lru_order[0, 0].tolist(), order)
                # Even a context that fits again stays on the LRU swap.
                self._swap(state, [0, -1, -1, -1], 11, r2t)
                self.assertEqual(state.direct[0].item(), 0)
                state.release_request(0)
                self.assertEqual(state.direct[0].item(), 0)

    def test_validation(self):
        cfg = SimConfig(layers=1, C=8, K=4, W=4, max_reqs=2, num_locs=64)
        with self.assertRaisesRegex(ValueError, "direct_slots"):
            new_state(cfg, False).enter_direct(0, 1)
        with self.assertRaisesRegex(ValueError, "max_query_tokens"):
            new_state(cfg, False, direct_slots=True, max_query_tokens=2)
        state = new_state(cfg, False, direct_slots=True)
        with self.assertRaisesRegex(ValueError, "exceed"):
            state.enter_direct(0, 9)

    def test_against_model(self):
        # Short prompts (most fit), long decodes (most outgrow their slots).
        impls = (False, True) if TRITON_OK else (False,)
        cfg = SimConfig(
            layers=1, C=8, K=4, W=4, max_prompt=10, direct=True, p_admit=0.6,
            p_release=0.1, max_batch=3,
        )  # fmt: skip
        sim = run_sim(self, cfg, impls, steps=16, seed=1)
        self.assertGreater(sim.direct_entered, 5)
        self.assertGreater(sim.model.direct_ended, 1)

    @unittest.skipUnless(TRITON_OK, TRITON_SKIP_REASON)
    def test_units_kernels(self):
        # Direct mode with units, the kernels with the deferred reorder and
        # the multi-block victim scan (the plain launch: test_against_model).
        cfg = SimConfig(
            layers=1, C=8, K=4, W=4, units=3, max_prompt=10, direct=True,
            p_keep=0.6, max_batch=3, p_release=0.1,
        )  # fmt: skip
        sim = run_sim(self, cfg, ("deferred", False), steps=16, seed=14)
        self.assertGreater(sim.direct_entered, 3)
        self.assertGreater(sim.model.direct_ended, 1)

    @staticmethod
    def _three_units(impl):
        """Request 0 admitted at row 100, then units at 200 and 300, of 8
        slots (direct slots; W = 4, K = 4, 2 layers)."""
        cfg = SimConfig(layers=2, C=8, K=4, W=4, max_reqs=2, units=3, direct=True)
        state = impl_state(cfg, impl)
        state.admit_request(0, 100)
        state.grow_request(0, 1, 200)
        state.grow_request(0, 2, 300)
        return state

    def test_warm_direct_across_units(self):
        # A 21-token prompt on units of 8 slots, warmed after two more units
        # were granted: positions 0..17 (below the first window) in slots
        # 0..17 of the region, unit 1 and unit 2.
        r2t = (10 + torch.arange(40, dtype=torch.int32, device=DEVICE)).repeat(2, 1)
        for impl in self._impls():
            with self.subTest(impl=impl):
                state = self._three_units(impl)
                rows = state.warm_direct(range(2), 0, r2t[0, :18].long())
                # Slot order, for a hand-over to the LRU swap (the units'
                # grants had put unit 2's slots first).
                order = [list(range(24))] * 2
                self.assertEqual(state.lru_order[:, 0].tolist(), order)
                expect = [100 + p for p in range(8)] + [200 + p for p in range(8)]
                expect += [300, 301]
                self.assertEqual(rows.tolist(), [expect, expect])
                self.assertEqual(state.direct[0].item(), 1)
                self.assertEqual(
                    state.slot_loc[1, 0, :18].tolist(), list(range(10, 28))
                )
                self.assertEqual(state.loc_to_slot[0, 27].item(), 17)
                # Length 22: positions 0..17 through the slots, 18..21 the
                # window; no miss, the order untouched.
                plan = self._swap(state, [17, 3, 21, 9], 22, r2t)
                self.assertEqual(plan.page_table[0].tolist(), [301, 103, 109, 201])
                self.assertEqual(int(plan.miss_count[0]), 0)
                # Length 23: position 18 left the window, a miss into slot 18.
                plan = self._swap(state, [18, 0, -1, -1], 23, r2t)
                self.assertEqual(plan.page_table[0].tolist(), [302, 100, -1, -1])
                self.assertEqual(int(plan.miss_count[0]), 1)
                self.assertEqual(plan.miss_src_loc[0, 0].item(), 28)
                self.assertEqual(plan.miss_dst_row[0, 0].item(), 302)
                self.assertEqual(state.lru_order[:, 0].tolist(), order)
                # The last unit taken back: 19 positions below the window no
                # longer fit 16 slots, direct mode ends at the next swap.
                state.shrink_request(0, 2)
                self._swap(state, [0, 1, -1, -1], 23, r2t)
                self.assertEqual(state.direct[0].item(), 0)
                state.release_request(0)
                # More positions than the slots the request holds.
                state.admit_request(0, 100)
                for known in (None, 8):  # read from the GPU, or given
                    with self.assertRaisesRegex(ValueError, "exceed the 8 slots"):
                        state.warm_direct(0, 0, r2t[0, :9].long(), num_slots=known)
                self.assertEqual(state.direct[0].item(), 0)

    def test_warm_direct_across_units_against_model(self):
        # Prompts up to 3 units long, some warmed whole across the units they
        # were granted (warm units with direct slots); shrinks end it.
        impls = (False, True) if TRITON_OK else (False,)
        cfg = SimConfig(
            layers=1, C=8, K=4, W=4, units=3, max_prompt=24, direct=True,
            p_direct=0.7, max_batch=3, p_admit=0.5,
        )  # fmt: skip
        sim = run_sim(self, cfg, impls, steps=16, seed=8)
        self.assertGreater(sim.direct_units_entered, 2)
        self.assertGreater(sim.model.direct_ended, 0)


class TestUnits(unittest.TestCase):
    """What growing and shrinking a request's LRU capacity means."""

    def _impls(self):
        return [False, True] if TRITON_OK else [False]

    def _state(self, use_triton):
        cfg = SimConfig(layers=1, C=8, K=4, W=2, max_reqs=2, num_locs=64, units=3)
        return new_state(cfg, use_triton)

    def _swap(self, state, positions, seq_len, r2t):
        return swap_request_0(state, positions, seq_len, r2t)

    def test_grown_slots_fill_before_eviction(self):
        r2t = torch.arange(64, dtype=torch.int32, device=DEVICE).reshape(1, 64)
        r2t = torch.cat([r2t, r2t])
        for use_triton in self._impls():
            state = self._state(use_triton)
            state.admit_request(0, 100)
            # Fill unit 0's 8 slots with locs 0..7 (window: positions 38, 39).
            for first in (0, 4):
                self._swap(state, list(range(first, first + 4)), 40, r2t)
            state.grow_request(0, 1, 500)
            plan = self._swap(state, [8, 9, 10, 11], 40, r2t)
            # The misses land in the new unit; nothing resident was evicted.
            self.assertEqual(plan.miss_dst_row[0].tolist(), [500, 501, 502, 503])
            self.assertEqual(int((state.loc_to_slot[0, :8] >= 0).sum()), 8)
            plan = self._swap(state, [0, 9, 38, 39], 40, r2t)
            self.assertEqual(int(plan.miss_count[0]), 0)
            # Window rows stay in unit 0's region: base + C + pos % W.
            self.assertEqual(plan.page_table[0, 2:].tolist(), [108, 109])

            state.shrink_request(0, 1)
            # Locs 8..11 lived in unit 1: no longer resident, loaded again
            # into unit 0 (whose LRU slots take them), never into row 500+.
            self.assertEqual(int((state.loc_to_slot[0, 8:12] >= 0).sum()), 0)
            plan = self._swap(state, [8, 9, 10, 11], 40, r2t)
            self.assertEqual(int(plan.miss_count[0]), 4)
            dst = plan.miss_dst_row[0].tolist()
            self.assertTrue(all(100 <= d < 108 for d in dst), dst)
            self.assertEqual(int(state.capacity[0]), 8)

    def test_release_clears_units(self):
        for use_triton in self._impls():
            state = self._state(use_triton)
            state.admit_request(0, 100)
            state.grow_request(0, 1, 500)
            state.grow_request(0, 2, 600)
            self.assertEqual(state.unit_base[0].tolist(), [100, 500, 600])
            self.assertEqual(int(state.capacity[0]), 24)
            state.release_request(0)
            self.assertEqual(state.unit_base[0].tolist(), [-1, -1, -1])
            self.assertEqual(int(state.capacity[0]), 0)
            with self.assertRaises(ValueError):
                state.grow_request(0, 3, 700)


def sim_configs(max_steps: int, max_k=40, max_layers=3, max_batch=5):
    @st.composite
    def build(draw):
        K = draw(st.integers(4, max_k))
        C = draw(st.integers(K, K + max_k))
        W = draw(st.integers(1, min(12, C - 1)))
        cfg = SimConfig(
            layers=draw(st.integers(1, max_layers)),
            C=C,
            K=K,
            W=W,
            max_reqs=draw(st.integers(2, 6)),
            num_locs=draw(st.integers(800, 1600)),
            max_ctx=draw(st.integers(60, 400)),
            max_batch=draw(st.integers(1, max_batch)),
            max_prompt=draw(st.integers(1, 200)),
            p_keep=draw(st.floats(0.0, 1.0)),
            p_recent=draw(st.floats(0.0, 1.0)),
            p_admit=draw(st.floats(0.05, 0.7)),
            p_release=draw(st.floats(0.0, 0.4)),
            p_warm=draw(st.floats(0.0, 1.0)),
            max_pad_rows=draw(st.integers(0, 2)),
            units=draw(st.integers(1, 3)),
            direct=draw(st.booleans()),
        )
        return cfg, draw(st.integers(10, max_steps)), draw(st.integers(0, 2**31))

    return build()


class TestAgainstPythonModel(unittest.TestCase):
    """Property-based differential test against lru_model.LRUModel.

    Hypothesis draws the workload (sizes, locality, churn, seed); every decode
    step of it is compared against the model, outputs and full state. The
    Triton kernels get fewer, smaller workloads (under the CPU interpreter a
    swap costs ~0.1 s): the seeded tests above cover their code paths.
    """

    REF_EXAMPLES, TRITON_EXAMPLES = 50, 6
    stats = {
        impl: {"examples": 0, "steps": 0, "evictions": 0, "misses": 0}
        for impl in ("reference", "triton")
    }

    def _run(self, impl, args):
        cfg, steps, seed = args
        sim = run_sim(self, cfg, (impl == "triton",), steps, seed)
        stats = self.stats[impl]
        stats["examples"] += 1
        stats["steps"] += sim.steps
        stats["evictions"] += sim.model.evictions
        stats["misses"] += sum(c[2] for c in sim.model.counters)

    @settings(
        max_examples=REF_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(sim_configs(max_steps=40))
    def test_reference_vs_model(self, args):
        self._run("reference", args)

    @unittest.skipUnless(TRITON_OK, TRITON_SKIP_REASON)
    @settings(
        max_examples=TRITON_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(sim_configs(max_steps=12, max_k=16, max_layers=2, max_batch=3))
    def test_triton_vs_model(self, args):
        self._run("triton", args)

    @classmethod
    def tearDownClass(cls):
        print(f"\nLRU differential test workload: {cls.stats}")
        ref = cls.stats["reference"]
        if ref["examples"] == cls.REF_EXAMPLES:
            # The workload must stay meaningful if the generator is edited
            # (its examples vary a little between processes).
            assert ref["steps"] >= 1000, ref
            assert ref["evictions"] >= 300, ref
            assert ref["misses"] >= 3000, ref
        tri = cls.stats["triton"]
        if tri["examples"] == cls.TRITON_EXAMPLES:
            assert tri["evictions"] > 0, tri


@unittest.skipUnless(torch.cuda.is_available(), "needs CUDA")
class TestCudaGraph(unittest.TestCase):
    def test_capture_replay_matches_eager(self):
        self._run(SimConfig(layers=2, C=96, K=48, W=6, max_reqs=6, num_locs=4000))

    def test_units_change_between_replays(self):
        # Units granted and taken back between replays of one captured graph
        # (the graph reads unit_base / capacity from their fixed buffers).
        cfg = SimConfig(layers=2, C=96, K=48, W=6, max_reqs=6, num_locs=4000, units=3)
        changes = {
            3: ("grow", 0, 1, 1000),
            5: ("grow", 1, 1, 1100),
            8: ("shrink", 0, 1),
            11: ("grow", 0, 1, 1200),
            13: ("grow", 0, 2, 1300),
            16: ("shrink", 1, 1),
        }
        self._run(cfg, changes)

    def _run(self, cfg, changes=None):
        changes = changes or {}
        for use_triton in (True, False):
            eager, graphed = new_state(cfg, use_triton), new_state(cfg, use_triton)
            bs = 4
            for s in (eager, graphed):
                s.admit_request(list(range(bs)), [i * 200 for i in range(bs)])
            r2t = torch.randperm(4000, device="cuda")[: 6 * 600].view(6, 600).int()
            topk = torch.zeros((bs, cfg.K), dtype=torch.int64, device="cuda")
            rpi = torch.arange(bs, device="cuda")
            seq = torch.full((bs,), 300, device="cuda")
            num_real = torch.tensor([bs], dtype=torch.int32, device="cuda")
            out = [
                LayerSwapPlan(
                    torch.empty((bs, cfg.K), dtype=torch.int32, device="cuda"),
                    torch.empty((bs, cfg.K), dtype=torch.int64, device="cuda"),
                    torch.empty((bs, cfg.K), dtype=torch.int32, device="cuda"),
                    torch.empty((bs,), dtype=torch.int32, device="cuda"),
                )
                for _ in range(cfg.layers)
            ]
            scratch = new_state(cfg, use_triton)  # warm-up target (JIT compile)
            scratch.admit_request(list(range(bs)), [0] * bs)
            for layer in range(cfg.layers):
                scratch.swap_layer(layer, topk, rpi, seq, r2t, num_real, out=out[layer])
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for layer in range(cfg.layers):
                    graphed.swap_layer(
                        layer, topk, rpi, seq, r2t, num_real, out=out[layer]
                    )
            gen = torch.Generator(device="cuda").manual_seed(0)
            for step in range(20):
                if step in changes:
                    op, r, unit, *base = changes[step]
                    for s in (eager, graphed):
                        if op == "grow":
                            s.grow_request(r, unit, base[0])
                        else:
                            s.shrink_request(r, unit)
                seq += 1
                scores = torch.rand((bs, 600), device="cuda", generator=gen)
                scores[:, seq[0] :] = -1
                topk.copy_(scores.topk(cfg.K, dim=1).indices)
                num_real.fill_(bs - step % 2)
                g.replay()
                for layer in range(cfg.layers):
                    ref = eager.swap_layer(layer, topk, rpi, seq, r2t, num_real)
                    self.assertEqual(plan_rows(ref, bs), plan_rows(out[layer], bs))
                assert_states_equal(self, eager, graphed)


if __name__ == "__main__":
    unittest.main()
