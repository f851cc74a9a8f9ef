"""End-to-end exactness of --enable-decode-nsa-kv-offload on a real server (GPU).

The servers load a generated checkpoint of the tiny DeepSeek-V3.2-shaped
model (3 layers, ``benchmark/nsa_offload/server/make_checkpoint.py``, seed 0,
the gains of record, qk 1.5 and out 16; ~0.3 GB written once per module
into a temp dir in ~5 s) with
sglang's own loader (``--load-format auto``): unlike ``--load-format dummy``,
whose weights leave the tokens blind to attention, these make the greedy
tokens depend on the KV rows attention reads, so a wrong read changes the
outputs. Every server of a class starts at once (all on the one GPU) with the
flags of ``benchmark/nsa_offload/server/exactness.py`` (``server_args``):
fp8 KV + FlashMLA sparse prefill + FlashMLA fp8 decode, CUDA graphs and the
overlap scheduler on, and sglang's top-k made deterministic on every server
(positional top-k ``SGLANG_DSA_FUSE_TOPK=0``, ``SGLANG_NSA_TOPK_SORTED=1``
with ``server/sorted_topk`` first on ``PYTHONPATH``,
``CUBLAS_WORKSPACE_CONFIG=:4096:8``). Each server gets the same workload:

1. ``seq``: prompts of the boundary lengths (1, 63-65, 2047-2049, the GPU
   buffer's edges 4095-4097 and 4159-4161, 4064 so that decode crosses the
   buffer, 16K, 30000) and a few random ones, one request at a time, 64 new
   tokens, ``ignore_eos``;
2. ``load``: prompts of 3K-12K tokens, 8 concurrent clients (load only: with
   fp8 KV the batch composition, which follows timing, changes sglang's own
   outputs, so only "all finished" is checked);
3. ``short``: ``2 x --max-running-requests`` requests, one after the other, that
   finish at their prefill (``max_new_tokens=1``: what ``/health_generate``
   sends). Under the overlap scheduler each of them is already in the next
   decode batch when its prefill result says it finished; each must give its
   decode region back (a leaked region is reused stale by the next request
   with the same request slot, or runs the server out of regions);
4. ``after_short``: long requests one after the other; they reuse request
   slots (and regions) the short ones had;
5. the negative control (no-offload server, only where the benchmark hooks
   are installed: ``scripts/apply_patch.py --with-bench-hooks``): the ``seq``
   prompts of >= 3000 tokens again with ``nsa_topk_trace.TopkCorruption``
   armed in persistent mode (``SGLANG_NSA_TOPK_CORRUPT``, arm file "1 0": at
   every decode step layer 0 reads one wrong KV row), then disarmed again;
6. idle: the scheduler goes idle (its own leak checks run), then the server
   must still answer ``/health_generate`` and a generation request.

Every comparison is batch 1 (phases 1, 3, 4, 6): identical ``output_ids``
with and without the offload, for the default offload server (LRU units with
warm units, direct slots, spare regions, idle-loc units and the early swap,
all of them the design now: no switch turns them off) and one with one fixed
buffer per request (``--nsa-kv-offload-max-units 1``; direct slots still on,
no warm units). The negative control shows that these comparisons can fail:
the corrupted read must change at least 90% of the outputs (never the first
token, which comes from the prefill), while the disarmed server repeats its
clean outputs, which match the offload servers'. Without the hooks only that test is
skipped. A subclass repeats the no-offload / offload comparison with a bf16
KV cache (FlashMLA sparse decode, ``--dsa-decode-backend flashmla_sparse``),
another with MTP on every server (NextN, 3 steps; accept counts compared
too), and two on two GPUs (attention TP and DP attention, against the
no-offload server of the same shape; skipped on one GPU). Another class
starts a PD decode server (``--disaggregation-mode decode``,
sglang's fake KV transfer: no prefill server, KV unwritten, so dummy weights
and no output comparison) with the offload and checks that it admits,
decodes, idles and still serves. It needs a Hopper GPU with the DSA stack
(``sgl_kernel.flash_mla``) and is skipped elsewhere (e.g. in the CPU test
suite).

Expected wall time on one H200 with the JIT cache warm (a cold machine adds
~2-3 min of kernel compilation at the first server start): about 5-7 min for
``TestDecodeNSAKVOffload`` (3 servers side by side: ~2-4 min to start, mostly
JIT and CUDA-graph capture, ~2-3 min of requests), 4-5 min for
``TestDecodeNSAKVOffloadBF16`` (2 servers), ~1.5 min for
``TestDecodeNSAKVOffloadPDDecode``; run the classes one per call where a call
is limited to 500 s (``benchmark/nsa_offload/device_run.sh pytest``).

    python -m pytest test/srt/test_decode_nsa_kv_offload.py -s
    python -m pytest test/srt/test_decode_nsa_kv_offload.py::TestDecodeNSAKVOffload -s
"""

