"""``benchmark/nsa_offload/demo.py``: the capacity table from the product's pool
sizing and the cost rows from the committed rank measurements (CPU)."""

import contextlib
import io
import json
import sys
import tempfile
import unittest
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmark" / "nsa_offload"
sys.path.insert(0, str(BENCH_DIR))

import demo  # noqa: E402

GIB = 1 << 30


class TestCapacity(unittest.TestCase):
    def test_no_offload_counts_whole_pages_of_sglang_cells(self):
        # Exactly 3 requests of 100 tokens (2 pages each) and one cell less.
        cell = demo.LAYERS * (demo.NOMINAL_ROW_BYTES + demo.INDEXER_BYTES)
        budget = 3 * 2 * demo.PAGE * cell
        self.assertEqual(demo.no_offload_requests(budget, 100), 3)
        self.assertEqual(demo.no_offload_requests(budget - cell, 100), 2)

    def test_offload_holds_more_long_requests_and_staging_costs(self):
        budget, host = 14 * GIB, 64 * GIB
        pd = demo.offload_requests(budget, host, 131072, colocated=False)
        colocated = demo.offload_requests(budget, host, 131072, colocated=True)
        self.assertGreater(pd["requests"], demo.no_offload_requests(budget, 131072))
        # The colocated server's prefill staging takes GPU rows a PD one has.
        self.assertLessEqual(colocated["requests"], pd["requests"])
        self.assertLessEqual(pd["requests"], pd["regions"])
        # A host pool too small for the locs caps what the offload holds.
        small = demo.offload_requests(budget, 8 * GIB, 131072, colocated=False)
        self.assertLess(small["requests"], pd["requests"])


class TestMain(unittest.TestCase):
    def test_writes_the_tables(self):
        with tempfile.TemporaryDirectory() as d:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                rc = demo.main(["--out-dir", d, "--no-plot"])
            self.assertEqual(rc, 0)
            result = json.loads((Path(d) / "demo.json").read_text())
            md = (Path(d) / "demo.md").read_text()
            self.assertFalse((Path(d) / "demo.png").exists())
        self.assertIn(md, out.getvalue())
        capacity = result["capacity"]
        self.assertEqual([c["context"] for c in capacity], list(demo.CONTEXTS))
        budget = int(14.0 * GIB)
        for c in capacity:
            self.assertEqual(
                c["no_offload"], demo.no_offload_requests(budget, c["context"])
            )
            self.assertAlmostEqual(c["gain"], c["offload"] / c["no_offload"])
            self.assertIn(
                f"| {c['context']} | {c['no_offload']} | {c['offload']} |", md
            )
        # The gain grows with the context (a region per request, whatever
        # its length) and is one at 128K.
        gains = [c["gain"] for c in capacity]
        self.assertEqual(gains, sorted(gains))
        self.assertGreater(gains[-1], 1.0)
        # The cost rows: the committed points measured for both.
        with open(demo.RANK_SPEED) as f:
            summary = json.load(f)
        both = set(summary["p4_itl_overhead"]) & set(summary["hisparse_itl_overhead"])
        self.assertEqual({f"{c['trace']}:{c['point']}" for c in result["cost"]}, both)
        self.assertTrue(both)
        for c in result["cost"]:
            key = f"{c['trace']}:{c['point']}"
            self.assertEqual(c["ours"], summary["p4_itl_overhead"][key])
            self.assertIn(f"| {c['trace']} | {c['point']} |", md)
            # Each figure names the release it was measured on.
            part = summary["by_sglang_version"][c["sglang"]]
            self.assertEqual(part["p4_itl_overhead"][key], c["ours"])
            part = summary["by_sglang_version"][c["sglang_hisparse"]]
            self.assertEqual(part["hisparse_itl_overhead"][key], c["hisparse"])
        self.assertIn("0.5.17", {c["sglang"] for c in result["cost"]})

    def test_bad_arguments(self):
        for argv in (["--kv-budget-gib", "0"], ["--host-pool-gb", "-1"]):
            with self.subTest(argv=argv), self.assertRaises(SystemExit) as done:
                with contextlib.redirect_stderr(io.StringIO()):
                    demo.parse_args(argv)
            self.assertEqual(done.exception.code, 2)


if __name__ == "__main__":
    unittest.main()
