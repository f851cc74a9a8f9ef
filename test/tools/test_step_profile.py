"""``benchmark/nsa_offload/server/step_profile.py``: the per-step breakdown of a
profiled decode window, and the glue that asks a server for it (CPU: a
synthetic chrome trace and a stand-in HTTP server)."""

import contextlib
import gzip
import io
import json
import os
import re
import sys
import tempfile
import threading
import time
import unittest
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmark" / "nsa_offload"
sys.path.insert(0, str(BENCH_DIR / "server"))

import bench_server  # noqa: E402
import step_profile  # noqa: E402

MAIN, SIDE, EARLY = 7, 20, 21


def kernel(name, ts, dur, stream=MAIN):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": {"stream": stream},
    }


def runtime(name, dur):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": 0, "dur": dur}


def two_steps():
    """Two decode steps: per step a graph launch of 3 model kernels plus the
    offload's swap and copy, the next layer's early swap and copy on another
    stream overlapping them, the backup; the scheduler's host time per step."""
    events = []
    for step, t0 in enumerate((0.0, 1000.0)):
        events += [
            kernel("fmha_model_kernel", t0, 100),
            kernel("_swap_select_kernel", t0 + 100, 20),
            kernel("_gather_rows_kernel", t0 + 120, 30),
            kernel("moe_kernel", t0 + 150, 200),
            kernel("rmsnorm", t0 + 350, 50),
            # the next layer's early swap, under the model's kernel
            kernel("_swap_select_kernel", t0 + 160, 20, EARLY),
            kernel("_gather_rows_kernel", t0 + 180, 40, EARLY),
            # backup after the forward
            kernel("_copy_rows_all_layers_kernel", t0 + 400, 10, SIDE),
            runtime("cudaGraphLaunch", 12),
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": "step[DECODE bs=8]",
                "ts": t0,
                "dur": 300 + 100 * step,
            },
            runtime("cudaLaunchKernel", 5),
            runtime("cudaLaunchKernel", 5),
            runtime("cudaStreamWaitEvent", 2),  # not a launch
        ]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 9})
    return events