import importlib
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "benchmark" / "nsa_offload" / "server"))

import exactness  # noqa: E402
from exactness import (  # noqa: E402
    ENV_CORRUPT_LAYER,
    NC_MODES,
    ExactServer,
    accept_record,
    case_lengths,
    compare_accept,
    first_diff,
    negative_control,
    parse_args,
    scan_log,
    server_args,
)
from make_checkpoint import (  # noqa: E402
    RECORD_OUT_GAIN,
    RECORD_QK_GAIN,
    load_config,
    write_checkpoint,
)
from server_utils import (  # noqa: E402
    PD_DECODE_FAKE_ARGS,
    bench_hooks_missing,
    random_prompts,
)


def _gpu_stack_missing() -> Optional[str]:
    """Why this machine cannot run the test, or None."""
    if not torch.cuda.is_available():
        return "requires a CUDA device"
    if torch.cuda.get_device_capability()[0] < 9:
        return "requires a Hopper (sm90) or newer GPU for FlashMLA sparse"
    try:
        importlib.import_module("sgl_kernel.flash_mla")
    except Exception as e:  # the CPU suite stubs sgl_kernel: ImportError
        return f"requires sgl_kernel.flash_mla ({type(e).__name__}: {e})"
    return None


SKIP_REASON = _gpu_stack_missing()

# sglang.test.test_utils pulls packages the CPU venv (and trimmed GPU stacks)
# lack (datasets, aiohttp, ...): import it only where the test can run.
CustomTestCase = unittest.TestCase
if SKIP_REASON is None:
    try:
        from sglang.test.test_utils import CustomTestCase
    except Exception as e:  # pragma: no cover - depends on the GPU stack
        print(f"sglang.test.test_utils not importable ({e}); using unittest")

TINY_CONFIG = load_config("tiny")
VOCAB_SIZE = TINY_CONFIG["vocab_size"]
CHECKPOINT_SEED = 0

# Request slots = decode regions (and --cuda-graph-max-bs-decode, server_args).
MAX_RUNNING_REQUESTS = 16
MAX_NEW_TOKENS = 64
CONCURRENCY = 8
# The offload's default GPU buffer (C) and recent window (W): case_lengths
# puts prompts at their edges.
SEQ_PROMPT_LENS = case_lengths(4096, 64, 30000) + [3500, 7000, 11000]
LOAD_PROMPT_LENS = [3000 + i * 600 for i in range(16)]  # 3000 .. 12000
SHORT_PROMPT_LENS = [100 + 37 * i for i in range(2 * MAX_RUNNING_REQUESTS)]
AFTER_SHORT_PROMPT_LENS = [3000 + i * 400 for i in range(CONCURRENCY)]
IDLE_WAIT_S = 12
AFTER_IDLE_NEW_TOKENS = 16
# Batch-1 phases: compared token for token between servers.
COMPARED_PHASES = ("seq", "short", "after_short", "after_idle")

