"""The GPU soak's tooling (benchmark/nsa_offload/server/soak.py) on the CPU.

* the workload: prompt lengths within bounds and log-uniform (skewed short),
  output lengths within bounds, exactly the asked share of client aborts,
  the same for the same seed;
* the client against a fake server (stdlib HTTP): completed requests,
  streams closed by the client, server errors told from client errors, the
  load samples and host-pool gauge read while the soak runs;
* ``waited_on_host_pool``: pool-bound samples and the requests whose wait
  contains one;
* the log parser on synthetic sglang log lines (retractions, leak reports,
  tracebacks, OOM aborts, usage and queue, pool sizes);
* the summary: the issue's keys first and in order, ``crashed`` and
  ``probe_identical`` from their parts, the criteria, ``--report``.
"""

import contextlib
import gzip
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "benchmark" / "nsa_offload"
sys.path.insert(0, str(BENCH_DIR / "server"))

import server_utils  # noqa: E402
import soak  # noqa: E402

# ---------------------------------------------------------------- fake server

# A first prompt token past the vocab (random prompts never have one):
ERROR_500 = 5000  # HTTP 500
ERROR_400 = 5001  # HTTP 400
SERVER_ABORT = 5002  # finish_reason abort


class FakeSglang(BaseHTTPRequestHandler):
    """/generate (one token per stream chunk), /get_load, /get_server_info, /metrics,
    /health; the pool is full while requests run, empty when none does."""

    protocol_version = "HTTP/1.0"
    in_flight = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _json(self, obj, code=200):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        n = FakeSglang.in_flight
        if self.path.startswith("/v1/loads"):
            # as on the GPU host with --enable-metrics: not to be relied on
            self._json({"detail": "AttributeError"}, 500)
        elif self.path == "/get_server_info":
            self._json({"max_total_num_tokens": 100, "version": "x"})
        elif self.path == "/get_load":
            used = 90 if n else 0
            waiting = max(n - 2, 0)
            self._json(
                [
                    {
                        "dp_rank": 0,
                        "num_reqs": min(n, 2) + waiting,
                        "num_waiting_reqs": waiting,
                        "num_tokens": used + 20 * waiting,
                        "num_pending_tokens": 20 * waiting,
                        "ts_tic": 0.0,
                    }
                ]
            )
        elif self.path == "/metrics":
            body = (
                "# HELP x\n"
                'sglang:nsa_kv_offload_host_pool_used_tokens{a="b"} 96.0\n'
                'sglang:nsa_kv_offload_host_pool_total_tokens{a="b"} 100.0\n'
                'sglang:num_requests_total{a="b"} 7.0\n'
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._json({})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        first = req["input_ids"][0]
        if first == ERROR_500:
            return self._json({"detail": "boom"}, 500)
        if first == ERROR_400:
            return self._json({"error": {"message": "too long"}}, 400)
        new = req["sampling_params"]["max_new_tokens"]
        now = time.time()
        meta = {"queue_time": 0.2, "forward_entry_time": now, "num_retractions": 1}
        with FakeSglang.lock:
            FakeSglang.in_flight += 1
        try:
            if not req.get("stream"):
                time.sleep(0.01)
                finish = "abort" if first == SERVER_ABORT else "length"
                meta["finish_reason"] = {"type": finish}
                return self._json({"output_ids": [7] * new, "meta_info": meta})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for k in range(1, new + 1):
                # Slow enough that the load sampler (every 0.02 s) sees the
                # streams in flight even on a loaded 2-core machine.
                time.sleep(0.02)
                meta["finish_reason"] = {"type": "length"} if k == new else None
                out = {"output_ids": [7] * k, "meta_info": meta}
                self.wfile.write(b"data: " + json.dumps(out).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client closed the stream
        finally:
            with FakeSglang.lock:
                FakeSglang.in_flight -= 1


class FakeHTTPServer(ThreadingHTTPServer):
    request_queue_size = 256  # the clients connect at once (uvicorn's: 2048)


class FakeServerCase(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.httpd = FakeHTTPServer(("127.0.0.1", 0), FakeSglang)
        cls.httpd.daemon_threads = True
        cls.url = f"http://127.0.0.1:{cls.httpd.server_address[1]}"
        threading.Thread(target=cls.httpd.serve_forever, daemon=True).start()

    @classmethod
    def tearDownClass(cls):
        cls.httpd.shutdown()
        cls.httpd.server_close()


# -------------------------------------------------------------------- tests


class TestWorkload(unittest.TestCase):
    def test_bounds_and_skew(self):
        n = 20000
        w = soak.make_workload(n, seed=1, min_len=1, max_len=32768, max_new=256)
        lens = [r.prompt_len for r in w]
        self.assertEqual([r.index for r in w], list(range(n)))
        self.assertGreaterEqual(min(lens), 1)
        self.assertLessEqual(max(lens), 32768)
        self.assertTrue(all(1 <= r.max_new_tokens <= 256 for r in w))
        self.assertEqual(min(r.max_new_tokens for r in w), 1)
        self.assertEqual(max(r.max_new_tokens for r in w), 256)
        # Log-uniform: the median near sqrt(32768) = 181, the mean near
        # 32767 / ln(32768) = 3151, 1 in 15 above 16K; lengths span the range.
        med = statistics.median(lens)
        self.assertTrue(120 < med < 260, med)
        self.assertTrue(2700 < statistics.fmean(lens) < 3600)
        above = sum(x > 16384 for x in lens) / n
        self.assertAlmostEqual(above, 1 / 15, delta=0.01)
        self.assertGreater(max(lens), 30000)
        self.assertLess(min(lens), 3)
        # Equal shares per octave (a uniform draw would put half above 16K).
        octaves = [sum(2**k <= x < 2 ** (k + 1) for x in lens) for k in range(4, 14)]
        self.assertLess(max(octaves) / min(octaves), 1.25, octaves)

    def test_abort_fraction(self):
        n = 5000
        w = soak.make_workload(n, seed=0, max_new=256, abort_fraction=0.1)
        aborts = [r for r in w if r.abort_after is not None]
        self.assertEqual(len(aborts), 500)
        # Each closes before its last token; ~20% before any output.
        self.assertTrue(all(0 <= r.abort_after < r.max_new_tokens for r in aborts))
        before = sum(r.abort_after == 0 for r in aborts) / len(aborts)
        self.assertAlmostEqual(before, 0.2, delta=0.06)
        self.assertGreater(len({r.abort_after for r in aborts}), 100)
        # Spread over the run, not bunched at the start.
        self.assertGreater(statistics.median(r.index for r in aborts), n * 0.35)
        none = soak.make_workload(100, seed=0, abort_fraction=0.0)
        self.assertTrue(all(r.abort_after is None for r in none))

    def test_one_token_requests_abort_before_output(self):
        w = soak.make_workload(400, seed=3, max_new=1, abort_fraction=0.5)
        self.assertEqual({r.abort_after for r in w} - {None}, {0})

    def test_seeded(self):
        a = soak.make_workload(500, seed=7)
        self.assertEqual(a, soak.make_workload(500, seed=7))
        self.assertNotEqual(a, soak.make_workload(500, seed=8))
        p = soak.request_prompt(a[5], seed=7, vocab=4096)
        self.assertEqual(len(p), a[5].prompt_len)
        self.assertEqual(p, soak.request_prompt(a[5], seed=7, vocab=4096))
        self.assertTrue(all(2 <= t < 4096 for t in p))
        if a[5].prompt_len > 8:
            self.assertNotEqual(p, soak.request_prompt(a[5], seed=8, vocab=4096))

    def test_probe_lengths(self):
        self.assertEqual(len(soak.probe_lengths(32768)), 16)
        self.assertEqual(soak.probe_lengths(32768)[-1], 32768)
        quick = soak.probe_lengths(8192)
        self.assertEqual(quick[-1], 8192)
        self.assertTrue(all(x <= 8192 for x in quick))
        self.assertIn(2049, quick)


class TestArgs(unittest.TestCase):
    def test_modes_and_derived(self):
        a = soak.parse_args(["--out", "/tmp/x"])
        self.assertEqual((a.num_requests, a.concurrency), (5000, 64))
        self.assertEqual((a.max_len, a.max_total_tokens), (32768, 98304))
        self.assertEqual(a.context_length, 32768 + 128 + 512)
        # 98304 locs x 3 layers x 656 B = 0.180 GB
        self.assertEqual(a.host_pool_gb, 0.19)
        self.assertGreaterEqual(
            a.host_pool_gb * (1 << 30), 98304 * 3 * soak.ROW_BYTES_FP8
        )
        q = soak.parse_args(["--quick", "--concurrency", "5"])
        self.assertEqual((q.num_requests, q.concurrency, q.max_len), (300, 5, 8192))
        self.assertEqual(q.max_total_tokens, 24576)
        self.assertEqual(soak.parse_args(["--host-pool-gb", "2"]).host_pool_gb, 2.0)

    def test_soak_deadline(self):
        # The earlier of --time-budget-s from now and the end that leaves the
        # probes after (as long as those before) and the finish in the wall.
        a = soak.parse_args(["--time-budget-s", "200", "--wall-budget-s", "500"])
        t0 = time.time() - 300  # server start and probes took 300 s
        end = soak.soak_deadline(a, t0, probes_s=60)
        self.assertAlmostEqual(end, t0 + 500 - 60 - soak.FINISH_RESERVE_S, delta=1)
        a = soak.parse_args(["--time-budget-s", "50", "--wall-budget-s", "500"])
        self.assertAlmostEqual(soak.soak_deadline(a, t0, 60), time.time() + 50, delta=1)
        a = soak.parse_args(["--wall-budget-s", "500"])
        self.assertAlmostEqual(
            soak.soak_deadline(a, t0, 0), t0 + 500 - soak.FINISH_RESERVE_S, delta=1
        )
        self.assertIsNone(soak.soak_deadline(soak.parse_args([]), t0, 60))
        self.assertEqual(soak.parse_args([]).min_requests, soak.MIN_REQUESTS)

    def test_refused(self):
        for argv in (
            ["--context-length", "1000"],
            ["--max-total-tokens", "30000"],
            ["--min-len", "0"],
            ["--min-new-tokens", "300"],
        ):
            with self.assertRaises(SystemExit, msg=argv):
                with open(os.devnull, "w") as devnull:
                    stderr, sys.stderr = sys.stderr, devnull
                    try:
                        soak.parse_args(argv)
                    finally:
                        sys.stderr = stderr


class TestClient(FakeServerCase):
    def send(self, first, new=4, abort_after=None):
        req = soak.SoakRequest(0, 3, new, abort_after)
        return soak.send_request(self.url, req, [first, 9, 9], False, 30)

    def test_completed_and_aborted(self):
        rec = self.send(9)
        self.assertEqual(
            (rec["status"], rec["finish"], rec["output_len"]), ("ok", "length", 4)
        )
        self.assertEqual(rec["queue_time"], 0.2)
        self.assertEqual(rec["num_retractions"], 1)
        self.assertFalse(rec["closed_early"])
        rec = self.send(9, new=20, abort_after=3)
        self.assertEqual(
            (rec["status"], rec["chunks"], rec["output_len"]), ("aborted", 3, 3)
        )
        self.assertIsNone(rec["finish"])
        rec = self.send(9, new=20, abort_after=0)
        self.assertEqual((rec["status"], rec["chunks"]), ("aborted", 0))
        # The stream finished before the client's point: completed.
        rec = self.send(9, new=2, abort_after=5)
        self.assertEqual((rec["status"], rec["finish"]), ("ok", "length"))
        self.assertTrue(rec["closed_early"])

    def test_errors(self):
        rec = self.send(ERROR_500)
        self.assertEqual(rec["status"], "error")
        self.assertTrue(rec["server_error"])
        self.assertIn("HTTP 500", rec["error"])
        rec = self.send(ERROR_400)
        self.assertEqual(rec["status"], "error")
        self.assertFalse(rec["server_error"])
        rec = self.send(SERVER_ABORT)
        self.assertEqual((rec["status"], rec["server_error"]), ("error", True))
        dead = soak.send_request(
            "http://127.0.0.1:9", soak.SoakRequest(0, 1, 1, None), [9], False, 5
        )
        self.assertEqual((dead["status"], dead["server_error"]), ("error", True))

    def test_runner(self):
        work = soak.make_workload(
            40, seed=2, max_len=16, max_new=8, abort_fraction=0.25
        )
        work[3] = soak.SoakRequest(3, 5, 4, None)
        lines = []
        runner = soak.SoakRunner(
            self.url,
            work,
            lambda r: [ERROR_500 if r.index == 3 else 9] * r.prompt_len,
            concurrency=6,
            alive=lambda: True,
            sample_interval=0.02,
            progress_interval=0.1,
            metrics_interval=0.05,
            log=lines.append,
        )
        out = runner.run()
        recs = out["records"]
        self.assertEqual(len(recs), 40)
        self.assertTrue(all(r is not None for r in recs))
        self.assertEqual(recs[3]["status"], "error")
        statuses = [r["status"] for i, r in enumerate(recs) if i != 3]
        aborts = [r for r in work if r.abort_after is not None]
        self.assertEqual(statuses.count("aborted"), len(aborts))
        self.assertEqual(statuses.count("ok"), 39 - len(aborts))
        self.assertGreater(len(out["samples"]), 0)
        self.assertEqual(out["host_pool_seen"]["max_used_tokens"], 96.0)
        self.assertEqual(out["host_pool_seen"]["total_tokens"], 100.0)
        self.assertIsNone(out["stopped_by"])
        self.assertIn("40/40 sent", lines[-1])
        self.assertIn("1 failed", lines[-1])
        metrics = soak.scrape_series(self.url, soak.CORE_SERIES)
        self.assertEqual(metrics, {"sglang:num_requests_total": 7.0})
        self.assertEqual(soak.fetch_load(self.url)["max_total"], 100)
        self.assertIsNone(soak.fetch_load("http://127.0.0.1:9"))

    def test_runner_stops(self):
        work = soak.make_workload(30, seed=2, max_len=4, max_new=2, abort_fraction=0)
        runner = soak.SoakRunner(
            self.url, work, lambda r: [9], 2, alive=lambda: True, deadline=0
        )
        out = runner.run()
        self.assertEqual(out["records"], [None] * 30)
        self.assertEqual(out["stopped_by"], "time budget")
        runner = soak.SoakRunner(
            "http://127.0.0.1:9", work, lambda r: [9], 2, alive=lambda: False
        )
        out = runner.run()
        self.assertEqual(out["stopped_by"], "server died")
        self.assertLess(sum(r is not None for r in out["records"]), 30)


FAKE_LOG = (
    "NSA KV offload: 24576 logical token locs (host capacity 27000), 32 decode "
    "regions of 4160 rows\n"
    "KV cache pool is full. Retract requests. #retracted_reqs: 2, "
    "#new_tokens_gained: 9000, #new_token_ratio: 0.0980 -> 0.5100\n"
)


class TestRunOrchestration(FakeServerCase):
    """``main`` end to end with the server process and the checkpoint faked:
    probes, soak, idle, metrics, final checks, log scan, files."""

    def fake_server(self, calls):
        url = self.url

        class FakeExactServer(soak.ExactServer):
            def start(self):
                calls["args"], calls["env"] = self.cmd, self.env
                model_dir = self.cmd[self.cmd.index("--model-path") + 1]
                with open(os.path.join(model_dir, "config.json")) as f:
                    calls["config"] = json.load(f)
                self.url = url
                self._log = open(self.log_path, "w")
                self._log.write(FAKE_LOG)
                self._log.flush()
                self.proc = subprocess.Popen(["sleep", "300"])
                return self

            def wait_ready(self):
                return self

        return FakeExactServer

    def test_rank_model_runs_dummy_weights(self):
        calls = {}
        self.addCleanup(server_utils.use_model, "tiny")
        with tempfile.TemporaryDirectory() as d, mock.patch.object(
            soak, "ExactServer", self.fake_server(calls)
        ), mock.patch.object(soak, "write_checkpoint") as write:
            argv = ["--quick", "--model", "rank", "--num-requests", "4"]
            argv += ["--max-len", "100", "--out", d, "--idle-wait", "0"]
            argv += ["--probe-tokens", "2", "--max-new-tokens", "2"]
            with contextlib.redirect_stdout(io.StringIO()):
                soak.main(argv)
            with open(os.path.join(d, "summary.json")) as f:
                s = json.load(f)
        write.assert_not_called()
        cmd = calls["args"]
        self.assertNotIn("--load-format auto", " ".join(cmd))
        self.assertEqual(cmd[cmd.index("--load-format") + 1], "dummy")
        self.assertEqual(calls["config"]["num_hidden_layers"], 61)
        self.assertEqual(s["model"], "rank")

    def test_interrupted_soak_keeps_its_records(self):
        # A SIGTERM (the call's time limit) inside the soak: the requests
        # that finished are counted, not lost with the runner's return.
        calls = {}
        self.addCleanup(server_utils.use_model, "tiny")
        real_run = soak.SoakRunner.run

        def cut_short(runner):
            real_run(runner)
            raise SystemExit(143)

        with tempfile.TemporaryDirectory() as d, mock.patch.object(
            soak, "ExactServer", self.fake_server(calls)
        ), mock.patch.object(soak.SoakRunner, "run", cut_short):
            argv = ["--quick", "--model", "rank", "--num-requests", "6"]
            argv += ["--max-len", "100", "--out", d, "--idle-wait", "0"]
            argv += ["--probe-tokens", "2", "--max-new-tokens", "2"]
            with contextlib.redirect_stdout(io.StringIO()):
                self.assertEqual(soak.main(argv), 1)
            with open(os.path.join(d, "summary.json")) as f:
                s = json.load(f)
        self.assertEqual(s["requests"], 6)
        self.assertEqual(s["stopped_by"], "interrupted")
        self.assertIn("SystemExit", s["error"])
        self.assertFalse(s["passed"])

    def test_quick_run(self):
        calls = {}
        FakeExactServer = self.fake_server(calls)

        def fake_checkpoint(config, path, *args, **kwargs):
            os.makedirs(path, exist_ok=True)
            open(os.path.join(path, "model.safetensors.index.json"), "w").close()
            calls["ckpt"] = (path, args, kwargs)
            return {}

        with tempfile.TemporaryDirectory() as d, mock.patch.object(
            soak, "ExactServer", FakeExactServer
        ), mock.patch.object(soak, "write_checkpoint", fake_checkpoint):
            argv = ["--quick", "--num-requests", "40", "--max-len", "300"]
            argv += ["--out", d, "--ckpt", os.path.join(d, "ckpt")]
            argv += ["--idle-wait", "0", "--sample-interval", "0.02"]
            argv += ["--probe-tokens", "4", "--max-new-tokens", "6"]
            with contextlib.redirect_stdout(io.StringIO()):
                rc = soak.main(argv)
            with open(os.path.join(d, "summary.json")) as f:
                s = json.load(f)
            files = sorted(os.listdir(d))
            with open(os.path.join(d, "soak.json")) as f:
                result = json.load(f)
            with gzip.open(os.path.join(d, "server_soak.log.gz"), "rt") as f:
                self.assertEqual(f.read(), FAKE_LOG)
        self.assertEqual(rc, 1)  # 40 < 1000 requests
        self.assertEqual(
            files,
            [
                "ckpt_tiny_s0_q1.5_o16_a1",
                "server_soak.log.gz",
                "soak.json",
                "soak_started",
                "summary.json",
                "summary.md",
            ],
        )
        self.assertEqual(calls["ckpt"][1][:3], (0, 1.5, 16.0))  # seed, qk, out gain
        cmd = " ".join(calls["args"])
        for flag in (
            "--enable-decode-nsa-kv-offload --nsa-kv-offload-host-pool-gb 0.05",
            "--max-total-tokens 24576",
            "--max-running-requests 32",
            "--enable-metrics",
            "--load-format auto",
        ):
            self.assertIn(flag, cmd)
        self.assertNotIn("--disable-cuda-graph", cmd)
        self.assertNotIn("--disable-overlap-schedule", cmd)
        self.assertEqual(calls["env"]["SGLANG_DSA_FUSE_TOPK"], "0")
        self.assertEqual(calls["env"]["SGLANG_NSA_TOPK_SORTED"], "1")
        self.assertEqual(s["requests"], 40)
        self.assertEqual(s["aborted"], 4)
        self.assertEqual(s["retracted"], 2)
        self.assertEqual((s["leaks"], s["failed"]), (0, 0))
        # Counted from the records' queue intervals and the load samples.
        sent = [r for r in result["records"] if r is not None]
        self.assertTrue(all("queue_time" in r for r in sent if r["status"] == "ok"))
        self.assertGreater(len(result["samples"]), 0)
        self.assertEqual(
            s["waited_on_host_pool"],
            soak.count_waited_on_host_pool(sent, result["samples"]),
        )
        self.assertFalse(s["crashed"])
        self.assertTrue(s["probe_identical"])
        self.assertEqual(s["probes"], len(soak.probe_lengths(300)))
        self.assertTrue(s["alive_at_end"])
        self.assertTrue(s["idle_clean"])
        self.assertEqual(s["host_pool"]["locs"], 24576)  # logged at startup
        self.assertEqual(s["host_pool"]["max_fill_seen"], 0.96)  # the gauges
        self.assertEqual(s["metrics"]["sglang:num_requests_total"], 7.0)
        fails = [k for k, v in s["criteria"].items() if not v]
        # Whether a load sample (every 0.02 s) falls inside a request's 0.2 s
        # wait is timing: on a loaded CI machine none may (a fresh-clone run
        # at f58c195 beside other tests); the criterion follows the count.
        # The fake server exports no unit or verify counters, its log no
        # decode lines.
        expected = [
            "requests >= 1000",
            "units moved",
            "units reclaimed",
            "idle-loc units lent",
            "idle-loc units taken back",
            "requests warmed",
            "direct beside walking requests",
            "rows verified, 0 mismatches",
        ]
        self.assertEqual(fails, expected)


def sample(t, waiting, used, total, max_total=100):
    return {
        "t": t,
        "running": 1,
        "waiting": waiting,
        "used": used,
        "total": total,
        "max_total": max_total,
    }


class TestWaitedOnHostPool(unittest.TestCase):
    def test_pool_bound(self):
        self.assertTrue(soak.pool_bound(sample(0, 2, 90, 120)))  # 30 wanted, 10 free
        self.assertFalse(soak.pool_bound(sample(0, 2, 50, 80)))  # fits in the free
        self.assertFalse(soak.pool_bound(sample(0, 0, 100, 100)))  # nobody waits

    def test_count(self):
        samples = [
            sample(10.0, 2, 90, 120),  # bound
            sample(11.0, 1, 40, 60),  # not
            sample(12.0, 3, 95, 200),  # bound
        ]
        recs = [
            {"status": "ok", "queue_time": 0.5, "forward_entry": 10.2},  # 9.7-10.2
            {"status": "ok", "queue_time": 0.4, "forward_entry": 11.3},  # 10.9-11.3
            {"status": "ok", "queue_time": 3.0, "forward_entry": 13.0},  # 10-13
            {"status": "aborted", "chunks": 0, "t_send": 11.9, "t_end": 12.1},
            {"status": "aborted", "chunks": 2, "t_send": 9.0, "t_end": 14.0},
            {"status": "ok", "queue_time": 0.1, "forward_entry": 12.05},  # 11.95-
        ]
        self.assertEqual(soak.count_waited_on_host_pool(recs, samples), 4)
        self.assertEqual(soak.count_waited_on_host_pool(recs, samples[1:2]), 0)
        self.assertEqual(soak.count_waited_on_host_pool(recs, []), 0)


LOG = """\
[2026-12-01 10:00:00] max_total_num_tokens=98304, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=64
[2026-12-01 10:00:00] Decode NSA KV offload: 4096 LRU rows + 64 recent-window rows per request per layer (index_topk=2048), up to 8 x 4096 LRU rows while GPU memory is idle; 98304 token locs (host capacity 103600), 64 decode regions, 23 spare regions, 67520 staging rows, 19 idle-loc units; host pool 0.73 GB pinned in 0.2 s; early swap, warm units, direct slots, verify mode (count).
[2026-12-01 10:00:01] Can not initialize OpenAIServingResponses ... Traceback (most recent call last): harmless
[2026-12-01 10:00:02] Prefill batch, #new-seq: 3, #new-token: 8192, #cached-token: 0, token usage: 0.95, #running-req: 40, #queue-req: 12, #pending-token: 0, cuda graph: False
[2026-12-01 10:00:03] Decode batch, #running-req: 41, #token: 97000, token usage: 0.99, cuda graph: True, gen throughput (token/s): 9000.00, #queue-req: 20, nsa-offload hit rate: 0.800, misses: 1000, H2D: 2.00 GB/s, regions: 41/64, extra units: 3 (0 of staging, 2 moved, 5 of idle locs), units per request: 1-6, direct: 40, warmed: 5 (0.01 GB), verify: 100 rows checked, 0 mismatches
[2026-12-01 10:00:04] KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_tokens_gained: 20000, #new_token_ratio: 0.0980 -> 0.5100
[2026-12-01 10:00:05] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 9000, #new_token_ratio: 0.3000 -> 0.4000
[2026-12-01 10:00:06] Decode batch, #running-req: 5, #token: 9000, token usage: 0.10, cuda graph: True, gen throughput (token/s): 900.00, #queue-req: 0, nsa-offload hit rate: 0.600, misses: 500, H2D: 1.00 GB/s, regions: 5/64, extra units: 1 (0 of staging, 0 moved, 2 of idle locs), units per request: 1-2, direct: 5, warmed: 2 (0.00 GB), verify: 200 rows checked, 0 mismatches
[2026-12-01 10:00:07] retract_decode: aborted last request abc due to OOM
[2026-12-01 10:00:07] Out of memory even after retracting all other requests in the decode batch. Aborting the last request.
[2026-12-01 10:00:08] Scheduler hit an exception: Traceback (most recent call last):
  File "scheduler.py", line 1, in on_idle
ValueError: NSA KV offload memory leak detected! 1 request(s) still admitted (req pool [3])
[2026-12-01 10:00:09] pool memory leak detected! full: available 9 != total 10
"""


class TestLogParser(unittest.TestCase):
    def scan(self, text):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "server.log")
            with open(path, "w") as f:
                f.write(text)
            return soak.scan_soak_log(path)

    def test_synthetic_log(self):
        out = self.scan(LOG)
        self.assertEqual(out["retractions"], 2)
        self.assertEqual(out["retracted_reqs"], 3)
        self.assertEqual(out["kv_full_retractions"], 2)
        self.assertEqual(out["leaks"], 2)
        self.assertIn("NSA KV offload memory leak", out["leak_lines"][0])
        self.assertEqual(out["tracebacks"], 1)  # not the harmless one
        self.assertIn("Scheduler hit an exception", out["traceback_lines"][0])
        self.assertEqual(out["oom_aborts"], 1)
        self.assertEqual(out["max_token_usage"], 0.99)
        self.assertEqual(out["max_queue_reqs"], 20)
        self.assertEqual(out["lines_queued_at_full"], 2)
        self.assertEqual((out["host_locs"], out["host_capacity_locs"]), (98304, 103600))
        self.assertEqual(out["max_total_num_tokens"], 98304)
        self.assertEqual(out["misses"], 1500)
        self.assertEqual(out["min_hit_rate"], 0.6)
        # The offload's decode-log fields: 40 direct beside 1 walking, then 5
        # of 5 direct; warm-ups 5 + 2; idle-loc units 5, then 2 (fewer once).
        self.assertEqual(out["lines_direct_beside_walking"], 1)
        self.assertEqual(out["warmed"], 7)
        self.assertEqual(out["max_idle_loc_units_logged"], 5)
        self.assertEqual(out["lines_idle_loc_units_back"], 1)
        # A gzipped log reads the same (--report rescans the returned log).
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "server.log.gz")
            with gzip.open(path, "wt") as f:
                f.write(LOG)
            self.assertEqual(soak.scan_soak_log(path), out)

    def test_clean_log(self):
        clean = "\n".join(
            line
            for line in LOG.splitlines()
            if "leak" not in line and "Traceback" not in line and "File" not in line
        )
        out = self.scan(clean)
        self.assertEqual((out["leaks"], out["tracebacks"]), (0, 0))
        self.assertEqual(out["leak_lines"], [])

    def test_missing_log(self):
        out = soak.scan_soak_log("/nonexistent/server.log")
        self.assertTrue(out["missing"])
        self.assertEqual(out["leaks"], 0)


def clean_result(**over):
    """A passing run's result (soak.json), 5000 requests."""
    now = 1000.0
    recs = []
    for i in range(5000):
        rec = {
            "i": i,
            "len": 100,
            "new": 10,
            "status": "ok",
            "output_len": 10,
            "server_error": False,
            "error": None,
            "chunks": 0,
            "queue_time": 1.0,
            "forward_entry": now + 1.5,
            "num_retractions": 0,
        }
        if i % 10 == 0:
            rec.update(status="aborted", output_len=2, chunks=2)
        recs.append(rec)
    recs[1]["num_retractions"] = 2
    result = {
        "records": recs + [None],
        "samples": [sample(now + 1.0, 5, 95, 300)],
        "log": {
            "retracted_reqs": 4,
            "retractions": 3,
            "kv_full_retractions": 3,
            "leaks": 0,
            "tracebacks": 0,
            "warmed": 9,
            "lines_direct_beside_walking": 4,
            "max_idle_loc_units_logged": 3,
            "lines_idle_loc_units_back": 2,
        },
        "probes_before": [[1, 2], [3]],
        "probes_after": [[1, 2], [3]],
        "died": False,
        "alive_at_end": True,
        "idle_reached": True,
        "final_load": {"running": 0, "waiting": 0, "used": 0},
        "host_pool_seen": {
            "max_used_tokens": 98000.0,
            "total_tokens": 98304.0,
            soak.IDLE_LOC_GAUGE: 3.0,
        },
        "metrics": {
            soak.COUNTER_KEYS["units_moved"]: 5.0,
            soak.COUNTER_KEYS["units_reclaimed"]: 7.0,
            soak.COUNTER_KEYS["units_kept"]: 2.0,
            soak.COUNTER_KEYS["verify_checked_rows"]: 1e6,
            soak.COUNTER_KEYS["verify_mismatches"]: 0.0,
        },
        "wall_s": 321.0,
        "soak_s": 250.0,
        "code_commit": "abc1234",
        "config": {"num_requests": 5000},
    }
    result.update(over)
    return result


def build(**over):
    return soak.build_summary(clean_result(**over))


class TestSummary(unittest.TestCase):
    def test_keys_and_values(self):
        s = soak.build_summary(clean_result())
        self.assertEqual(list(s)[: len(soak.SUMMARY_KEYS)], list(soak.SUMMARY_KEYS))
        self.assertEqual(
            {k: s[k] for k in soak.SUMMARY_KEYS},
            {
                "settings": "default",
                "requests": 5000,
                "aborted": 500,
                "retracted": 4,
                "units_moved": 5,
                "units_reclaimed": 7,
                "units_kept": 2,
                "idle_loc_units_lent": 3,
                "verify_checked_rows": 1000000,
                "verify_mismatches": 0,
                "leaks": 0,
                "failed": 0,
                "code_commit": "abc1234",
            },
        )
        self.assertEqual(s["waited_on_host_pool"], 5000)
        self.assertIsInstance(s["crashed"], bool)
        self.assertIsInstance(s["probe_identical"], bool)
        self.assertEqual(s["completed"], 4500)
        self.assertEqual(s["requests_seen_retracted"], 1)
        self.assertEqual(s["host_pool"]["max_fill_seen"], round(98000 / 98304, 4))
        self.assertTrue(s["idle_clean"])
        self.assertTrue(s["passed"], s["criteria"])

    def test_crashed(self):
        self.assertTrue(build(died=True)["crashed"])
        self.assertTrue(build(alive_at_end=False)["crashed"])
        # Interrupted before the end check: not a crash by itself, not passed.
        s = build(alive_at_end=None, interrupted=True)
        self.assertFalse(s["crashed"])
        self.assertFalse(s["passed"])
        recs = clean_result()["records"]
        recs[5] = dict(recs[5], status="error", server_error=True, error="HTTP 500")
        s = build(records=recs)
        self.assertTrue(s["crashed"])
        self.assertEqual((s["failed"], s["server_errors"]), (1, 1))
        self.assertEqual(s["first_errors"], ["#5: HTTP 500"])
        # A client error fails the run, it is no crash.
        recs[5] = dict(recs[5], server_error=False, error="HTTP 400")
        s = build(records=recs)
        self.assertFalse(s["crashed"])
        self.assertFalse(s["passed"])
        # Aborts are not failures.
        self.assertFalse(build()["crashed"])

    def test_probes_and_criteria(self):
        s = build(probes_after=[[1, 2], [4]])
        self.assertFalse(s["probe_identical"])
        self.assertEqual(s["probes_differing"], [1])
        self.assertFalse(s["passed"])
        self.assertFalse(build(probes_after=[[1, 2], None])["probe_identical"])
        self.assertFalse(build(probes_after=None)["probe_identical"])
        self.assertFalse(build(probes_before=[], probes_after=[])["probe_identical"])
        self.assertFalse(build(probes_after=[[1, 2]])["probe_identical"])
        s = build(log={"retracted_reqs": 0, "leaks": 1})
        self.assertEqual((s["retracted"], s["leaks"]), (0, 1))
        self.assertFalse(s["criteria"]["retractions on a full pool in the log"])
        self.assertFalse(s["criteria"]["0 leaks"])
        self.assertFalse(s["idle_clean"])
        self.assertFalse(
            build(final_load={"running": 0, "waiting": 0, "used": 64})["idle_clean"]
        )
        s = build(records=clean_result()["records"][:100])
        self.assertFalse(s["criteria"]["requests >= 1000"])
        # --min-requests (the rank model's soak): its own floor, named.
        s = build(records=clean_result()["records"][:100], config={"min_requests": 100})
        self.assertTrue(s["criteria"]["requests >= 100"])
        self.assertNotIn("requests >= 1000", s["criteria"])
        s = build(records=clean_result()["records"][:99], config={"min_requests": 100})
        self.assertFalse(s["criteria"]["requests >= 100"])
        self.assertEqual(build(samples=[])["waited_on_host_pool"], 0)
        # Forced retraction (--retract-interval): any retraction in the log.
        forced = build(config={"retract_interval": 40}, log={"retractions": 0})
        self.assertFalse(forced["criteria"]["retractions in the log (forced)"])
        forced = build(config={"retract_interval": 40})
        self.assertTrue(forced["criteria"]["retractions in the log (forced)"])
        self.assertNotIn("retractions on a full pool in the log", forced["criteria"])
        s = build(host_pool_seen={"max_used_tokens": 9000.0, "total_tokens": 98304.0})
        self.assertFalse(s["criteria"]["host pool full at times (>= 95% seen)"])
        # MTP runs no request direct (direct slots need one query token).
        walking = {"lines_direct_beside_walking": 0}
        self.assertFalse(
            build(log=walking)["criteria"]["direct beside walking requests"]
        )
        mtp = build(config={"mtp": 3}, log=walking)
        self.assertNotIn("direct beside walking requests", mtp["criteria"])

    def test_write_and_report(self):
        with tempfile.TemporaryDirectory() as d:
            s = soak.write_summary(clean_result(), d)
            with open(os.path.join(d, "summary.json")) as f:
                on_disk = json.load(f)
            self.assertEqual(
                list(on_disk)[: len(soak.SUMMARY_KEYS)], list(soak.SUMMARY_KEYS)
            )
            self.assertEqual(on_disk["requests"], s["requests"])
            with open(os.path.join(d, "summary.md")) as f:
                md = f.read()
            self.assertIn("| `units_moved` | 5 |", md)
            self.assertIn("**passed**", md)
            # --report: the summary again from soak.json, exit status by verdict.
            with open(os.path.join(d, "soak.json"), "w") as f:
                json.dump(clean_result(died=True), f)
            self.assertEqual(soak.main(["--report", "--out", d]), 1)
            with open(os.path.join(d, "summary.json")) as f:
                self.assertTrue(json.load(f)["crashed"])
            with open(os.path.join(d, "soak.json"), "w") as f:
                json.dump(clean_result(), f)
            self.assertEqual(soak.main(["--report", "--out", d]), 0)
            # As committed: soak.json.gz.
            with open(os.path.join(d, "soak.json"), "rb") as src:
                with gzip.open(os.path.join(d, "soak.json.gz"), "wb") as dst:
                    dst.write(src.read())
            os.remove(os.path.join(d, "soak.json"))
            self.assertEqual(soak.main(["--report", "--out", d]), 0)

    def test_mtp_run_beside(self):
        # --report --mtp-from: the MTP run's issue keys under "mtp", before
        # code_commit; passed only when both runs passed.
        side = soak.SUMMARY_KEYS + ("passed", "model", "sglang_version")
        with tempfile.TemporaryDirectory() as d:
            mtp_dir = os.path.join(d, "mtp")
            os.makedirs(mtp_dir)
            mtp = soak.write_summary(
                clean_result(config={"mtp": 3}, code_commit="abc1234"), mtp_dir
            )
            self.assertEqual(mtp["mtp_draft_tokens"], 4)
            s = soak.write_summary(clean_result(), d, {"mtp": mtp_dir})
            keys = list(s)
            self.assertEqual(keys.index("mtp"), keys.index("code_commit") - 1)
            self.assertLessEqual(set(soak.SUMMARY_KEYS) | {"passed"}, set(s["mtp"]))
            self.assertLessEqual(set(s["mtp"]), set(side))
            self.assertTrue(s["passed"])
            with open(os.path.join(d, "summary.md")) as f:
                self.assertIn("| `units_moved` | 5 | 5 |", f.read())
            recs = clean_result()["records"]
            recs[5] = dict(recs[5], status="error", server_error=True, error="HTTP 500")
            soak.write_summary(clean_result(records=recs), mtp_dir)
            s = soak.write_summary(clean_result(), d, {"mtp": mtp_dir})
            self.assertEqual(s["mtp"]["failed"], 1)
            self.assertFalse(s["passed"])
            # A run whose files did not come back: its printed summary.
            printed = soak.summary_markdown(soak.build_summary(clean_result()))
            os.remove(os.path.join(mtp_dir, "summary.json"))
            with open(os.path.join(mtp_dir, "stdout.txt"), "w") as f:
                f.write("[soak] log lines\n" + printed)
            s = soak.write_summary(clean_result(), d, {"mtp": mtp_dir})
            expected = {k: v for k, v in build().items() if k in soak.SUMMARY_KEYS}
            self.assertEqual({k: s["mtp"][k] for k in soak.SUMMARY_KEYS}, expected)
            self.assertIsNone(s["mtp"]["passed"])
            self.assertFalse(s["passed"])  # not known to have passed

    def test_mtp_and_rank_runs_beside(self):
        # --rank-from beside --mtp-from: both under their names, in that
        # order, a column each; passed only when all three passed.
        with tempfile.TemporaryDirectory() as d:
            dirs = {n: os.path.join(d, n) for n in ("mtp", "rank")}
            for n, sub in dirs.items():
                os.makedirs(sub)
                soak.write_summary(clean_result(), sub)
            s = soak.write_summary(clean_result(), d, dirs)
            keys = list(s)
            self.assertEqual(keys.index("rank"), keys.index("code_commit") - 1)
            self.assertEqual(keys.index("mtp"), keys.index("rank") - 1)
            self.assertTrue(s["passed"] and s["passed_alone"])
            with open(os.path.join(d, "summary.md")) as f:
                text = f.read()
            self.assertIn("| key | value | MTP run | rank model run |", text)
            self.assertIn("| `units_moved` | 5 | 5 | 5 |", text)
            recs = clean_result()["records"]
            recs[5] = dict(recs[5], status="error", server_error=True, error="HTTP 500")
            soak.write_summary(clean_result(records=recs), dirs["rank"])
            s = soak.write_summary(clean_result(), d, dirs)
            self.assertEqual(s["rank"]["failed"], 1)
            self.assertFalse(s["passed"])
            self.assertTrue(s["passed_alone"])

    def test_default_host_pool(self):
        self.assertEqual(soak.default_host_pool_gb(98304, 3), 0.19)
        gb = soak.default_host_pool_gb(10**6, 3)
        self.assertGreaterEqual(gb * (1 << 30), 10**6 * 3 * 656)
        self.assertLess(gb * (1 << 30), 10**6 * 3 * 656 + 0.01 * (1 << 30))
        self.assertTrue(math.isclose(gb * 100, round(gb * 100)))


if __name__ == "__main__":
    unittest.main()
