"""The multi-token LRU swap (MTP target verify, docs/MTP.md): hand examples,
argument checks, and the torch reference and the Triton kernels (under
TRITON_INTERPRET=1 on a CPU machine) against
``lru_model.LRUModel.swap_multi`` over random verify workloads
(``mtp_verify_sim.VerifySim``), seeded and property-based.
"""

import unittest

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lru_model import LRUModel
from mtp_verify_sim import (
    DEVICE,
    TRITON_OK,
    TRITON_SKIP,
    VerifyConfig,
    new_state,
    run_verify_sim,
)
from sglang.srt.mem_cache.lru_cache_state import LRUCacheState
from test_lru_cache_state import Sim, SimConfig, check_invariants


class TestMultiTokenSwap(unittest.TestCase):
    """Hand examples of the semantics, and the argument checks."""

    def _impls(self):
        return ["reference", "triton"] if TRITON_OK else ["reference"]

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
        # The Triton swap of a one-token state is test_lru_cache_state's:
        # here the kernels only at q = 3 (the multi-token kernels, one token).
        cases = [(False, 1), (False, 3)] + ([(True, 3)] if TRITON_OK else [])
        for use_triton, q in cases:
            with self.subTest(use_triton=use_triton, q=q):
                state = sim_state(cfg, use_triton, max_query_tokens=q)
                self.assertEqual(state.read_window, cfg.W - q + 1)
                model = LRUModel(
                    cfg.layers, cfg.C, cfg.W, cfg.units, read_window=cfg.W - q + 1
                )
                sim = Sim(self, cfg, [state], model, seed=11)
                for _ in range(8):
                    sim.step()

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


# Steps of each seeded differential run: the interpreted kernels cost ~0.1 s
# a step and layer on CPU; each run still rejects drafts and copies rows.
STEPS = 6


@unittest.skipUnless(TRITON_OK, TRITON_SKIP)
class TestMultiTokenTritonMatchesReference(unittest.TestCase):
    """Reference, the Triton swap and the model in lockstep (seeded)."""

    IMPLS = ("reference", "triton")

    def _run(self, cfg, steps, seed, impls=IMPLS):
        sim = run_verify_sim(self, cfg, impls, steps, seed)
        self.assertGreater(sim.stats["rejected"], 0)
        self.assertGreater(sim.stats["copies"], 0)
        return sim

    def test_three_query_tokens(self):
        sim = self._run(VerifyConfig(q_max=3, vary_q=False), steps=STEPS, seed=1)
        self.assertGreater(sim.stats["dup_entries"], 50)
        self.assertGreater(sim.stats["reused"], 0)

    def test_four_query_tokens_non_pow2(self):
        cfg = VerifyConfig(layers=1, K=11, q_max=4, C=50, W=9, max_batch=3)
        self._run(cfg, steps=STEPS, seed=2)

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
        self._run(cfg, steps=STEPS, seed=3)

    def test_units(self):
        # Units granted and taken back between steps.
        cfg = VerifyConfig(layers=1, K=8, q_max=3, C=24, W=5, units=3, max_batch=4)
        self._run(cfg, steps=STEPS, seed=4)

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
        self._run(cfg, steps=STEPS, seed=5)


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

    REF_EXAMPLES, TRITON_EXAMPLES = 40, 3
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
    @given(verify_configs(max_steps=6))
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


if __name__ == "__main__":
    unittest.main()