# The negative control (benchmark/nsa_offload/traces/nsa_topk_trace.py).
ENV_CORRUPT = "SGLANG_NSA_TOPK_CORRUPT"
NC_LOG_LINE = "NSA top-k negative control on layer"
NC_MODE = "persistent"  # every decode step: the arm file holds "1 0"
NC_MIN_PROMPT_LEN = 3000  # > the top-k (2048): the indexer selects
NC_MIN_FLIP_FRACTION = 0.9
ARM_POLL_WAIT_S = 1.0  # the server's poll thread reads the arm file every 0.2 s

# One checkpoint for every class of the module (tearDownModule removes it).
_CHECKPOINT_DIR: Optional[str] = None


def _tiny_checkpoint() -> str:
    global _CHECKPOINT_DIR
    if _CHECKPOINT_DIR is None:
        path = tempfile.mkdtemp(prefix="test_decode_nsa_kv_offload_ckpt_")
        tic = time.perf_counter()
        write_checkpoint(
            TINY_CONFIG,
            path,
            CHECKPOINT_SEED,
            qk_gain=RECORD_QK_GAIN,
            out_gain=RECORD_OUT_GAIN,
            progress=lambda m: None,
        )
        print(f"tiny checkpoint {path} in {time.perf_counter() - tic:.1f} s")
        _CHECKPOINT_DIR = path
    return _CHECKPOINT_DIR


def tearDownModule():
    if _CHECKPOINT_DIR is not None:
        shutil.rmtree(_CHECKPOINT_DIR, ignore_errors=True)


def _get_status(url: str, timeout: float = 60) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return -1


def _phase(run):
    """The phase's result, or the error text (reported with the server log)."""
    try:
        return run()
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _outputs(srv: ExactServer, prompts: List[List[int]], max_new: int):
    """One request at a time (batch 1)."""
    return [srv.generate(p, max_new)["output_ids"] for p in prompts]


def _stop(srv: ExactServer) -> None:
    if srv.proc is None:
        shutil.rmtree(srv.model_dir, ignore_errors=True)
        return
    if srv.proc.poll() is None:
        try:
            from sglang.srt.utils import kill_process_tree

            kill_process_tree(srv.proc.pid)
        except Exception:
            pass  # Server.stop terminates, then kills, the launcher
    srv.stop()


def _read_log(srv: ExactServer) -> str:
    with open(srv.log_path, errors="replace") as f:
        return f.read()


def _port_base(offset: int) -> int:
    return int(os.environ.get("SGLANG_TEST_NSA_OFFLOAD_PORT", "21000")) + offset


