"""``benchmark/nsa_offload/engine/gpu_check_lru.py`` (the swap kernels against the
torch reference at production sizes on the GPU) on a small workload under the
Triton interpreter: its direct-slots differential agrees, and fails when one
side ignores direct mode."""

import argparse
import sys
import unittest
import unittest.mock
from pathlib import Path

import torch
from sglang.srt.mem_cache.lru_cache_state import default_use_triton

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmark" / "nsa_offload"
sys.path.insert(0, str(BENCH_DIR / "engine"))

import gpu_check_lru as check  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = DEVICE == "cuda" or default_use_triton(torch.device("cpu"))


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


if __name__ == "__main__":
    unittest.main()
