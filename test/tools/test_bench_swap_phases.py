"""``benchmark/nsa_offload/engine/bench_swap_phases.py``: the swap kernel cut
after a phase computes what the product kernel computes up to there, and
leaves the state alone (CPU: the Triton interpreter, a small workload; the
timing itself needs the GPU)."""

import argparse
import os
import sys
import unittest
import unittest.mock
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sglang.srt.mem_cache import lru_cache_state as lru_mod  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmark" / "nsa_offload"
sys.path.insert(0, str(BENCH_DIR / "engine"))

import bench_swap_phases as phases  # noqa: E402
import gpu_check_lru as check  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = DEVICE == "cuda" or lru_mod._swap_kernel_is_interpreted()


@unittest.skipUnless(TRITON_OK, "Triton neither on CUDA nor interpreted")
class TestSwapStages(unittest.TestCase):
    def setUp(self):
        check.DEV = DEVICE
        args = argparse.Namespace(C=32, K=16, W=4)
        # Requests longer than the buffer with little step-to-step overlap:
        # every swap has hits, misses and victims.
        self.wl = check.Workload(3, 0, args, 60, 200, 4, 0.3, seed=1)
        (self.state,) = check.new_states(self.wl, args, 1, kinds=(True,))
        self.wl.admit(self.state, warm=True)
        for _ in range(2):  # a few swaps: lru_order is no longer the identity
            self.step()
            self.state.swap_layer(0, self.topk, self.rpi, self.seq, *self.rest)

    def step(self):
        self.wl.seq_lens += 1
        self.topk = self.wl.topk(0)
        self.seq = self.wl.seq_lens.clone()
        self.rpi, _, num_real = self.wl.inputs(torch.int64)
        self.rest = (self.wl.req_to_token, num_real)

    def cut(self, stage):
        bs, K = self.topk.shape[0], self.state.top_k
        out = check.make_out(bs, K)
        order_out = torch.full(
            (bs, self.state.num_slots), -7, dtype=torch.int16, device=DEVICE
        )
        before = check.snapshot(self.state)
        phases.launch_stage(
            stage, self.state, self.topk, self.rpi, self.seq, *self.rest, out, order_out
        )
        after = check.snapshot(self.state)
        for field, a, b in zip(check.STATE_BUFFERS, before, after):
            self.assertTrue(torch.equal(a, b), f"stage {stage} changed {field}")
        return out, order_out

    def test_loads_gather_the_slots(self):
        self.step()
        out, _ = self.cut("loads")
        s, W = self.state, self.state.recent_window
        expect = torch.full_like(out.page_table, -1)
        for b, r in enumerate(self.rpi.tolist()):
            n = int(self.seq[b])
            for j, p in enumerate(self.topk[b].tolist()):
                if 0 <= p < n - W:
                    loc = int(self.wl.req_to_token[r, p])
                    expect[b, j] = int(s.loc_to_slot[0, loc])
        self.assertTrue(torch.equal(out.page_table.cpu(), expect.cpu()))
        self.assertTrue((expect >= 0).any() and (expect < 0).any())

    def test_phase2_order_and_victims_match_the_full_swap(self):
        self.step()
        _, order_out = self.cut("phase2")
        victims = self.state.swap_backend._victims.clone()
        plan = self.state.swap_layer(0, self.topk, self.rpi, self.seq, *self.rest)
        misses = plan.miss_count.tolist()
        self.assertGreater(sum(misses), 0)
        for b, r in enumerate(self.rpi.tolist()):
            self.assertTrue(
                torch.equal(order_out[b], self.state.lru_order[0, r]), f"row {b}"
            )
            m = misses[b]
            self.assertTrue(
                torch.equal(victims[b, :m], self.state.swap_backend._victims[b, :m])
            )

    def test_every_cut_stage_launches(self):
        for stage in phases.STAGES[:-1]:
            self.step()
            out, _ = self.cut(stage)
            self.assertEqual(out.miss_count.numel(), self.topk.shape[0])


if __name__ == "__main__":
    unittest.main()


@unittest.skipUnless(TRITON_OK, "Triton neither on CUDA nor interpreted")
class TestDirectSlotsCheck(unittest.TestCase):
    """gpu_check_lru.py's direct-slots differential (run at production sizes
    on the GPU) agrees on a small workload and fails when one side ignores
    direct mode."""

    ARGS = argparse.Namespace(C=32, K=16, W=4, layers=2, steps=6)

    def setUp(self):
        check.DEV = DEVICE
        check.FAILURES.clear()

    def tearDown(self):
        check.FAILURES.clear()

    def test_agrees_and_leaves_direct_mode(self):
        # Contexts at C + W - 1 - 3: every request outgrows its slots in 6 steps.
        r = check.run_direct_correctness(self.ARGS, 4, 32, 35, seed=3)
        self.assertTrue(r["ok"], check.FAILURES)
        self.assertEqual(r["direct_entered"], 4)
        self.assertEqual(r["direct_at_end"], 0)

    def test_a_reference_without_direct_mode_fails(self):
        orig = check.new_states

        def without_direct(*a, **k):
            tri, ref = orig(*a, **k)
            ref.enter_direct = lambda *args: None
            return tri, ref

        with unittest.mock.patch.object(check, "new_states", without_direct):
            r = check.run_direct_correctness(self.ARGS, 4, 1, 20, seed=4)
        self.assertFalse(r["ok"])
        self.assertTrue(check.FAILURES)
