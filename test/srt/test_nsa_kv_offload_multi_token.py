"""The multi-token LRU swap (MTP target verify, docs/MTP.md).

Each request has ``q`` query tokens per swap, each with its own top-k. The
torch reference and the Triton kernels (fused and split; under
TRITON_INTERPRET=1 on a CPU machine) run in lockstep with the plain-Python
model (``lru_model.LRUModel.swap_multi``) over verify steps: drafts written
into the window, a random accept length, rejected drafts' locs reused for the
next step's drafts or freed for other requests. Page tables are compared row
for row (one per query token), copy lists per request (each missing loc once),
the whole LRU state after every step. ``TestVerifyExactness`` runs the same
protocol through ``SparseCacheController`` with real KV bytes: every row a page
table names holds the KV of the token the query token picked, never a rejected
draft's.
"""

import os
import random
import unittest
from dataclasses import dataclass
from typing import List

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lru_model import LRUModel
from sglang.srt.mem_cache import lru_cache_state as lru_mod
from sglang.srt.mem_cache.lru_cache_state import LayerSwapPlan, LRUCacheState
from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import TritonLRUSwap
from sglang.srt.mem_cache.nsa_kv_only_host_pool import NSAKVOnlyTokenToKVPoolHost
from sglang.srt.mem_cache.sparse_cache_controller import SparseCacheController
from test_lru_cache_state import (
    Sim,
    SimConfig,
    assert_state_matches_model,
    assert_states_equal,
    check_invariants,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = DEVICE == "cuda" or lru_mod._swap_kernel_is_interpreted()
TRITON_SKIP = "Triton kernels neither on CUDA nor interpreted (TRITON_INTERPRET=1)"
ROW_BYTES = 656


@dataclass
class VerifyConfig:
    layers: int = 2
    K: int = 12
    q_max: int = 3  # max_query_tokens (num_draft_tokens)
    C: int = 48  # >= q_max x K
    W: int = 6  # >= 2 x q_max - 1
    units: int = 1
    max_reqs: int = 5
    num_locs: int = 1500
    max_ctx: int = 300
    max_batch: int = 4
    max_prompt: int = 120
    p_keep: float = 0.6  # a pick of the same layer's previous step kept
    p_share: float = 0.7  # a pick of the previous query token kept
    p_recent: float = 0.7
    p_admit: float = 0.3
    p_release: float = 0.1
    p_warm: float = 0.5
    p_reuse: float = 0.5  # rejected drafts' locs carry the next drafts
    p_full_accept: float = 0.25
    vary_q: bool = True  # q drawn per step in [1, q_max]
    max_pad_rows: int = 2
    p_grow: float = 0.3
    p_shrink: float = 0.15


def new_state(cfg: VerifyConfig, impl: str) -> LRUCacheState:
    """``impl``: "reference", "triton" (default kernels), "fused" or "split"
    (the multi-token Triton swap forced to one program / split kernels)."""
    state = LRUCacheState(
        num_layers=cfg.layers,
        max_num_reqs=cfg.max_reqs,
        num_locs=cfg.num_locs,
        buffer_size=cfg.C,
        recent_window=cfg.W,
        top_k=cfg.K,
        device=DEVICE,
        use_triton=impl != "reference",
        max_units=cfg.units,
        max_query_tokens=cfg.q_max,
    )
    if impl in ("fused", "split"):
        state.swap_backend = TritonLRUSwap(
            state,
            max_batch_size=state.swap_backend._scratch_rows,
            multi_split=impl == "split",
        )
    return state


def plan_rows(plan: LayerSwapPlan, bs: int):
    """(page-table rows, copies per request) as the model returns them."""
    cnt = plan.miss_count.cpu().tolist()
    src = plan.miss_src_loc.cpu().tolist()
    dst = plan.miss_dst_row.cpu().tolist()
    copies = [list(zip(src[b][: cnt[b]], dst[b][: cnt[b]])) for b in range(bs)]
    return plan.page_table.cpu().tolist(), copies


class VerifySim:
    """Random MTP decode: each step appends ``q`` draft tokens per request,
    swaps every layer with ``q`` query tokens, then accepts 1..q of them."""

    def __init__(self, test, cfg: VerifyConfig, states, model: LRUModel, seed: int):
        self.test, self.cfg, self.states, self.model = test, cfg, states, model
        self.rng = random.Random(seed)
        self.free_locs = list(range(cfg.num_locs))
        self.rng.shuffle(self.free_locs)
        self.free_reqs = list(range(cfg.max_reqs))
        self.free_regions = list(range(cfg.max_reqs))
        self.region_size = cfg.C + cfg.W
        units_start = 3 + cfg.max_reqs * self.region_size
        self.free_units = [
            units_start + i * cfg.C for i in range(cfg.max_reqs * (cfg.units - 1))
        ]
        self.req_to_token = torch.zeros((cfg.max_reqs, cfg.max_ctx), dtype=torch.int32)
        # r -> committed locs, locs kept for the next drafts, picks, units.
        self.reqs = {}
        self.steps = 0
        self.stats = {"rejected": 0, "reused": 0, "dup_entries": 0, "copies": 0}

    # -- lifecycle (as test_lru_cache_state.Sim)

    def admit(self) -> None:
        cfg, rng = self.cfg, self.rng
        if not self.free_reqs or len(self.reqs) >= cfg.max_batch:
            return
        n = rng.randint(1, min(cfg.max_prompt, cfg.max_ctx - cfg.q_max - 1))
        if len(self.free_locs) < n + 64:
            return
        r = self.free_reqs.pop(rng.randrange(len(self.free_reqs)))
        region = self.free_regions.pop(rng.randrange(len(self.free_regions)))
        locs = [self.free_locs.pop() for _ in range(n)]
        self.req_to_token[r, :n] = torch.tensor(locs, dtype=torch.int32)
        self.reqs[r] = dict(locs=locs, kept=[], prev={}, units=[], region=region)
        base = 3 + region * self.region_size
        for state in self.states:
            state.admit_request(r, base)
        self.model.admit(r, base)
        older = locs[: max(0, n - cfg.W)]
        if older and rng.random() < cfg.p_warm:
            chosen = older[-rng.randint(1, min(len(older), cfg.C)) :]
            expect = self.model.warm(range(cfg.layers), r, [chosen] * cfg.layers)
            for state in self.states:
                rows = state.warm_request(range(cfg.layers), r, torch.tensor(chosen))
                self.test.assertEqual(rows.cpu().tolist(), expect)

    def release(self, r: int) -> None:
        req = self.reqs.pop(r)
        self.free_locs.extend(req["locs"] + req["kept"])
        self.free_regions.append(req["region"])
        self.free_units.extend(req["units"])
        self.free_reqs.append(r)
        self.model.release(r)
        for state in self.states:
            state.release_request(r)

    def grow_or_shrink(self) -> None:
        cfg, rng = self.cfg, self.rng
        for r in sorted(self.reqs):
            units = self.reqs[r]["units"]
            if units and rng.random() < cfg.p_shrink:
                self.free_units.append(units.pop())
                for state in self.states:
                    state.shrink_request(r, len(units) + 1)
                self.model.shrink(r)
            elif len(units) + 1 < cfg.units and self.free_units:
                if rng.random() < cfg.p_grow:
                    base = self.free_units.pop()
                    units.append(base)
                    for state in self.states:
                        state.grow_request(r, len(units), base)
                    self.model.grow(r, base)

    # -- one verify step

    def pick(self, r: int, layer: int, n: int, q: int) -> List[List[int]]:
        """Top-k positions of the ``q`` query tokens (length ``n`` with them):
        each keeps much of the previous query token's picks (the previous
        step's for the first one), the newest positions it sees and random
        others; plus padding and positions it must not see (later drafts)."""
        cfg, rng = self.cfg, self.rng
        req = self.reqs[r]
        rows, last = [], None
        for j in range(q):
            kv_len = n - q + j + 1
            chosen, seen = [], set()

            def add(p):
                if p not in seen and len(chosen) < cfg.K:
                    seen.add(p)
                    chosen.append(p)

            keep = cfg.p_keep if last is None else cfg.p_share
            for p in req["prev"].get(layer, []) if last is None else last:
                if 0 <= p < kv_len and rng.random() < keep:
                    add(p)
            for p in range(kv_len - 1, max(-1, kv_len - cfg.W - 4), -1):
                if rng.random() < cfg.p_recent:
                    add(p)
            want = rng.randint(len(chosen), cfg.K)
            for p in rng.sample(range(kv_len), min(kv_len, cfg.K)):
                if len(chosen) >= want:
                    break
                add(p)
            rng.shuffle(chosen)
            last = chosen
            out = chosen + [-1] * (cfg.K - len(chosen))
            for _ in range(rng.randint(0, 2)):
                i = rng.randrange(cfg.K)
                if out[i] < 0 or rng.random() < 0.3:
                    out[i] = -1 if rng.random() < 0.4 else kv_len + rng.randrange(q + 2)
            valid = [p for p in out if p >= 0]
            if len(set(valid)) != len(valid):
                out = [p if p < kv_len else -1 for p in out]
            rows.append(out)
        req["prev"][layer] = last
        return rows

    def draft(self, r: int, q: int) -> List[int]:
        """Locs of the ``q`` drafts: those kept from the last step's rejected
        drafts (same positions), then fresh ones."""
        req = self.reqs[r]
        kept, req["kept"] = req["kept"], []
        drafts = kept[:q]
        self.free_locs.extend(kept[q:])
        self.stats["reused"] += len(drafts)
        while len(drafts) < q:
            drafts.append(self.free_locs.pop())
        n = len(req["locs"])
        self.req_to_token[r, n : n + q] = torch.tensor(drafts, dtype=torch.int32)
        return drafts

    def accept(self, r: int, drafts: List[int]) -> None:
        cfg, rng = self.cfg, self.rng
        q = len(drafts)
        a = q if rng.random() < cfg.p_full_accept else rng.randint(1, q)
        req = self.reqs[r]
        req["locs"] += drafts[:a]
        rejected = drafts[a:]
        self.stats["rejected"] += len(rejected)
        if rng.random() < cfg.p_reuse:
            req["kept"] = rejected
        else:
            # Freed: the next admissions take them first.
            self.free_locs.extend(rejected)

    def step(self) -> None:
        cfg, rng = self.cfg, self.rng
        self.steps += 1
        if rng.random() < cfg.p_admit or not self.reqs:
            self.admit()
        if self.reqs and rng.random() < cfg.p_release:
            self.release(rng.choice(sorted(self.reqs)))
        if cfg.units > 1:
            self.grow_or_shrink()
        q = rng.randint(1, cfg.q_max) if cfg.vary_q else cfg.q_max
        for r in sorted(self.reqs):
            if len(self.reqs[r]["locs"]) + q > cfg.max_ctx or len(self.free_locs) < q:
                self.release(r)
        batch = sorted(self.reqs)
        rng.shuffle(batch)
        if not batch:
            return
        drafts = {r: self.draft(r, q) for r in batch}
        num_real, pad = len(batch), rng.randint(0, cfg.max_pad_rows)
        rpi = batch + [rng.randrange(cfg.max_reqs) for _ in range(pad)]
        seq_lens = [len(self.reqs[r]["locs"]) + q for r in batch] + [1] * pad
        r2t = self.req_to_token.to(DEVICE)
        r2t_list = self.req_to_token.tolist()
        for layer in range(cfg.layers):
            topk = []
            for b, r in enumerate(batch):
                topk += self.pick(r, layer, seq_lens[b], q)
            topk += [[rng.choice([-1, 0, 1, 3]) for _ in range(cfg.K)]] * (pad * q)
            expect = self.model.swap_multi(
                layer, topk, rpi, seq_lens, r2t_list, num_real, q
            )
            self.stats["copies"] += sum(map(len, expect[1]))
            for state in self.states:
                plan = self.run_swap(
                    state, layer, topk, rpi, seq_lens, num_real, q, r2t
                )
                got = plan_rows(plan, len(rpi))
                self.test.assertEqual(got, expect, f"step {self.steps} layer {layer}")
                for copies in got[1]:
                    srcs = [src for src, _ in copies]
                    self.test.assertEqual(len(set(srcs)), len(srcs), "copied twice")
            for b, r in enumerate(batch):
                # Looked-up entries (below the read window) picked again by
                # a later query token of the request.
                rows = topk[b * q : (b + 1) * q]
                picked = [
                    p for row in rows for p in row if 0 <= p < seq_lens[b] - cfg.W
                ]
                self.stats["dup_entries"] += len(picked) - len(set(picked))
        for r in batch:
            # Drafts live in the window: never LRU-resident, in any layer.
            for state in self.states:
                resident = set(state.slot_loc[:, r].reshape(-1).tolist())
                self.test.assertFalse(resident & set(drafts[r]), "draft in the LRU")
            self.accept(r, drafts[r])
        for state in self.states:
            assert_state_matches_model(self.test, state, self.model)
            check_invariants(self.test, state)

    def run_swap(self, state, layer, topk, rpi, seq_lens, num_real, q, r2t):
        rng, bs = self.rng, len(rpi)
        dtype = rng.choice([torch.int32, torch.int64])
        num = torch.tensor([num_real], dtype=torch.int32, device=DEVICE)
        if num_real == bs and rng.random() < 0.3:
            num = None
        out = None
        if rng.random() < 0.5:
            # Preallocated, dirty and larger than needed (CUDA-graph buffers
            # sized for more requests and query tokens).
            rows, k, extra = bs + rng.randint(0, 2), state.top_k, rng.randint(0, 1)
            width = (q + extra) * k
            out = LayerSwapPlan(
                torch.full((rows * (q + extra), k), 777, dtype=torch.int32),
                torch.full((rows, width), 777, dtype=torch.int64),
                torch.full((rows, width), 777, dtype=torch.int32),
                torch.full((rows,), 777, dtype=torch.int32),
            )
            out = LayerSwapPlan(*(t.to(DEVICE) for t in out))
        plan = state.swap_layer(
            layer,
            torch.tensor(topk, dtype=dtype, device=DEVICE),
            torch.tensor(rpi, dtype=dtype, device=DEVICE),
            torch.tensor(seq_lens, dtype=dtype, device=DEVICE),
            r2t,
            num,
            out=out,
            num_query_tokens=q,
        )
        self.test.assertEqual(tuple(plan.page_table.shape), (bs * q, state.top_k))
        self.test.assertEqual(tuple(plan.miss_src_loc.shape), (bs, q * state.top_k))
        if out is not None:
            self.test.assertEqual(plan.page_table.data_ptr(), out.page_table.data_ptr())
        return plan


def run_verify_sim(test, cfg: VerifyConfig, impls, steps: int, seed: int):
    states = [new_state(cfg, impl) for impl in impls]
    model = LRUModel(
        cfg.layers, cfg.C, cfg.W, cfg.units, read_window=cfg.W - cfg.q_max + 1
    )
    sim = VerifySim(test, cfg, states, model, seed)
    for _ in range(steps):
        sim.step()
    for a in states[1:]:
        assert_states_equal(test, states[0], a)
    return sim


class TestMultiTokenSwap(unittest.TestCase):
    """Hand examples of the semantics, and the argument checks."""

    def _impls(self):
        return ["reference", "fused", "split"] if TRITON_OK else ["reference"]

    def _state(self, impl, C=8, W=3, K=4, q=2, units=1):
        cfg = VerifyConfig(
            layers=1, K=K, q_max=q, C=C, W=W, units=units, max_reqs=2, num_locs=64
        )
        return new_state(cfg, impl)

    def test_hand_example(self):
        # C=8, W=3, K=4, q=2; request 1 at base 100, position p holds loc 10 + p.
        # seq_len 11 with both query tokens: they sit at positions 9 and 10,
        # the window is positions 8..10 (rows 108 + p % 3).
        r2t = (torch.arange(32, dtype=torch.int32) + 10).repeat(2, 1).to(DEVICE)
        for impl in self._impls():
            s = self._state(impl)
            s.admit_request(1, 100)
            topk = torch.tensor([[3, 9, 10, 1], [1, 3, 5, 10]], device=DEVICE)
            plan = s.swap_layer(
                0,
                topk,
                torch.tensor([1], device=DEVICE),
                torch.tensor([11], device=DEVICE),
                r2t,
                num_query_tokens=2,
            )
            # Query 0 cannot see position 10 (the draft after it): padding.
            # Positions 1 and 3 are picked by both: one copy each, one row.
            self.assertEqual(
                plan.page_table.tolist(), [[100, 108, -1, 101], [101, 100, 102, 109]]
            )
            c = int(plan.miss_count[0])
            self.assertEqual(plan.miss_src_loc[0, :c].tolist(), [13, 11, 15], impl)
            self.assertEqual(plan.miss_dst_row[0, :c].tolist(), [100, 101, 102])
            # Victims in order of first appearance, most recent at the end.
            self.assertEqual(s.lru_order[0, 1].tolist(), [3, 4, 5, 6, 7, 0, 1, 2])
            # 5 looked-up entries, 3 copies: 2 hits; 2 window entries.
            self.assertEqual(s.counters[0].tolist(), [2, 2, 3])
            # Next step, one draft accepted: the union's hits keep their order
            # (slots 1, 0 as before) and go last; the new miss 17 before them.
            plan = s.swap_layer(
                0,
                torch.tensor([[7, 1, -1, -1], [3, 11, 1, 7]], device=DEVICE),
                torch.tensor([1], device=DEVICE),
                torch.tensor([12], device=DEVICE),
                r2t,
                num_query_tokens=2,
            )
            self.assertEqual(
                plan.page_table.tolist(), [[103, 101, -1, -1], [100, 110, 101, 103]]
            )
            self.assertEqual(plan.miss_src_loc[0, :1].tolist(), [17])
            self.assertEqual(s.lru_order[0, 1].tolist(), [4, 5, 6, 7, 2, 3, 0, 1])
            check_invariants(self, s)

    def test_one_query_token_is_the_decode_swap(self):
        # A state that allows q query tokens, swapping one: the decode swap
        # with the read window W - q + 1 (test_lru_cache_state's workload).
        cfg = SimConfig(layers=1, C=40, K=12, W=5, max_batch=4, units=2)
        for use_triton in [False, True] if TRITON_OK else [False]:
            for q in (1, 3):
                state = sim_state(cfg, use_triton, max_query_tokens=q)
                self.assertEqual(state.read_window, cfg.W - q + 1)
                model = LRUModel(
                    cfg.layers, cfg.C, cfg.W, cfg.units, read_window=cfg.W - q + 1
                )
                sim = Sim(self, cfg, [state], model, seed=11)
                for _ in range(10):
                    sim.step()

    @unittest.skipUnless(TRITON_OK, TRITON_SKIP)
    def test_multi_token_kernels_at_one_query_token(self):
        # The multi-token kernels with Q = 1 give the one-token kernels' results.
        for units in (1, 2):
            cfg = SimConfig(layers=1, C=40, K=12, W=5, max_batch=4, units=units)
            states = [sim_state(cfg, True)]
            for split in (False, True):
                state = sim_state(cfg, True)
                state.swap_backend = TritonLRUSwap(
                    state, multi_split=split, always_multi_token=True
                )
                states.append(state)
            model = LRUModel(cfg.layers, cfg.C, cfg.W, max_units=cfg.units)
            sim = Sim(self, cfg, states, model, seed=12 + units)
            for _ in range(10):
                sim.step()
            for state in states[1:]:
                assert_states_equal(self, states[0], state)

    def test_padding_requests_are_noops(self):
        r2t = torch.arange(64, dtype=torch.int32, device=DEVICE).view(2, 32)
        for impl in self._impls():
            s = self._state(impl, C=8, W=3, K=4, q=2)
            s.admit_request(0, 0)
            topk = torch.tensor([[0, 1, 2, 3]] * 4, device=DEVICE)
            rpi = torch.tensor([0, 1 << 20], device=DEVICE)  # garbage index too
            num_real = torch.tensor([1], dtype=torch.int32, device=DEVICE)
            seq = torch.tensor([20, 1], device=DEVICE)
            plan = s.swap_layer(0, topk, rpi, seq, r2t, num_real, num_query_tokens=2)
            self.assertEqual(plan.page_table[2:].tolist(), [[-1] * 4] * 2)
            self.assertEqual(plan.miss_count.tolist(), [4, 0])
            num_real.zero_()
            before = [t.clone() for t in (s.loc_to_slot, s.slot_loc, s.lru_order)]
            plan = s.swap_layer(0, topk, rpi, seq, r2t, num_real, num_query_tokens=2)
            self.assertEqual(plan.page_table.tolist(), [[-1] * 4] * 4)
            for a, b in zip(before, (s.loc_to_slot, s.slot_loc, s.lru_order)):
                self.assertTrue(torch.equal(a, b))

    def test_union_fills_the_buffer(self):
        # q disjoint top-k sets: the union needs all q x K = C slots at once.
        # Then half of it again: those rows stay, the other half is evicted.
        K, q = 4, 3
        r2t = torch.arange(128, dtype=torch.int32, device=DEVICE).view(2, 64)
        for impl in self._impls():
            s = self._state(impl, C=K * q, W=2 * q - 1, K=K, q=q)
            s.admit_request(0, 0)
            args = (torch.tensor([0], device=DEVICE), torch.tensor([40], device=DEVICE))
            topk = torch.arange(K * q, device=DEVICE).view(q, K)
            plan = s.swap_layer(0, topk, *args, r2t, num_query_tokens=q)
            self.assertEqual(int(plan.miss_count[0]), K * q)
            rows = plan.page_table.reshape(-1).tolist()
            self.assertEqual(sorted(rows), list(range(K * q)))
            plan = s.swap_layer(0, topk + K * q // 2, *args, r2t, num_query_tokens=q)
            self.assertEqual(int(plan.miss_count[0]), K * q // 2)
            again = plan.page_table.reshape(-1).tolist()
            self.assertEqual(again[: K * q // 2], rows[K * q // 2 :])
            self.assertEqual(sorted(again), list(range(K * q)))
            check_invariants(self, s)

    def test_rejected_drafts_beyond_the_next_step(self):
        # W = 5, q <= 3: swaps read positions >= n - 3 from the ring. A step
        # with 3 drafts (positions 10..12, rows base + C + p % 5) accepts one:
        # 11 and 12 are rejected, their rows held positions 6 and 7. The next
        # step drafts only 1 token (position 11): position 7 is committed, its
        # ring row holds draft 12. It must be read through the LRU (a copy
        # from its host slot), not from the ring; 9 is read from the ring.
        r2t = (torch.arange(32, dtype=torch.int32) + 10).repeat(2, 1).to(DEVICE)
        for impl in self._impls():
            s = self._state(impl, C=12, W=5, K=4, q=3)
            s.admit_request(0, 0)
            args = (torch.tensor([0], device=DEVICE),)
            topk = torch.tensor([[10, 11, 12, 7]] * 3, device=DEVICE)
            plan = s.swap_layer(
                0,
                topk,
                *args,
                torch.tensor([13], device=DEVICE),
                r2t,
                None,
                num_query_tokens=3,
            )
            # Position 7 is below the read window (13 - 3): an LRU miss.
            self.assertEqual(plan.miss_src_loc[0, :1].tolist(), [17])
            plan = s.swap_layer(
                0,
                torch.tensor([[7, 9, 11, -1]], device=DEVICE),
                *args,
                torch.tensor([12], device=DEVICE),
                r2t,
                num_query_tokens=1,
            )
            # 7: LRU slot 0 (loaded last step), not ring row 14 (draft 12's);
            # 9, 11: ring rows 12 + p % 5.
            self.assertEqual(plan.page_table.tolist(), [[0, 16, 13, -1]])
            self.assertEqual(int(plan.miss_count[0]), 0)

    def test_expand_query_tokens(self):
        s = self._state("reference", q=3, W=5, C=12)
        rpi, lens = s.expand_query_tokens(
            torch.tensor([4, 1]), torch.tensor([10, 20]), 3
        )
        self.assertEqual(rpi.tolist(), [4, 4, 4, 1, 1, 1])
        self.assertEqual(lens.tolist(), [8, 9, 10, 18, 19, 20])
        rpi, lens = s.expand_query_tokens(torch.tensor([4]), torch.tensor([10]), 1)
        self.assertEqual((rpi.tolist(), lens.tolist()), ([4], [10]))

    def test_argument_checks(self):
        with self.assertRaisesRegex(ValueError, "max_query_tokens"):
            self._state("reference", C=7, K=4, q=2)  # C < q x K
        with self.assertRaisesRegex(ValueError, "recent_window"):
            self._state("reference", C=8, W=2, K=4, q=2)  # W < 2 q - 1
        s = self._state("reference")
        s.admit_request(0, 0)
        r2t = torch.zeros((2, 32), dtype=torch.int32, device=DEVICE)
        one = torch.tensor([0], device=DEVICE)
        with self.assertRaisesRegex(ValueError, "num_query_tokens"):
            s.swap_layer(0, torch.zeros((3, 4)), one, one + 9, r2t, num_query_tokens=3)
        with self.assertRaisesRegex(ValueError, "rows"):
            s.swap_layer(0, torch.zeros((3, 4)), one, one + 9, r2t, num_query_tokens=2)


def sim_state(cfg: SimConfig, use_triton: bool, **kwargs) -> LRUCacheState:
    return LRUCacheState(
        num_layers=cfg.layers,
        max_num_reqs=cfg.max_reqs,
        num_locs=cfg.num_locs,
        buffer_size=cfg.C,
        recent_window=cfg.W,
        top_k=cfg.K,
        device=DEVICE,
        use_triton=use_triton,
        max_units=cfg.units,
        **kwargs,
    )


@unittest.skipUnless(TRITON_OK, TRITON_SKIP)
class TestMultiTokenTritonMatchesReference(unittest.TestCase):
    """Reference, both Triton swaps and the model in lockstep (seeded)."""

    IMPLS = ("reference", "fused", "split")

    def _run(self, cfg, steps, seed, impls=IMPLS):
        sim = run_verify_sim(self, cfg, impls, steps, seed)
        self.assertGreater(sim.stats["rejected"], 0)
        self.assertGreater(sim.stats["copies"], 0)
        return sim

    def test_three_query_tokens(self):
        sim = self._run(VerifyConfig(q_max=3, vary_q=False), steps=12, seed=1)
        self.assertGreater(sim.stats["dup_entries"], 50)
        self.assertGreater(sim.stats["reused"], 0)

    def test_four_query_tokens_non_pow2(self):
        cfg = VerifyConfig(layers=1, K=11, q_max=4, C=50, W=9, max_batch=3)
        self._run(cfg, steps=15, seed=2)

    def test_heavy_eviction(self):
        # C = q x K, little reuse between steps and query tokens: every step
        # fills most of the buffer.
        cfg = VerifyConfig(
            layers=1,
            K=10,
            q_max=4,
            C=40,
            W=7,
            p_keep=0.1,
            p_share=0.3,
            p_recent=0.2,
        )
        self._run(cfg, steps=15, seed=3)

    def test_units(self):
        # Units granted and taken back between steps; with units the default
        # Triton swap runs split, "fused" walks all units in one program.
        cfg = VerifyConfig(layers=1, K=8, q_max=3, C=24, W=5, units=3, max_batch=4)
        self._run(cfg, steps=15, seed=4, impls=("reference", "triton", "fused"))

    def test_churn_and_padding(self):
        cfg = VerifyConfig(
            K=8,
            q_max=2,
            C=20,
            W=3,
            max_reqs=4,
            num_locs=500,
            p_admit=0.6,
            p_release=0.4,
            max_pad_rows=3,
        )
        self._run(cfg, steps=15, seed=5)


def verify_configs(max_steps: int):
    @st.composite
    def build(draw):
        K = draw(st.integers(3, 24))
        q = draw(st.integers(1, 4))
        C = draw(st.integers(q * K, q * K + 30))
        W = draw(st.integers(2 * q - 1, min(12, C - 1)))
        cfg = VerifyConfig(
            layers=draw(st.integers(1, 3)),
            K=K,
            q_max=q,
            C=C,
            W=W,
            units=draw(st.integers(1, 3)),
            max_reqs=draw(st.integers(2, 5)),
            num_locs=draw(st.integers(800, 1600)),
            max_ctx=draw(st.integers(60, 300)),
            max_batch=draw(st.integers(1, 4)),
            max_prompt=draw(st.integers(1, 150)),
            p_keep=draw(st.floats(0.0, 1.0)),
            p_share=draw(st.floats(0.0, 1.0)),
            p_recent=draw(st.floats(0.0, 1.0)),
            p_admit=draw(st.floats(0.05, 0.7)),
            p_release=draw(st.floats(0.0, 0.3)),
            p_warm=draw(st.floats(0.0, 1.0)),
            p_reuse=draw(st.floats(0.0, 1.0)),
            p_full_accept=draw(st.floats(0.0, 0.5)),
            vary_q=draw(st.booleans()),
            max_pad_rows=draw(st.integers(0, 2)),
        )
        return cfg, draw(st.integers(5, max_steps)), draw(st.integers(0, 2**31))

    return build()


class TestMultiTokenAgainstModel(unittest.TestCase):
    """Property-based differential test of the multi-token swap against
    ``LRUModel.swap_multi``: hypothesis draws sizes (q in 1..4, one unit or
    several, C from q x K up), locality between steps and query tokens,
    accept lengths, loc reuse and churn."""

    REF_EXAMPLES, TRITON_EXAMPLES = 40, 5
    stats = {
        impl: {"examples": 0, "steps": 0, "copies": 0, "dups": 0, "rejected": 0}
        for impl in ("reference", "triton")
    }

    def _run(self, impl, args):
        cfg, steps, seed = args
        sim = run_verify_sim(self, cfg, (impl,), steps, seed)
        stats = self.stats[impl]
        stats["examples"] += 1
        stats["steps"] += sim.steps
        stats["copies"] += sim.stats["copies"]
        stats["dups"] += sim.stats["dup_entries"]
        stats["rejected"] += sim.stats["rejected"]

    @settings(
        max_examples=REF_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(verify_configs(max_steps=30))
    def test_reference_vs_model(self, args):
        self._run("reference", args)

    @unittest.skipUnless(TRITON_OK, TRITON_SKIP)
    @settings(
        max_examples=TRITON_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(verify_configs(max_steps=10))
    def test_triton_vs_model(self, args):
        self._run("triton", args)

    @classmethod
    def tearDownClass(cls):
        print(f"\nmulti-token differential test workload: {cls.stats}")
        ref = cls.stats["reference"]
        if ref["examples"] == cls.REF_EXAMPLES:
            # The workload must stay meaningful if the generator is edited.
            assert ref["steps"] >= 300, ref
            assert ref["dups"] >= 1000 and ref["rejected"] >= 100, ref


class TestVerifyExactness(unittest.TestCase):
    """MTP verify steps through ``SparseCacheController`` with real KV bytes.

    Each step writes every request's ``q`` drafts (new token ids, so new
    bytes) into their window rows, swaps every layer with ``q`` query tokens,
    writes the drafts back to their host slots (all of them, as the forward
    does before acceptance is known) and accepts 1..q. Rejected drafts' locs
    carry the next step's drafts (same positions) or go back to the free list,
    where new prompts take them. After every swap each page-table entry must
    name a row holding the KV of the token at that position *now*: a
    committed token's, or this step's draft's, never a rejected draft's.
    """

    L, K, Q, C, W = 2, 6, 3, 20, 5
    MAX_REQS, NUM_REGIONS, STAGING = 5, 3, 256
    HOST_SIZE, PAGE, MAX_CTX = 1024, 16, 200

    def _run(self, use_triton, seed, steps=20):
        rng = random.Random(seed)
        L, K, Q, C, W = self.L, self.K, self.Q, self.C, self.W
        R = C + W
        gpu = [
            torch.zeros(
                (self.STAGING + self.NUM_REGIONS * R, ROW_BYTES), dtype=torch.uint8
            )
            for _ in range(L)
        ]
        gpu = [g.to(DEVICE) for g in gpu]
        host = NSAKVOnlyTokenToKVPoolHost(
            size=self.HOST_SIZE, page_size=self.PAGE, layer_num=L, row_bytes=ROW_BYTES
        )
        ctrl = SparseCacheController(
            gpu,
            host,
            max_num_reqs=self.MAX_REQS,
            top_k=K,
            buffer_size=C,
            recent_window=W,
            region_start_row=self.STAGING,
            num_regions=self.NUM_REGIONS,
            max_batch_size=4,
            use_triton=use_triton,
            max_query_tokens=Q,
        )
        # The KV of token id t in layer l (every draft is a new id).
        kv = torch.randint(0, 256, (L, 4096, ROW_BYTES), dtype=torch.uint8)
        kv_dev = kv.to(DEVICE)
        next_id = [0]

        def new_ids(n):
            ids = list(range(next_id[0], next_id[0] + n))
            next_id[0] += n
            return ids

        req_to_token = torch.zeros((self.MAX_REQS, self.MAX_CTX), dtype=torch.int32)
        free_locs = list(range(self.PAGE, self.HOST_SIZE))
        rng.shuffle(free_locs)
        free_reqs = list(range(self.MAX_REQS))
        live = {}  # r -> {"ids": committed ids, "kept": locs for the next drafts}
        checked = {"committed": 0, "draft": 0, "rejected": 0}

        def admit():
            r = free_reqs.pop(rng.randrange(len(free_reqs)))
            n = rng.randint(1, 60)
            locs = [free_locs.pop() for _ in range(n)]
            ids = new_ids(n)
            req_to_token[r, :n] = torch.tensor(locs, dtype=torch.int32)
            staging = torch.randperm(self.STAGING)[:n].to(DEVICE)
            loc_t = torch.tensor(locs, dtype=torch.int64, device=DEVICE)
            for layer in range(L):
                gpu[layer][staging] = kv_dev[layer][torch.tensor(ids)]
            ctrl.backup_prefilled_request(staging, loc_t)
            self.assertIsNotNone(ctrl.admit_request(r, prefix_locs=loc_t))
            live[r] = {"ids": ids, "kept": []}

        def release(r):
            ctrl.release_request(r)
            req = live.pop(r)
            free_locs.extend(req_to_token[r, : len(req["ids"])].tolist() + req["kept"])
            free_reqs.append(r)

        for _ in range(self.NUM_REGIONS):
            admit()
        for step in range(steps):
            if step % 6 == 5:
                release(rng.choice(sorted(live)))
            while len(live) < self.NUM_REGIONS and ctrl.can_admit():
                admit()
            q = rng.choice([1, Q, Q] + list(range(2, Q)))
            reqs = sorted(live)
            rng.shuffle(reqs)
            drafts, draft_ids = {}, {}
            for r in reqs:
                n = len(live[r]["ids"])
                kept, live[r]["kept"] = live[r]["kept"], []
                locs = kept[:q] + [free_locs.pop() for _ in range(q - len(kept[:q]))]
                free_locs.extend(kept[q:])
                drafts[r], draft_ids[r] = locs, new_ids(q)
                req_to_token[r, n : n + q] = torch.tensor(locs, dtype=torch.int32)
                # The forward writes the drafts' KV into their window rows.
                rows = [ctrl.region_base(r) + C + (n + j) % W for j in range(q)]
                for layer in range(L):
                    gpu[layer][torch.tensor(rows, device=DEVICE)] = kv_dev[layer][
                        torch.tensor(draft_ids[r])
                    ]
            pad = rng.randint(0, 1)
            seq = [len(live[r]["ids"]) + q for r in reqs] + [1] * pad
            rpi = torch.tensor(reqs + [0] * pad, device=DEVICE)
            seq_t = torch.tensor(seq, device=DEVICE)
            num_real = torch.tensor([len(reqs)], dtype=torch.int32, device=DEVICE)
            r2t = req_to_token.to(DEVICE)
            ctrl.wait_backup()
            for layer in range(L):
                topk = torch.full(((len(reqs) + pad) * q, K), -1, dtype=torch.int64)
                for b, r in enumerate(reqs):
                    for j in range(q):
                        kv_len = seq[b] - q + j + 1
                        pick = rng.sample(range(kv_len), min(K, kv_len))
                        topk[b * q + j, : len(pick)] = torch.tensor(pick)
                page_table = ctrl.swap_one_layer(
                    layer,
                    topk.to(DEVICE),
                    rpi,
                    seq_t,
                    r2t,
                    num_real,
                    num_query_tokens=q,
                )
                pt = page_table.cpu().long()
                rows = gpu[layer].cpu()
                for b, r in enumerate(reqs):
                    n = len(live[r]["ids"])
                    ids = live[r]["ids"] + draft_ids[r]
                    for j in range(q):
                        for i in range(K):
                            p = int(topk[b * q + j, i])
                            if p < 0:
                                self.assertEqual(int(pt[b * q + j, i]), -1)
                                continue
                            got = rows[int(pt[b * q + j, i])]
                            self.assertTrue(
                                torch.equal(got, kv[layer, ids[p]]),
                                f"step {step} layer {layer} req {r} query {j} "
                                f"pos {p} (committed {n})",
                            )
                            checked["committed" if p < n else "draft"] += 1
                self.assertTrue(bool((pt[len(reqs) * q :] == -1).all()))
            # The last layer's hook: every draft back to its host slot.
            win = [
                ctrl.region_base(r) + C + (len(live[r]["ids"]) + j) % W
                for r in reqs
                for j in range(q)
            ]
            locs = [loc for r in reqs for loc in drafts[r]]
            ctrl.write_back_new_tokens(
                torch.tensor(win + [1 << 30], device=DEVICE),
                torch.tensor(locs + [-1], device=DEVICE),
                torch.tensor([len(locs)], dtype=torch.int32, device=DEVICE),
            )
            for r in reqs:
                a = rng.randint(1, q)
                live[r]["ids"] += draft_ids[r][:a]
                rejected = drafts[r][a:]
                checked["rejected"] += len(rejected)
                if rng.random() < 0.5:
                    live[r]["kept"] = rejected
                else:
                    free_locs.extend(rejected)
        ctrl.synchronize()
        # What is on the host is what later steps read: every committed token.
        for r, req in live.items():
            n = len(req["ids"])
            locs = req_to_token[r, :n].long()
            ids = torch.tensor(req["ids"])
            for layer in range(L):
                self.assertTrue(
                    torch.equal(host.kv_buffer[layer, locs], kv[layer, ids])
                )
        self.assertGreater(checked["committed"], 300)
        self.assertGreater(checked["draft"], 30)
        self.assertGreater(checked["rejected"], 5)
        self.assertGreater(ctrl.get_stats()["misses"], 0)

    def test_reference(self):
        self._run(use_triton=False, seed=1)

    @unittest.skipUnless(TRITON_OK, TRITON_SKIP)
    def test_triton(self):
        self._run(use_triton=True, seed=2, steps=10)


if __name__ == "__main__":
    unittest.main()