@unittest.skipIf(SKIP_REASON is not None, SKIP_REASON or "")
class TestDecodeNSAKVOffload(CustomTestCase):
    """Same greedy outputs with and without the decode NSA KV offload, batch
    1 on the tiny checkpoint; the negative control shows the check can fail."""

    # role -> the server of exactness.py (its flags, env and KV dtype).
    SERVERS = {
        "baseline": "base_fp8",
        "offload": "ours_fp8",
        "offload_fixed": "ours_fp8_1unit",
    }
    PORT_OFFSET = 0
    MTP = False  # the seq phase also records each request's accept counts

    @classmethod
    def setUpClass(cls):
        try:
            cls._set_up_class()
        except BaseException:
            # Plain unittest skips tearDownClass when setUpClass fails.
            cls.tearDownClass()
            raise

    @classmethod
    def _set_up_class(cls):
        cls.tmp_dir = tempfile.mkdtemp(prefix="test_decode_nsa_kv_offload_")
        cls.servers = {}
        ckpt = _tiny_checkpoint()
        cls.nc_skip_reason = bench_hooks_missing()
        cls.arm_path = os.path.join(cls.tmp_dir, "nc_arm")
        args = parse_args(
            ["--out", cls.tmp_dir, "--concurrency", str(MAX_RUNNING_REQUESTS)]
        )
        cls.workload = {
            "seq": (random_prompts(SEQ_PROMPT_LENS, 0, VOCAB_SIZE), MAX_NEW_TOKENS),
            "load": (random_prompts(LOAD_PROMPT_LENS, 1, VOCAB_SIZE), MAX_NEW_TOKENS),
            "short": (random_prompts(SHORT_PROMPT_LENS, 2, VOCAB_SIZE), 1),
            "after_short": (
                random_prompts(AFTER_SHORT_PROMPT_LENS, 3, VOCAB_SIZE),
                MAX_NEW_TOKENS,
            ),
            "after_idle": (random_prompts([500], 4, VOCAB_SIZE), AFTER_IDLE_NEW_TOKENS),
        }
        cls.nc_indices = [
            i for i, n in enumerate(SEQ_PROMPT_LENS) if n >= NC_MIN_PROMPT_LEN
        ]
        for i, (role, name) in enumerate(cls.SERVERS.items()):
            extra, env = server_args(exactness.SERVERS[name], args, ckpt)
            if role == "baseline" and cls.nc_skip_reason is None:
                # Disarmed while the arm file does not exist.
                env[ENV_CORRUPT] = cls.arm_path
                env[ENV_CORRUPT_LAYER] = "0"
            port = _port_base(cls.PORT_OFFSET) + 10 * i
            cls.servers[role] = ExactServer(role, extra, port, cls.tmp_dir, env, 900)
        for srv in cls.servers.values():
            srv.start()
        with ThreadPoolExecutor(len(cls.servers)) as pool:
            cls.results = dict(
                zip(cls.servers, pool.map(cls._run_server, cls.servers.values()))
            )

    @classmethod
    def tearDownClass(cls):
        for srv in getattr(cls, "servers", {}).values():
            _stop(srv)
        shutil.rmtree(getattr(cls, "tmp_dir", ""), ignore_errors=True)

    @classmethod
    def _run_server(cls, srv: ExactServer) -> dict:
        result = {}
        try:
            srv.wait_ready()
            cls._run_workload(srv, result)
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {e}"
        finally:
            _stop(srv)
        result["log"] = scan_log(srv.log_path)
        log = _read_log(srv)
        result["nc_log_line"] = NC_LOG_LINE in log
        result["log_tail"] = "".join(log.splitlines(True)[-60:])
        return result

    @classmethod
    def _run_workload(cls, srv: ExactServer, result: dict) -> None:
        tic = time.perf_counter()
        w = cls.workload
        if cls.MTP:
            seq = _phase(lambda: [srv.generate(p, w["seq"][1]) for p in w["seq"][0]])
            if isinstance(seq, list):
                result["seq_accept"] = [accept_record(r["meta_info"]) for r in seq]
                seq = [r["output_ids"] for r in seq]
            result["seq"] = seq
        else:
            result["seq"] = _phase(lambda: _outputs(srv, *w["seq"]))
        prompts, max_new = w["load"]
        result["load"] = _phase(
            lambda: [
                r["output_ids"]
                for r in srv.generate_many(prompts, max_new, CONCURRENCY)
            ]
        )
        # One after the other: each is the only request when its prefill runs.
        result["short"] = _phase(lambda: _outputs(srv, *w["short"]))
        result["after_short"] = _phase(lambda: _outputs(srv, *w["after_short"]))
        if srv.name == "baseline" and cls.nc_skip_reason is None:
            result["nc"] = _phase(lambda: cls._negative_control(srv))
        print(f"[{srv.name}] requests done in {time.perf_counter() - tic:.1f} s")

        # Idle: the scheduler runs its self-checks; the server must still serve.
        time.sleep(IDLE_WAIT_S)
        result["alive_after_idle"] = srv.proc.poll() is None
        result["health_generate_after_idle"] = _get_status(
            srv.url + "/health_generate", timeout=120
        )
        result["after_idle"] = _phase(lambda: _outputs(srv, *w["after_idle"]))
        result["alive_at_end"] = srv.proc.poll() is None

    @classmethod
    def _negative_control(cls, srv: ExactServer) -> dict:
        """The control prompts armed, then disarmed again (batch 1)."""
        prompts = [cls.workload["seq"][0][i] for i in cls.nc_indices]
        with open(cls.arm_path, "w") as f:
            f.write("%d %d" % NC_MODES[NC_MODE])
        time.sleep(ARM_POLL_WAIT_S)
        try:
            armed = _outputs(srv, prompts, MAX_NEW_TOKENS)
        finally:
            os.remove(cls.arm_path)
            time.sleep(ARM_POLL_WAIT_S)
        try:
            with open(cls.arm_path + ".hits") as f:
                hits = int(f.read())
        except (OSError, ValueError):
            hits = 0
        return {
            "armed": armed,
            "hits": hits,
            "again": _outputs(srv, prompts, MAX_NEW_TOKENS),
        }

    def _result(self, role: str) -> dict:
        result = self.results[role]
        self.assertNotIn(
            "error", result, f"{role} server failed; log tail:\n{result['log_tail']}"
        )
        return result

    def _phase_outputs(self, role: str, phase: str) -> list:
        result = self._result(role)
        outputs = result[phase]
        self.assertIsInstance(
            outputs,
            list,
            f"{phase} failed on the {role} server: {outputs}; log tail:\n"
            f"{result['log_tail']}",
        )
        return outputs

    def _assert_phase_identical(self, phase: str, offload: str = "offload"):
        base = self._phase_outputs("baseline", phase)
        ours = self._phase_outputs(offload, phase)
        max_new = self.workload[phase][1]
        self.assertEqual(len(base), len(ours))
        mismatched = []
        for i, (a, b) in enumerate(zip(base, ours)):
            self.assertEqual(len(a), max_new)
            if a != b:
                mismatched.append((len(self.workload[phase][0][i]), first_diff(a, b)))
        self.assertEqual(
            mismatched,
            [],
            f"{phase}: (prompt length, first differing token) with the offload; "
            f"{offload} server log tail:\n{self.results[offload]['log_tail']}",
        )

    def _assert_offload_identical(self, offload: str):
        if offload not in self.SERVERS:
            self.skipTest(f"no {offload} server in this class")
        for phase in COMPARED_PHASES:
            with self.subTest(phase=phase):
                self._assert_phase_identical(phase, offload)

    def test_decode_outputs_identical(self):
        self._assert_phase_identical("seq")

    def test_requests_finishing_at_prefill(self):
        # The short requests' outputs come from their prefill; the requests
        # after them reuse their request slots (and must not inherit any
        # offload state of theirs).
        self._assert_phase_identical("short")
        self._assert_phase_identical("after_short")

    def test_fixed_buffer_outputs_identical(self):
        self._assert_offload_identical("offload_fixed")

    def test_concurrent_load_finishes(self):
        # Batch composition follows timing here: no output comparison (with
        # fp8 KV it changes sglang's own outputs), every request must finish.
        for role in self.SERVERS:
            with self.subTest(server=role):
                outputs = self._phase_outputs(role, "load")
                self.assertEqual(
                    [len(o) for o in outputs], [MAX_NEW_TOKENS] * len(LOAD_PROMPT_LENS)
                )
        base = self.results["baseline"]["load"]
        for role in self.SERVERS:
            ours = self.results[role]["load"]
            if role != "baseline" and isinstance(ours, list):
                same = sum(a == b for a, b in zip(base, ours))
                print(f"load phase, {role} vs baseline: {same}/{len(base)} identical")

    def test_server_healthy_after_idle(self):
        for role in self.SERVERS:
            with self.subTest(server=role):
                result = self._result(role)
                msg = f"{role} server log tail:\n{result['log_tail']}"
                self.assertTrue(result["alive_after_idle"], msg)
                self.assertEqual(result["health_generate_after_idle"], 200, msg)
                self._phase_outputs(role, "after_idle")
                self.assertTrue(result["alive_at_end"], msg)
                # Tracebacks (but sglang's harmless openai_harmony one) and
                # leak reports in the whole log.
                self.assertEqual(result["log"]["errors"], 0, msg)
                if role != "baseline":
                    # The comparisons went through host reads.
                    self.assertGreater(result["log"].get("misses", 0), 0, msg)
        self._assert_phase_identical("after_idle")

    def test_negative_control_flips_outputs(self):
        if self.nc_skip_reason is not None:
            self.skipTest(f"negative control unavailable: {self.nc_skip_reason}")
        result = self._result("baseline")
        msg = f"baseline server log tail:\n{result['log_tail']}"
        self.assertTrue(
            result["nc_log_line"],
            f"{ENV_CORRUPT} took no effect (no '{NC_LOG_LINE}' in the server "
            "log): nsa_topk_trace.py is installed but the NSA backend does not "
            f"call it (benchmark/nsa_offload/traces/bench_hooks/); {msg}",
        )
        nc = result["nc"]
        self.assertIsInstance(nc, dict, f"negative control failed: {nc}; {msg}")
        clean = [self._phase_outputs("baseline", "seq")[i] for i in self.nc_indices]
        lens = [SEQ_PROMPT_LENS[i] for i in self.nc_indices]
        report = negative_control(
            {
                "nc_clean": clean,
                f"nc_armed_{NC_MODE}": nc["armed"],
                "nc_hits": {NC_MODE: nc["hits"]},
            },
            lens,
            NC_MODE,
        )
        print(f"negative control ({NC_MODE}): {report}")
        self.assertGreater(nc["hits"], 0, "no top-k row was corrupted")
        # The first token comes from the prefill, which the control leaves alone.
        self.assertEqual(report["changed_before_corruption"], 0, report)
        self.assertGreaterEqual(
            report["flipped"], math.ceil(NC_MIN_FLIP_FRACTION * len(lens)), report
        )
        # Disarmed, the server repeats its clean outputs: the flips are the
        # corruption's, not run-to-run noise ...
        self.assertEqual(
            [first_diff(a, b) for a, b in zip(clean, nc["again"])],
            [None] * len(lens),
            "disarmed vs clean: first differing tokens",
        )
        # ... and those are the outputs every offload server gave.
        for role in self.SERVERS:
            if role != "baseline":
                ours = self._phase_outputs(role, "seq")
                self.assertEqual(
                    [first_diff(ours[i], c) for i, c in zip(self.nc_indices, clean)],
                    [None] * len(lens),
                    f"{role} vs baseline: first differing tokens",
                )


