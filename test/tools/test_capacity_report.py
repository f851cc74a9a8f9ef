"""The measured-capacity report of ``benchmark/nsa_offload/server/capacity.py`` (CPU).

The end-to-end script itself needs a GPU; what it derives from the server
logs does not: the per-phase peak of ``#running-req``, the pool memory and
budget from sglang's startup lines, and the table rebuilt from the committed
H200 runs (one of them cut by the device's time limit before its JSON).
"""

import json
import os
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "benchmark" / "nsa_offload"
RESULTS = BENCH_DIR / "results" / "capacity_colocated"
sys.path.insert(0, str(BENCH_DIR / "server"))

import capacity  # noqa: E402
from capacity import scan_log  # noqa: E402

STARTUP = """\
[t] Load weight begin. avail mem=139.13 GB
[t] Load weight end. elapsed=0.20 s, type=X, avail mem=138.62 GB, mem usage=0.51 GB.
[t] NSA KV offload: 8000 logical token locs (host capacity 9000), 7 decode regions of 4160 rows (4096 LRU + 64 window), 100 staging rows, 29184 GPU KV rows per layer.
[t] Capture cuda graph begin. This can take up to several minutes. avail mem=134.52 GB
"""


def decode_line(running: int) -> str:
    return f"[t] Decode batch, #running-req: {running}, #token: 1, gen throughput (token/s): 1.0\n"


class TestLogParsing(unittest.TestCase):
    def setUp(self):
        fd, self.path = tempfile.mkstemp(suffix=".log")
        os.close(fd)
        self.addCleanup(os.remove, self.path)

    def test_memory_and_budget(self):
        with open(self.path, "w") as f:
            f.write(STARTUP)
        mem = capacity.memory_from_log(self.path, mem_fraction=0.0324)
        self.assertAlmostEqual(mem["pools_gib"], 138.62 - 134.52, places=3)
        # sglang: after weights - before weights x (1 - f)
        self.assertAlmostEqual(mem["budget_gib"], 138.62 - 139.13 * (1 - 0.0324), 3)

    def test_peak_counts_from_the_phase_start(self):
        with open(self.path, "w") as f:
            f.write(STARTUP + decode_line(40) + decode_line(12))
        start = os.path.getsize(self.path)
        with open(self.path, "a") as f:
            f.write(decode_line(9) + decode_line(25) + decode_line(3))
        peak, locs, regions = scan_log(self.path)
        self.assertEqual((peak, locs, regions), (40, 8000, 7))
        self.assertEqual(scan_log(self.path, start)[0], 25)
        self.assertEqual(scan_log(self.path, os.path.getsize(self.path))[0], 0)


def _server(peak, pools_gib, length=131072, sent=20):
    return {
        "capacity": {
            str(length): {
                "length": length,
                "new_tokens": 128,
                "peak_running": peak,
                "regions": None,
                "sent": sent,
                "completed": sent,
            }
        },
        "memory": {"pools_gib": pools_gib},
    }


class TestHiSparseColumns(unittest.TestCase):
    def test_ours_vs_hisparse_at_equal_bytes(self):
        base, ours, his = _server(15, 4.6), _server(66, 4.0), _server(60, 6.0)
        (row,) = capacity.capacity_rows(base, {"131072": ours}, 4160, his)
        self.assertEqual(row["hisparse_peak"], 60)
        self.assertAlmostEqual(row["vs_hisparse_same_fraction"], 66 / 60)
        # HiSparse rescaled to ours' 4.0 GiB: 60 x 4/6 = 40 requests.
        self.assertAlmostEqual(row["vs_hisparse_equal_bytes"], 66 / 40)
        self.assertAlmostEqual(row["ratio_equal_bytes"], 66 / (15 * 4.0 / 4.6))
        with tempfile.TemporaryDirectory() as out:
            capacity.write_capacity_report([row], out, "decode_only")
            with open(os.path.join(out, "capacity.md")) as f:
                header, sep, line = f.read().splitlines()
        self.assertIn("model (decode_only)", header)
        self.assertIn("HiSparse: peak running", header)
        self.assertEqual(header.count("|"), sep.count("|"))
        self.assertEqual(header.count("|"), line.count("|"))
        self.assertIn("| 1.65 |", line)

    def test_unsaturated_phase_is_marked(self):
        base, ours = _server(15, 4.6), _server(6, 4.0)
        ours["capacity"]["131072"]["saturated"] = False
        (row,) = capacity.capacity_rows(base, {"131072": ours}, 4160)
        self.assertFalse(row["offload_saturated"])
        with tempfile.TemporaryDirectory() as out:
            capacity.write_capacity_report([row], out)
            with open(os.path.join(out, "capacity.md")) as f:
                line = f.read().splitlines()[2]
        self.assertIn("| 6 (not saturated) |", line)
        self.assertIn("| 15 |", line)