class TestSummarize(unittest.TestCase):
    def test_categories(self):
        self.assertEqual(
            step_profile.kernel_category("_swap_select_kernel_0d1d"), "swap"
        )
        # The swap runs as several kernels (the multi-token ones in verify).
        for part in ("count", "rank", "copy_order", "multi_classify", "multi_assign"):
            self.assertEqual(
                step_profile.kernel_category(f"_swap_{part}_kernel"), "swap"
            )
        self.assertEqual(
            step_profile.kernel_category("load_cache_to_device_buffer_kernel<64>"),
            "hisparse",
        )
        self.assertEqual(step_profile.kernel_category("flash_fwd_kernel"), "other")

    def test_every_offload_kernel_has_a_category(self):
        # A kernel added to the offload without a category would hide in the
        # model's time ("other").
        src = BENCH_DIR.parents[1] / "python" / "sglang" / "srt" / "mem_cache"
        names = set()
        for path in src.glob("nsa_kv_offload_*.py"):
            names |= set(re.findall(r"^\s*def (_\w+_kernel)\(", path.read_text(), re.M))
        self.assertGreaterEqual(len(names), 9, sorted(names))
        for name in sorted(names):
            self.assertNotEqual(step_profile.kernel_category(name), "other", name)

    def test_per_step_sums(self):
        s = step_profile.summarize_events(two_steps(), steps=2)
        gpu = s["gpu_us_per_step"]
        # The early swap's kernels count with the others' (streams tell nothing).
        self.assertEqual(gpu["swap"], 40)
        self.assertEqual(gpu["h2d_copy"], 70)
        self.assertEqual(gpu["backup"], 10)
        self.assertEqual(set(gpu), {"swap", "h2d_copy", "backup", "other"})
        self.assertEqual(gpu["other"], 350)
        # Busy: [0, 400] + [400, 410] per step (the early swap overlaps).
        self.assertAlmostEqual(s["gpu_busy_ms_per_step"], 0.41)
        self.assertAlmostEqual(s["span_ms_per_step"], 1410 / 2 / 1e3)
        self.assertEqual(s["launches_per_step"], 2)
        self.assertEqual(s["graph_launches_per_step"], 1)
        self.assertEqual(s["launch_cpu_us_per_step"], 22)
        self.assertEqual(s["kernels_per_step"], 8)
        self.assertEqual(s["streams"], 3)
        self.assertAlmostEqual(s["host_step_ms"], 0.35)

    def test_layer_profile(self):
        # Two layers: top-k ends at 50, attention at 100 (gap 50), then
        # top-k ends at 260, attention at 290 (gap 30); the swap and copy on
        # a side stream between them.
        attn = "void sm90::decode::flash_fwd_splitkv_mla_fp8_sparse_kernel"
        events = [
            kernel("topk_kernel", 0, 50),
            kernel("_swap_rank_kernel", 50, 20, SIDE),
            kernel("_gather_rows_kernel", 70, 25, SIDE),
            kernel(attn, 100, 80),
            kernel("_topk_override_kernel", 200, 60),
            kernel("_gather_rows_kernel", 260, 15, SIDE),
            kernel(attn, 290, 80),
        ]
        p = step_profile.layer_profile(events, layers_per_step=2)
        self.assertEqual((p["layers"], p["steps"]), (2, 1.0))
        self.assertEqual(p["topk_to_attention_us"]["median"], 50)
        self.assertEqual(p["topk_to_attention_us"]["p10"], 30)
        self.assertEqual(
            p["offload_us_per_layer"],
            {"_gather_rows_kernel": 20.0, "_swap_rank_kernel": 10.0},
        )
        self.assertEqual(p["top_kernels_us_per_layer"][attn], 80)
        # Between top-k and attention: the gather in both layers (median of
        # 25 and 15: the upper one), the rank in one of two (half: kept).
        self.assertEqual(
            p["topk_to_attention_kernels_us"],
            {"_swap_rank_kernel": 20.0, "_gather_rows_kernel": 25.0},
        )
        self.assertIn("error", step_profile.layer_profile(two_steps(), 1))

    def test_no_kernels(self):
        s = step_profile.summarize_events([runtime("cudaLaunchKernel", 3)], steps=4)
        self.assertIn("error", s)

    def test_reads_gzipped_trace(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "x-TP-0.trace.json.gz")
            with gzip.open(path, "wt") as f:
                json.dump({"traceEvents": two_steps()}, f)
            s = step_profile.summarize_trace(path, steps=2)
        self.assertEqual(s["trace"], "x-TP-0.trace.json.gz")
        self.assertEqual(s["gpu_us_per_step"]["swap"], 40)

    def test_host_op_diff(self):
        base = two_steps()
        other = two_steps() + [runtime("cuLaunchKernelEx", 7)] * 2
        # Same calls, other durations: not a difference.
        other[-3] = dict(other[-3], dur=50)
        rows = step_profile.host_op_diff(base, other, steps=2)
        self.assertEqual(rows, [("cuLaunchKernelEx", 0.0, 1.0, 0.0, 7.0)])
        self.assertEqual(step_profile.host_op_diff(base, base, steps=2), [])

    def test_cli(self):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for i, events in enumerate(
                (two_steps(), two_steps() + [runtime("cuLaunchKernelEx", 7)])
            ):
                paths.append(os.path.join(d, f"{i}.trace.json.gz"))
                with gzip.open(paths[-1], "wt") as f:
                    json.dump({"traceEvents": events}, f)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                step_profile.main(["diff", *paths, "--steps", "2"])
                step_profile.main(["summary", paths[0], "--steps", "2"])
        text = out.getvalue()
        self.assertIn("| `cuLaunchKernelEx` | 0.00 | 0.50 | 0.0 | 3.5 |", text)
        self.assertIn('"host_step_ms": 0.35', text)
        # The ops both traces call equally often took the same CPU time.
        self.assertIn("(1.00x)", text)
        base = two_steps()
        slower = [dict(e, dur=2 * e["dur"]) for e in base]
        self.assertEqual(
            step_profile.shared_host_time(base, slower, steps=2)[1],
            2 * step_profile.shared_host_time(base, base, steps=2)[0],
        )


