"""Random MTP verify workload for the multi-token swap tests (docs/MTP.md).

``VerifySim`` drives ``LRUCacheState`` backends (torch reference, Triton)
and ``lru_model.LRUModel.swap_multi`` in lockstep: each step appends
``q`` drafts per request, swaps every layer with ``q`` query tokens whose
top-k overlap, and accepts 1..q of them; rejected drafts' locs carry the next
step's drafts (same positions) or go back to the free list for new requests.
Page tables are compared row for row, copy lists per request, the whole state
after every step.
"""

import os
import random
from dataclasses import dataclass
from typing import List
from unittest import mock

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lru_model import LRUModel
from sglang.srt.mem_cache import lru_cache_state as lru_cache_state_module
from sglang.srt.mem_cache import memory_pool as memory_pool_module
from sglang.srt.mem_cache import sparse_cache_controller as controller_module
from sglang.srt.mem_cache.lru_cache_state import (
    LayerSwapPlan,
    LRUCacheState,
    default_use_triton,
)
from test_lru_cache_state import (
    Sim,
    assert_state_matches_model,
    assert_states_equal,
    check_invariants,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# On CUDA, or on CPU under TRITON_INTERPRET=1 (conftest.py sets it).
TRITON_OK = default_use_triton(torch.device(DEVICE))
TRITON_SKIP = "Triton kernels neither on CUDA nor interpreted (TRITON_INTERPRET=1)"


def get_mla_kv_rows_torch(kv_buffer, loc, cache_k_nope, cache_k_rope):
    """What sglang's ``get_mla_kv_buffer_triton`` does: ``nope_i | rope_i`` =
    row ``loc[i]`` of ``kv_buffer``, converted to the outputs' dtype."""
    n = loc.numel()
    rows = kv_buffer.view(kv_buffer.shape[0], -1)[loc.to(torch.int64)]
    nope, rope = cache_k_nope.view(n, -1), cache_k_rope.view(n, -1)
    nope.copy_(rows[:, : nope.shape[1]])
    rope.copy_(rows[:, nope.shape[1] : nope.shape[1] + rope.shape[1]])


def cpu_torch_paths():
    """``mock.patch`` objects for the real-pools tests on CPU (none on CUDA):
    the torch swap (``ReferenceLRUSwap``, bit-exact with the kernels), the
    torch miss / backup copies and the torch KV row write and read instead of
    their Triton kernels, which the interpreter runs ~100x slower. For tests of the
    wiring around the kernels (the kernels have their own tests); start them
    in ``setUpModule`` before any pool or coordinator is built."""
    if DEVICE != "cpu":
        return []
    from offload_harness import set_mla_kv_rows_torch

    return [
        mock.patch.object(
            lru_cache_state_module, "default_use_triton", lambda device: False
        ),
        mock.patch.object(controller_module, "copy_kernels_interpreted", lambda: False),
        mock.patch.object(
            memory_pool_module, "set_mla_kv_buffer_triton", set_mla_kv_rows_torch
        ),
        mock.patch.object(
            memory_pool_module, "get_mla_kv_buffer_triton", get_mla_kv_rows_torch
        ),
    ]


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
    """``impl``: "reference" (the torch swap) or "triton" (the kernels)."""
    if impl not in ("reference", "triton"):
        raise ValueError(f"unknown swap implementation {impl!r}")
    return LRUCacheState(
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

    # Random unit changes of live requests between steps, as in the decode
    # differential (same fields: cfg.units / p_shrink / p_grow, reqs, ...).
    grow_or_shrink = Sim.grow_or_shrink

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