class TestCapacityReport(unittest.TestCase):
    def test_cut_run_is_read_from_its_driver_log(self):
        base, offload, _ = capacity.load_run(str(RESULTS / "run_a"), new_tokens=128)
        self.assertEqual(
            {k: c["peak_running"] for k, c in base["capacity"].items()},
            {"16384": 120, "32768": 60, "65536": 30, "131072": 15},
        )
        # the 64K offload phase was cut before its peak was printed: left out
        self.assertEqual(
            {k: r["capacity"][k]["peak_running"] for k, r in offload.items()},
            {"16384": 254, "32768": 177},
        )
        self.assertIsNone(offload["16384"]["capacity"]["16384"]["completed"])
        self.assertEqual(offload["16384"]["capacity"]["16384"]["regions"], 262)

    def test_report_reproduces_the_committed_table(self):
        with tempfile.TemporaryDirectory() as out:
            argv = [
                "capacity.py",
                "report",
                "--out",
                out,
                "--context-length",
                "131584",
                "--capacity-new-tokens",
                "128",
                str(RESULTS / "run_a"),
                str(RESULTS / "run_b"),
            ]
            with mock.patch.object(sys, "argv", argv):
                capacity.main()
            with open(os.path.join(out, "capacity.json")) as f:
                rows = json.load(f)["rows"]
        with open(RESULTS / "capacity.json") as f:
            committed = json.load(f)["rows"]
        keys = ("length", "baseline_peak", "offload_peak", "offload_regions")
        self.assertEqual(
            [[r[k] for k in keys] for r in rows],
            [[r[k] for k in keys] for r in committed],
        )
        for r, c in zip(rows, committed):
            self.assertAlmostEqual(r["ratio_equal_bytes"], c["ratio_equal_bytes"])
            self.assertAlmostEqual(r["bound"], c["bound"])
            # the region count the sizing model gave the server (run_b stores
            # it; run_a's is recomputed, and the sizing has since reserved a
            # staging page per region beyond 64: never more regions)
            if r["offload_run"].endswith("run_b"):
                self.assertEqual(r["model"]["colocated"], r["offload_regions"])
            else:
                self.assertLessEqual(r["model"]["colocated"], r["offload_regions"])
            self.assertLess(r["ratio_equal_bytes"], r["bound"])


