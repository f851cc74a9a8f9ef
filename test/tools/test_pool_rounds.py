"""``benchmark/nsa_offload/server/pool_rounds.py``: pooling the paired rounds of
several interleaved server benchmark runs (CPU)."""

import json
import sys
import tempfile
import unittest
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmark" / "nsa_offload"
sys.path.insert(0, str(BENCH_DIR / "server"))

import pool_rounds  # noqa: E402

# The P4 runs of record: three interleaved 32K x 8 runs and their pooled table.
DECODE_LATENCY = BENCH_DIR / "results" / "decode_latency"


def point(ctx, conc, itls, interleaved=True, misses=None):
    return {
        "ctx": ctx,
        "conc": conc,
        "at_capacity": False,
        "interleaved": interleaved,
        "server": {"misses_per_step": misses},
        "server_runs": [{"itl_ms": v} for v in itls],
        "client": {},
    }


def run(buffer_size, base_itls, ours_itls, ctx=16384, conc=32, topk="override"):
    return {
        "config": {"buffer_size": buffer_size, "topk": topk},
        "servers": {
            "baseline": {"points": [point(ctx, conc, base_itls)]},
            "ours": {"points": [point(ctx, conc, ours_itls, misses=100.0)]},
        },
    }


class TestPoolRuns(unittest.TestCase):
    def test_rounds_of_one_configuration_pool(self):
        a = run(None, [1.0, 2.0, 1.0], [1.1, 2.2, 1.1])  # +10% every round
        b = run(None, [1.0, 1.0], [1.3, 1.3])  # +30%
        rows = pool_rounds.pool_runs([a, b], ["a", "b"])
        self.assertEqual(len(rows), 1)
        row = rows[0]
        self.assertEqual((row["server"], row["buffer_rows"]), ("ours", 4096))
        self.assertEqual(row["rounds"], 5)
        # Pooled ratios 1.1, 1.1, 1.1, 1.3, 1.3: median 1.1, not the mean of
        # the two runs' medians.
        self.assertAlmostEqual(row["overhead"], 0.1)
        self.assertAlmostEqual(row["overhead_iqr"][1], 0.3)
        self.assertEqual([r["run"] for r in row["runs"]], ["a", "b"])
        self.assertAlmostEqual(row["runs"][1]["overhead"], 0.3)

    def test_configurations_stay_apart(self):
        rows = pool_rounds.pool_runs(
            [
                run(None, [1.0], [1.3]),
                run(12288, [1.0], [1.05]),
                run(12288, [1.0], [1.2], topk="model"),
                run(12288, [1.0], [1.1], ctx=32768),
            ],
            ["a", "b", "c", "d"],
        )
        keys = [(r["buffer_rows"], r["topk"], r["ctx"]) for r in rows]
        self.assertEqual(
            keys,
            [
                (4096, "override", 16384),
                (12288, "model", 16384),
                (12288, "override", 16384),
                (12288, "override", 32768),
            ],
        )

    def test_runs_without_pairs_are_left_out(self):
        sequential = run(None, [1.0], [1.3])
        sequential["servers"]["ours"]["points"][0]["interleaved"] = False
        no_baseline = run(None, [1.0], [1.3])
        del no_baseline["servers"]["baseline"]
        self.assertEqual(pool_rounds.pool_runs([sequential, no_baseline], "ab"), [])
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / "r.json"
            f.write_text(json.dumps(sequential))
            self.assertEqual(pool_rounds.main([str(f)]), 1)

    def test_cli_writes_the_table(self):
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / "run1" / "bench.json"
            f.parent.mkdir()
            f.write_text(json.dumps(run(12288, [1.0, 1.0], [1.1, 1.1])))
            out, js = Path(d) / "p.md", Path(d) / "p.json"
            self.assertEqual(
                pool_rounds.main([str(f), "--out", str(out), "--json", str(js)]), 0
            )
            self.assertIn(
                "| ours | 12288 | override | 16K | 32 | 1 | 2 | +10.0%", out.read_text()
            )
            self.assertEqual(json.loads(js.read_text())[0]["runs"][0]["run"], "run1")
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                return
            png = Path(d) / "servers.png"
            self.assertEqual(pool_rounds.main([str(f), "--png-servers", str(png)]), 0)
            self.assertTrue(png.read_bytes().startswith(b"\x89PNG"))

    def test_units_of_each_server(self):
        # Runs before units were ours' default record no ours_max_units.
        self.assertEqual(pool_rounds.ours_units({}, "ours"), 1)
        self.assertEqual(pool_rounds.ours_units({"ours_max_units": 4}, "ours"), 4)
        self.assertEqual(pool_rounds.ours_units({"ours_max_units": 4}, "ours_fixed"), 1)
        self.assertEqual(pool_rounds.ours_units({"max_units": 4}, "ours_units"), 4)


def rebuild_committed(test, folder: Path, pattern: str):
    """Pool a committed results folder's runs; its pooled.md must be what
    they give. Returns the pooled rows."""
    files = sorted(folder.glob(pattern))
    results = [json.loads(f.read_text()) for f in files]
    rows = pool_rounds.pool_runs(results, [f.parent.name for f in files])
    test.assertEqual(
        pool_rounds.render_markdown(rows), (folder / "pooled.md").read_text()
    )
    return rows


class TestCommittedDecodeLatency(unittest.TestCase):
    """results/decode_latency/pooled.md comes from its three 32K x 8 runs
    (the swap split by unit)."""

    def test_pooled_table_matches_the_committed_one(self):
        (row,) = rebuild_committed(
            self, DECODE_LATENCY, "p4_32k8_run*/bench_server_*.json"
        )
        self.assertEqual((row["ctx"], row["conc"], row["rounds"]), (32768, 8, 103))
        self.assertEqual([r["rounds"] for r in row["runs"]], [29, 14, 60])
        self.assertLess(row["overhead_ci95"][1], 0.1)


if __name__ == "__main__":
    unittest.main()
