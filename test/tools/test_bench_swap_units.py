"""``benchmark/nsa_offload/engine/bench_swap_units.py`` on a small workload: the
swap kernels stay equal to the torch reference over replays with misses, and the
report says so (CPU: eager steps under the Triton interpreter, no timing)."""

import json
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import torch
from sglang.srt.mem_cache.lru_cache_state import default_use_triton

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmark" / "nsa_offload"
sys.path.insert(0, str(BENCH_DIR / "engine"))

import bench_swap_units  # noqa: E402
import gpu_check_units  # noqa: E402
import offload_bench_utils  # noqa: E402

TRITON_OK = torch.cuda.is_available() or default_use_triton(torch.device("cpu"))


@unittest.skipUnless(TRITON_OK, "Triton neither on CUDA nor interpreted")
class TestBenchSwapUnits(unittest.TestCase):
    def test_kernels_equal_the_reference_with_misses(self):
        with tempfile.TemporaryDirectory() as out:
            argv = ["bench_swap_units.py", "--out", out, "--batch-sizes", "2"]
            argv += ["--units", "1,3", "--ctx", "4000", "--buffer-size", "24"]
            argv += ["--window", "4", "--top-k", "24", "--steps", "6"]
            argv += ["--repeats", "2"]
            with mock.patch.object(sys, "argv", argv):
                with self.assertRaises(SystemExit) as done:
                    bench_swap_units.main()
            self.assertEqual(done.exception.code, 0)
            with open(Path(out) / "bench_swap_units.json") as f:
                report = json.load(f)
            self.assertTrue(report["equals_reference"])
            by_units = {r["units"]: r for r in report["rows"]}
            self.assertEqual(set(by_units), {1, 3})
            # Fresh positions outnumber even three units' slots: both swaps
            # evict on every replay, so the comparison covers victims.
            for row in by_units.values():
                self.assertEqual(row["mismatched_replays"], 0)
                self.assertGreater(row["misses_per_row"], 0)
            md = (Path(out) / "bench_swap_units.md").read_text()
            self.assertIn("| 2 | 3 (72) |", md)
            self.assertIn("| yes |", md)

    def test_a_wrong_kernel_fails_the_run(self):
        # The verdict follows the comparison: a replay that differs fails.
        with tempfile.TemporaryDirectory() as out:
            argv = ["bench_swap_units.py", "--out", out, "--batch-sizes", "1"]
            argv += ["--units", "2", "--ctx", "400", "--buffer-size", "24"]
            argv += ["--window", "4", "--top-k", "24", "--steps", "2"]
            argv += ["--repeats", "1"]
            same = mock.patch.object(bench_swap_units, "_same", return_value=False)
            with mock.patch.object(sys, "argv", argv), same:
                with self.assertRaises(SystemExit) as done:
                    bench_swap_units.main()
            self.assertEqual(done.exception.code, 1)
            md = (Path(out) / "bench_swap_units.md").read_text()
            self.assertIn("| NO |", md)


@unittest.skipUnless(TRITON_OK, "Triton neither on CUDA nor interpreted")
class TestGpuCheckUnits(unittest.TestCase):
    """``gpu_check_units.py`` (the split kernels against the torch reference,
    swap by swap) in its three warm-ups, at tiny sizes: the kernels' direct
    variants included, and a direct-mode run whose newer half misses."""

    def _check(self, *extra):
        with tempfile.TemporaryDirectory() as d:
            out = str(Path(d) / "units.json")
            argv = ["gpu_check_units.py", "--out", out, "--batch-sizes", "1,2"]
            argv += ["--units", "2", "--C", "64", "--K", "32", "--W", "8"]
            argv += ["--steps", "5", *extra]
            with mock.patch.object(sys, "argv", argv):
                with self.assertRaises(SystemExit) as done:
                    gpu_check_units.main()
            return done.exception.code, json.loads(Path(out).read_text())

    def test_warm_ups(self):
        for extra in (["--ctx", "400"], ["--ctx", "400", "--direct-slots"]):
            code, report = self._check(*extra)
            self.assertEqual(code, 0, report)
            self.assertEqual(len(report["results"]), 2)
        code, report = self._check("--ctx", "100", "--warm", "direct")
        self.assertEqual(code, 0, report)
        self.assertTrue(report["config"]["direct_slots"])

    def test_direct_needs_a_fitting_context(self):
        argv = ["gpu_check_units.py", "--out", "/nonexistent/units.json"]
        argv += ["--units", "2", "--C", "64", "--ctx", "400", "--warm", "direct"]
        with mock.patch.object(sys, "argv", argv), self.assertRaises(
            SystemExit
        ) as done:
            gpu_check_units.main()
        self.assertEqual(done.exception.code, 2)  # argparse's error, before any run


class TestFinishCheck(unittest.TestCase):
    def test_result_file_and_exit_code(self):
        with tempfile.TemporaryDirectory() as d:
            out = str(Path(d) / "r.json")
            self.assertEqual(offload_bench_utils.finish_check({"a": 1}, [], out), 0)
            self.assertEqual(
                json.loads(Path(out).read_text()),
                {"a": 1, "failures": [], "ok": True},
            )
            self.assertEqual(offload_bench_utils.finish_check({}, ["bad"], out), 1)
            self.assertEqual(
                json.loads(Path(out).read_text()), {"failures": ["bad"], "ok": False}
            )


if __name__ == "__main__":
    unittest.main()