class TestThroughputAtCapacity(unittest.TestCase):
    """Decode throughput while a server held its peak, per capacity phase."""

    @staticmethod
    def line(running, tokens, tok_s, graph=True, hit=None):
        tail = "" if hit is None else f", #queue-req: 0, nsa-offload hit rate: {hit}"
        return (
            f"[t] Decode batch, #running-req: {running}, #token: {tokens}, token "
            f"usage: 0.9, cuda graph: {graph}, gen throughput (token/s): {tok_s}"
            f"{tail}\n"
        )

    def test_phases_told_apart_by_tokens_per_request(self):
        result = {
            "capacity": {
                "65536": {"length": 65536, "new_tokens": 2048, "peak_running": 20},
                "32768": {"length": 32768, "new_tokens": 2048, "peak_running": 40},
            }
        }
        lines = [
            self.line(20, 20 * 66000, 1000.0, hit=0.9),
            self.line(19, 19 * 67000, 3000.0, hit=0.7),
            self.line(18, 18 * 66000, 9999.0),  # below 0.95 x peak: dropped
            self.line(20, 20 * 34000, 7777.0),  # 32K phase, below its peak
            self.line(40, 40 * 34000, 5000.0, graph=False),
            self.line(39, 39 * 33500, 6000.0, graph=True),
        ]
        fd, path = tempfile.mkstemp(suffix=".log")
        os.close(fd)
        self.addCleanup(os.remove, path)
        with open(path, "w") as f:
            f.write(STARTUP + "".join(lines))
        long = capacity.throughput_at_capacity(path, result, "65536")
        self.assertEqual(long["log_lines"], 2)
        self.assertEqual(long["tokens_per_s"], 2000.0)
        self.assertEqual(long["running"], 19.5)
        self.assertAlmostEqual(long["offload_hit_rate"], 0.8)
        self.assertAlmostEqual(long["step_ms"], 1000 * 19.5 / 2000)
        short = capacity.throughput_at_capacity(path, result, "32768")
        self.assertEqual(short["log_lines"], 2)
        self.assertEqual(short["tokens_per_s"], 5500.0)
        self.assertEqual(short["cuda_graph_share"], 0.5)
        self.assertIsNone(short["offload_hit_rate"])

    def test_hisparse_logs_cpu_tokens(self):
        line = (
            "[t] Decode batch, #running-req: 58, #gpu token: 241280, gpu token "
            "usage: 0.12, #cpu token: 7840000, cpu token usage: 0.9, cuda graph: "
            "True, gen throughput (token/s): 19370.5, #queue-req: 0\n"
        )
        m = capacity.DECODE_LINE_RE.search(line)
        self.assertEqual(m.group(1, 2, 3, 4), ("58", "7840000", "True", "19370.5"))

    def test_committed_pd_decode_run(self):
        # The measured PD decode runs: peaks, HiSparse from the run that ran
        # it alone, and the throughput table rebuilt from the logs.
        pd = RESULTS.parent / "capacity_pd_decode"
        with open(pd / "capacity.json") as f:
            committed = json.load(f)["rows"]
        with tempfile.TemporaryDirectory() as out:
            argv = ["capacity.py", "report", "--pd-decode", "--out", out]
            argv += ["--context-length", "135680", "--capacity-new-tokens", "2048"]
            argv += [str(pd / d) for d in ("run_128k", "run_64k_32k", "run_16k")]
            argv += [str(pd / "run_hisparse_64k_32k")]
            with mock.patch.object(sys, "argv", argv):
                capacity.main()
            with open(os.path.join(out, "capacity.json")) as f:
                rows = json.load(f)["rows"]
        keys = ("length", "baseline_peak", "offload_peak", "hisparse_peak")
        self.assertEqual(
            [[r[k] for k in keys] for r in rows],
            [
                [16384, 105, 257, 426],
                [32768, 56, 184, 222],
                [65536, 29, 116, 109],
                [131072, 14, 65, 58],
            ],
        )
        for r, c in zip(rows, committed):
            self.assertEqual(r["throughput"], c["throughput"])
            self.assertGreaterEqual(r["equal_bytes_vs_bound"], 0.9)
        self.assertGreaterEqual(rows[-1]["ratio_equal_bytes"], 5.0)

    def test_committed_pd_decode_run_at_equal_bytes(self):
        # P5 at 128K: ours at the no-offload fraction, then at the fraction
        # that gives it the no-offload server's bytes (a --baseline-from run:
        # the no-offload figures and log come from the first run).
        run = RESULTS.parent / "throughput_pd_decode" / "run2_solo"
        with tempfile.TemporaryDirectory() as out:
            argv = ["capacity.py", "report", "--pd-decode", "--out", out]
            argv += ["--context-length", "135680", "--capacity-new-tokens", "4096"]
            argv += [str(run / "same_fraction"), str(run / "equal_bytes")]
            with mock.patch.object(sys, "argv", argv):
                capacity.main()
            with open(os.path.join(out, "capacity.json")) as f:
                rows = json.load(f)["rows"]
        self.assertEqual([r["offload_peak"] for r in rows], [65, 74])
        self.assertEqual([r["baseline_peak"] for r in rows], [14, 14])
        self.assertTrue(all(r["baseline_run"].endswith("same_fraction") for r in rows))
        tput = [r["throughput"] for r in rows]
        self.assertTrue(all(t["baseline"]["running"] == 14 for t in tput))
        ratios = [
            t["offload"]["tokens_per_s"] / t["baseline"]["tokens_per_s"] for t in tput
        ]
        self.assertGreaterEqual(min(ratios), 3.0)
        self.assertGreater(
            tput[1]["offload"]["tokens_per_s"], tput[0]["offload"]["tokens_per_s"]
        )