@unittest.skipIf(SKIP_REASON is not None, SKIP_REASON or "")
class TestDecodeNSAKVOffloadBF16(TestDecodeNSAKVOffload):
    """The same with a bf16 KV cache: FlashMLA sparse prefill and decode
    (``flashmla_sparse``), the offload's other supported pair."""

    SERVERS = {"baseline": "base_bf16", "offload": "ours_bf16"}
    PORT_OFFSET = 100


@unittest.skipIf(SKIP_REASON is not None, SKIP_REASON or "")
class TestDecodeNSAKVOffloadMTP(TestDecodeNSAKVOffload):
    """The same with MTP on every server (NextN, 3 steps, eagle topk 1, spec
    v1: ``exactness.mtp_args``): the target's verify forwards read 4 query
    tokens' top-k per request through the offload. Besides the outputs, each
    request's accept counts must match; the negative control corrupts the
    verify rows (``bench_hooks/0001``). The offload servers: the default one
    and one at verify's limits (buffer 4 x top-k, window 8, one unit)."""

    SERVERS = {
        "baseline": "base_fp8_mtp",
        "offload": "ours_fp8_mtp",
        "offload_fixed": "ours_fp8_mtp_heavy",
    }
    PORT_OFFSET = 300
    MTP = True

    def test_accept_counts_identical(self):
        base = self._result("baseline").get("seq_accept")
        self.assertIsNotNone(base, "no accept counts recorded")
        self.assertTrue(all(base), "sglang reported no speculation for a request")
        for role in self.SERVERS:
            if role == "baseline":
                continue
            with self.subTest(server=role):
                ours = self._result(role).get("seq_accept")
                self.assertIsNotNone(ours, "no accept counts recorded")
                report = compare_accept(ours, base)
                print(f"accept counts, {role} vs baseline: {report}")
                self.assertEqual(report["identical"], report["total"], report)


