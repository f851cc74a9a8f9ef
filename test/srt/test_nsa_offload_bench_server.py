"""What ``benchmark/nsa_offload/bench_server.py`` reads from server logs and how
it combines repeated runs (CPU; the servers themselves need a GPU)."""

import sys
import unittest
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmark" / "nsa_offload"
sys.path.insert(0, str(BENCH_DIR))

import bench_server  # noqa: E402


def decode_line(running, throughput, queue=0, misses=None, prefetched=None):
    line = (
        f"[t] Decode batch, #running-req: {running}, #token: 9, token usage: 0.5, "
        f"cuda graph: True, gen throughput (token/s): {throughput}, "
        f"#queue-req: {queue}"
    )
    if misses is not None:
        extra = "" if prefetched is None else f"prefetched: {prefetched}, "
        line += (
            f", nsa-offload hit rate: 0.800, misses: {misses}, {extra}"
            "H2D: 3.00 GB/s, regions: 4/8"
        )
    return line


class TestOverrideTraceLayers(unittest.TestCase):
    def test_generated_trace_holds_the_chosen_layers(self):
        import tempfile

        import trace_format

        with tempfile.TemporaryDirectory() as out:
            argv = ["--out", out, "--topk", "override", "--contexts", "4096"]
            argv += ["--trace-steps", "3", "--trace-layers", "29,30,31"]
            args = bench_server.parse_args(argv)
            bench_server.prepare_trace(args)
            trace = trace_format.load_trace(args.trace)
        self.assertEqual(trace.layer_ids.tolist(), [29, 30, 31])
        self.assertEqual(trace.topk.shape[0], 3)
        default = bench_server.parse_args(["--out", "/tmp/x"])
        self.assertEqual(default.trace_layers, "0,30,60")


class TestCrossLayerPrefetchOption(unittest.TestCase):
    def test_env_and_log(self):
        args = bench_server.parse_args(["--out", "/tmp/x", "--cross-layer-prefetch"])
        args.record = False
        env_var = "SGLANG_NSA_KV_OFFLOAD_CROSS_LAYER_PREFETCH"
        self.assertEqual(bench_server.server_env(args, "ours")[env_var], "1")
        for kind in ("baseline", "hisparse"):
            self.assertNotIn(env_var, bench_server.server_env(args, kind))
        plain = bench_server.parse_args(["--out", "/tmp/x"])
        plain.record = False
        self.assertNotIn(env_var, bench_server.server_env(plain, "ours"))
        # The decode log line with prefetch still parses (demand misses).
        m = bench_server.OFFLOAD_RE.search(
            decode_line(4, 100.0, misses=77, prefetched=9)
        )
        self.assertEqual(m.group(2), "77")