class TestOffloadLogLine(unittest.TestCase):
    def test_with_and_without_prefetch(self):
        import e2e_server

        lines = [
            decode_line(3).rstrip("\n") + ", nsa-offload hit rate: 0.810, misses: 42, "
            "H2D: 1.50 GB/s, regions: 3/8\n",
            decode_line(4).rstrip("\n") + ", nsa-offload hit rate: 0.900, misses: 7, "
            "prefetched: 30, H2D: 2.00 GB/s, regions: 4/8\n",
        ]
        with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
            f.writelines(lines)
        try:
            rows = e2e_server.parse_offload_log(f.name)
        finally:
            os.remove(f.name)
        self.assertEqual([(r["running"], r["misses"]) for r in rows], [(3, 42), (4, 7)])
        self.assertEqual(rows[1]["h2d_gbps"], 2.0)


class TestServerCommand(unittest.TestCase):
    """What the servers of an e2e run are launched with, as sglang's own CLI
    parser reads it (the later of two equal flags wins)."""

    def _launch_args(self, argv):
        import argparse

        import e2e_server
        from server_utils import BASE_ARGS
        from sglang.srt.server_args import ServerArgs

        args = e2e_server.parse_args(["--out", "unused"] + argv)
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        cmd = ["--model-path", "m", *BASE_ARGS, *e2e_server.common_server_args(args)]
        return parser.parse_args(cmd)

    def test_kv_cache_dtype(self):
        # 0.5.17 stores the --nsa-*-backend flags into its dsa_*_backend fields.
        from sglang.srt.mem_cache.nsa_kv_offload_compat import (
            DECODE_BACKEND_FIELD as DECODE,
        )
        from sglang.srt.mem_cache.nsa_kv_offload_compat import (
            PREFILL_BACKEND_FIELD as PREFILL,
        )

        fp8 = self._launch_args([])
        self.assertEqual(fp8.kv_cache_dtype, "fp8_e4m3")
        self.assertEqual(getattr(fp8, DECODE), "flashmla_kv")
        bf16 = self._launch_args(["--kv-cache-dtype", "bfloat16"])
        self.assertEqual(bf16.kv_cache_dtype, "bfloat16")
        self.assertEqual(getattr(bf16, PREFILL), "flashmla_sparse")
        self.assertEqual(getattr(bf16, DECODE), "flashmla_sparse")
        self.assertEqual(bf16.mem_fraction_static, 0.7)

    def test_offload_budget_at_another_fraction(self):
        import e2e_server

        # sglang's budget: after weights - before x (1 - f); session 6's
        # no-offload server logged 139.13 / 138.62 GB and had 3.998 at 0.0324.
        base = {"memory": {"before_weights": 139.13, "after_weights": 138.62}}
        self.assertAlmostEqual(e2e_server.offload_budget_at(base, 0.0324), 3.998)
        self.assertAlmostEqual(e2e_server.offload_budget_at(base, 0.0360), 4.499)
        with self.assertRaises(SystemExit):
            e2e_server.offload_budget_at({"memory": {}}, 0.036)
        with self.assertRaises(SystemExit):
            e2e_server.offload_budget_at(None, 0.036)

    def test_pd_decode_reserves_the_output(self):
        parsed = self._launch_args(
            ["--pd-decode", "--num-requests", "0", "--capacity-new-tokens", "4096"]
        )
        self.assertEqual(parsed.disaggregation_mode, "decode")
        self.assertEqual(parsed.num_reserved_decode_tokens, 4096)

    def test_bf16_refuses_hisparse(self):
        import e2e_server

        with tempfile.TemporaryDirectory() as out:
            argv = ["e2e_server.py", "--out", out, "--kv-cache-dtype", "bfloat16"]
            with mock.patch.object(
                sys, "argv", argv + ["--servers", "baseline,hisparse"]
            ):
                with self.assertRaises(SystemExit) as ctx:
                    e2e_server.main()
        self.assertIn("fp8 KV only", str(ctx.exception))