TWO_GPU_SKIP = SKIP_REASON or (
    None if torch.cuda.device_count() >= 2 else "requires two GPUs"
)


@unittest.skipIf(TWO_GPU_SKIP is not None, TWO_GPU_SKIP or "")
class TestDecodeNSAKVOffloadTP2(TestDecodeNSAKVOffload):
    """The same on two GPUs with attention TP (``--tp-size 2``: both ranks
    read one host pool, docs/MULTI_GPU.md), against the no-offload TP2
    server. The offload refuses TP unless
    ``SGLANG_NSA_KV_OFFLOAD_UNPROVEN_PARALLEL=1``, which its server sets: not
    yet run on GPUs."""

    SERVERS = {"baseline": "base_fp8_tp2", "offload": "ours_fp8_tp2"}
    PORT_OFFSET = 400


@unittest.skipIf(TWO_GPU_SKIP is not None, TWO_GPU_SKIP or "")
class TestDecodeNSAKVOffloadDP2(TestDecodeNSAKVOffload):
    """The same with DP attention on two GPUs (``--dp-size 2
    --enable-dp-attention``: each rank offloads its own requests)."""

    SERVERS = {"baseline": "base_fp8_dp2", "offload": "ours_fp8_dp2"}
    PORT_OFFSET = 500