class _FakeProfilingServer(BaseHTTPRequestHandler):
    """Answers /start_profile like sglang: the trace appears after the steps."""

    requests = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body))
        os.makedirs(body["output_dir"], exist_ok=True)
        path = os.path.join(
            body["output_dir"], f"{body['profile_prefix']}.trace.json.gz"
        )
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": two_steps()}, f)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"Start profiling.\n")

    def log_message(self, *args):
        pass


class TestProfilePoint(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.httpd = HTTPServer(("127.0.0.1", 0), _FakeProfilingServer)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        log_path = os.path.join(self.tmp.name, "server.log")
        with open(log_path, "w") as f:
            f.write("[t] Decode batch, #running-req: 2, old line before the point\n")
        self.server = SimpleNamespace(
            log_path=log_path, url=f"http://127.0.0.1:{self.httpd.server_port}"
        )
        _FakeProfilingServer.requests = []

    def tearDown(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.tmp.cleanup()

    def _requests(self, batch):
        def run():
            time.sleep(0.2)  # prefill
            with open(self.server.log_path, "a") as f:
                f.write(f"[t] Decode batch, #running-req: {batch}, #token: 5\n")
            time.sleep(0.3)  # decoding while profiled
            return {"num_errors": 0}

        return run

    def test_profiles_once_the_batch_decodes(self):
        prof = step_profile.profile_point(
            self.server, self._requests(4), 4, 2, self.tmp.name, "ours_16384x4"
        )
        self.assertNotIn("error", prof)
        self.assertEqual(prof["gpu_us_per_step"]["swap"], 40)
        self.assertEqual(prof["requests_errors"], 0)
        ((path, body),) = _FakeProfilingServer.requests
        self.assertEqual(path, "/start_profile")
        self.assertEqual(body["num_steps"], 2)
        self.assertEqual(body["activities"], ["CPU", "GPU"])
        self.assertEqual(body["output_dir"], os.path.join(self.tmp.name, "profiles"))

    def test_batch_never_decoding_together(self):
        orig = step_profile._wait_for_decode
        step_profile._wait_for_decode = lambda *a, **k: orig(*a[:3], timeout=1.0)
        try:
            # The old line (batch 2, before the point) must not count.
            prof = step_profile.profile_point(
                self.server, self._requests(1), 2, 2, self.tmp.name, "x"
            )
        finally:
            step_profile._wait_for_decode = orig
        self.assertIn("no decode line with 2 running requests", prof["error"])
        self.assertEqual(_FakeProfilingServer.requests, [])


class TestBenchServerProfileOption(unittest.TestCase):
    def test_needs_no_record(self):
        with self.assertRaises(SystemExit):
            bench_server.parse_args(["--out", "/tmp/x", "--profile-steps", "20"])
        args = bench_server.parse_args(
            ["--out", "/tmp/x", "--profile-steps", "20", "--no-record"]
        )
        self.assertEqual(args.profile_steps, 20)
        # It must end while the point's requests still decode.
        with self.assertRaises(SystemExit):
            bench_server.parse_args(
                ["--out", "/tmp/x", "--no-record", "--profile-steps", "200"]
            )

    def test_table(self):
        ok = step_profile.summarize_events(two_steps(), steps=2)
        srv = {
            "ours": {"points": [{"ctx": 16384, "conc": 8, "profile": ok}]},
            "baseline": {
                "points": [{"ctx": 16384, "conc": 8, "profile": {"error": "boom"}}]
            },
        }
        lines = bench_server._profile_table(srv, ["baseline", "ours"])
        header = [l for l in lines if l.startswith("| context")][0]
        rows = [l for l in lines if l.startswith("| 16K")]
        self.assertEqual(len(rows), 2)
        for row in rows:
            self.assertEqual(row.count("|"), header.count("|"))
        self.assertIn("boom", rows[0])
        cells = [c.strip() for c in rows[1].strip("|").split("|")]
        self.assertEqual(cells[:5], ["16K", "8", "ours", "0.35", "0.41"])
        self.assertEqual(cells[5:10], ["40", "70", "10", "0", "350"])
        self.assertEqual(
            bench_server._profile_table({"ours": {"points": []}}, ["ours"]), []
        )


if __name__ == "__main__":
    unittest.main()