class TestPredictCapacity(unittest.TestCase):
    def test_caps(self):
        import e2e_server

        predict = e2e_server.predict_capacity
        self.assertEqual(predict("baseline", 1987584, None, 131200), 15)
        self.assertEqual(predict("offload_128k", 8926400, 68, 131200), 68)
        # HiSparse: 4x logical locs, 4160 device rows per request, its slots.
        self.assertEqual(predict("hisparse", 1987584, None, 131200), 60)
        self.assertEqual(predict("hisparse", 1987584, None, 16512), 477)
        self.assertEqual(predict("hisparse", 1987584, None, 16512, slots=300), 300)


class TestPoolReport(unittest.TestCase):
    """Capacity from the pool sizes the servers logged (``pool-report``)."""

    def _rows(self, pd_decode, *runs):
        with tempfile.TemporaryDirectory() as out:
            argv = ["capacity.py", "pool-report", "--out", out, "--new-tokens", "128"]
            argv += ["--pd-decode"] * pd_decode + [str(r) for r in runs]
            with mock.patch.object(sys, "argv", argv):
                capacity.main()
            with open(os.path.join(out, "pool_capacity.json")) as f:
                return json.load(f)["rows"]

    def test_equals_the_measured_colocated_peaks(self):
        runs = ("run_a", "run_b", "run_c")
        rows = self._rows(False, *(RESULTS / run for run in runs))
        measured = {}
        for run in runs:
            path = RESULTS / run / "driver.log"
            for m in capacity.DRIVER_PEAK_RE.finditer(path.read_text()):
                measured[(run, m.group(1), int(m.group(2)))] = int(m.group(3))
        self.assertEqual(len(rows), 7)  # run_a cut during its 64K phase
        compared = 0
        for r in rows:
            run, L = r["run"], r["length"]
            for kind, name in (
                ("baseline", "baseline"),
                ("ours", f"offload_{L >> 10}k"),
            ):
                if (run, name, L) in measured:  # phases the runs completed
                    self.assertEqual(r[kind], measured[(run, name, L)])
                    compared += 1
        self.assertEqual(compared, 11)

    def test_pd_decode_servers(self):
        pd = RESULTS.parent / "capacity_pd_decode" / "from_pool_sizes"
        rows = self._rows(True, pd / "run_16k_64k", pd / "run_128k")
        by_len = {r["length"]: r for r in rows}
        r = by_len[131072]
        self.assertEqual((r["baseline"], r["ours"], r["hisparse"]), (15, 68, 60))
        self.assertAlmostEqual(
            r["ours_vs_baseline_equal_bytes"], (68 / 4.1) / (15 / 4.61), places=6
        )
        self.assertGreaterEqual(r["ours_vs_baseline_equal_bytes"], 5.0)
        self.assertLess(r["ours_vs_baseline_equal_bytes"], r["bound"])
        # HiSparse ran with 300 request slots; its pools hold more at 16K.
        self.assertEqual(by_len[16384]["hisparse"], 477)
        self.assertEqual(by_len[16384]["hisparse_slots"], 300)


if __name__ == "__main__":
    unittest.main()