@unittest.skipIf(SKIP_REASON is not None, SKIP_REASON or "")
class TestDecodeNSAKVOffloadPDDecode(CustomTestCase):
    """A PD decode server with the offload: requests arrive through sglang's
    fake KV transfer (KV unwritten, so dummy weights: no output comparison),
    are admitted into host slots, decode and finish; the server idles and
    still serves."""

    PROMPT_LENS = [20000 + 1000 * i for i in range(8)]
    MAX_NEW_TOKENS = 32

    @classmethod
    def setUpClass(cls):
        cls.tmp_dir = tempfile.mkdtemp(prefix="test_decode_nsa_kv_offload_pd_")
        cls.server = ExactServer(
            "pd_decode",
            PD_DECODE_FAKE_ARGS
            + [
                "--enable-decode-nsa-kv-offload",
                "--nsa-kv-offload-host-pool-gb",
                "8",
                "--max-running-requests",
                "16",
                "--mem-fraction-static",
                "0.7",
            ],
            _port_base(200),
            cls.tmp_dir,
            {"SGLANG_DSA_FUSE_TOPK": "0"},
            900,
        )
        try:
            cls.server.start().wait_ready()
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        server = getattr(cls, "server", None)
        if server is not None:
            _stop(server)
        shutil.rmtree(getattr(cls, "tmp_dir", ""), ignore_errors=True)

    def test_admit_decode_idle(self):
        prompts = random_prompts(self.PROMPT_LENS, 5, VOCAB_SIZE)
        # Server.generate gives each request its fake bootstrap room.
        outputs = self.server.generate_many(prompts, self.MAX_NEW_TOKENS, 4)
        self.assertEqual(
            [len(o["output_ids"]) for o in outputs], [self.MAX_NEW_TOKENS] * 8
        )
        time.sleep(IDLE_WAIT_S)
        self.assertIsNone(self.server.proc.poll())
        self.assertEqual(
            _get_status(self.server.url + "/health_generate", timeout=120), 200
        )
        text = _read_log(self.server)
        self.assertIn("0 staging rows", text)
        self.assertIn("nsa-offload hit rate", text)
        self.assertEqual(scan_log(self.server.log_path)["errors"], 0, text[-8000:])


if __name__ == "__main__":
    unittest.main()