class TestPrefetchServerSideBySide(unittest.TestCase):
    ENV_VAR = "SGLANG_NSA_KV_OFFLOAD_CROSS_LAYER_PREFETCH"

    def test_same_flags_plus_the_env_var(self):
        argv = ["--out", "/tmp/x", "--servers", "baseline,ours,ours_prefetch"]
        args = bench_server.parse_args(argv)
        args.record = False
        args.host_pool_gb = 8
        args.max_running_requests = 4
        args.mem_fraction_static = 0.03
        specs = bench_server.server_specs(args)
        self.assertEqual(specs["ours_prefetch"], specs["ours"])
        self.assertEqual(
            bench_server.server_env(args, "ours_prefetch")[self.ENV_VAR], "1"
        )
        self.assertNotIn(self.ENV_VAR, bench_server.server_env(args, "ours"))
        self.assertEqual(
            bench_server.parse_args(["--out", "/tmp/x"]).servers,
            "baseline,ours,hisparse",
        )

    def test_unknown_server_is_refused(self):
        import tempfile

        with tempfile.TemporaryDirectory() as out:
            with self.assertRaises(SystemExit) as ctx:
                bench_server.main(["--out", out, "--servers", "ours,ours_prefech"])
        self.assertIn("ours_prefech", str(ctx.exception))

    def test_report_has_a_misses_column_per_offload_server(self):
        def point(itl, misses):
            server = {"throughput_tok_s": 1000.0 / itl, "itl_ms": itl}
            if misses is not None:
                server.update(
                    misses_per_step=3 * misses, misses_per_req_layer_step=misses
                )
            return {
                "ctx": 16384,
                "conc": 1,
                "at_capacity": False,
                "server": server,
                "client": {},
            }

        result = {
            "config": {
                "topk": "override",
                "trace": "/tmp/t.npz",
                "mode": "quick",
                "kv_budget_gib": 4.0,
                "mem_fraction_static": 0.03,
                "mem_fraction_how": "given",
                "max_running_requests": 8,
                "new_tokens": 256,
                "repeats": 3,
                "decode_log_interval": 32,
                "layers": 3,
                "started": "now",
                "wall_s": 1.0,
                "cap_contexts": [],
            },
            "servers": {
                "baseline": {"points": [point(1.5, None)]},
                "ours": {"points": [point(1.8, 1100)]},
                "ours_prefetch": {"points": [point(1.7, 430)]},
            },
        }
        md = bench_server.render_markdown([result])
        self.assertIn("ours misses/step (per req-layer)", md)
        self.assertIn("ours + prefetch misses/step (per req-layer)", md)
        row = next(l for l in md.splitlines() if l.startswith("| 16K | 1 |"))
        self.assertIn("| 3300 (1100) | 1290 (430) |", row)
        header = next(l for l in md.splitlines() if l.startswith("| context | batch"))
        self.assertEqual(header.count("|"), row.count("|"))
        # P4 says what the misses' copy alone costs: 3300 x 656 B at 48 GB/s
        # = 0.045 ms, 3% of the no-offload step.
        p4 = next(l for l in md.splitlines() if l.startswith("- **P4**"))
        self.assertIn("16K x 1: +20.0%", p4)
        self.assertIn("the misses' copy alone 0.05 ms = +3% at 48 GB/s", p4)
        rows = bench_server.evaluate_targets(result)["P4"]["rows"]
        self.assertAlmostEqual(rows[0]["miss_copy_ms"], 3300 * 656 / 48e9 * 1e3)


class TestDecodeLog(unittest.TestCase):
    def test_figures_at_the_full_batch(self):
        text = "\n".join(
            [
                decode_line(2, 100.0, queue=2),  # still admitting
                decode_line(4, 150.0, misses=999),  # first line at 4: has a prefill
                decode_line(4, 400.0, misses=4 * 32 * 3 * 100),
                decode_line(4, 420.0, misses=4 * 32 * 3 * 120),
                decode_line(4, 380.0, misses=4 * 32 * 3 * 110),
                "[t] Prefill batch, #new-seq: 1",
                decode_line(1, 90.0, misses=10),  # draining
            ]
        )
        rows = bench_server.parse_decode_lines(text)
        self.assertEqual(len(rows), 6)
        m = bench_server.server_metrics(rows, interval=32, layers=3)
        self.assertEqual(m["peak_running"], 4)
        self.assertEqual(m["lines_used"], 3)  # the ones after a line at 4
        self.assertEqual(m["throughput_tok_s"], 400.0)
        self.assertAlmostEqual(m["itl_ms"], 1000.0 * 4 / 400.0)
        self.assertAlmostEqual(m["misses_per_req_layer_step"], 110.0)
        self.assertAlmostEqual(m["misses_per_step"], 4 * 3 * 110.0)


class TestRepeats(unittest.TestCase):
    def test_median_of_runs(self):
        runs = [
            {"itl_ms": 2.0, "peak_running": 8, "misses": None, "note": "a"},
            {"itl_ms": 9.0, "peak_running": 8, "misses": 30, "note": "b"},
            {"itl_ms": 3.0, "peak_running": 8, "misses": 10, "note": "c"},
        ]
        out = bench_server.median_of_runs(runs)
        self.assertEqual(out["itl_ms"], 3.0)  # an outlier run does not move it
        self.assertEqual(out["peak_running"], 8)
        self.assertEqual(out["misses"], 20)  # over the runs that have a number
        self.assertEqual(out["note"], "c")  # non-numbers: the last run's
        self.assertEqual(out["runs"], 3)
        self.assertEqual(
            bench_server.median_of_runs([{"itl_ms": None}])["itl_ms"], None
        )


if __name__ == "__main__":
    unittest.main()
