"""End-to-end exactness of --enable-decode-nsa-kv-offload on a real server (GPU).

Launches the tiny DeepSeek-V3.2-shaped model (dummy weights, 3 layers,
``benchmark/nsa_offload/server/tiny_dsv32_config.json``) twice, one server after the
other: without and with ``--enable-decode-nsa-kv-offload``. Both take the same
decode top-k path (positional top-k + page-table transform:
``SGLANG_NSA_FUSE_TOPK=0``), so greedy decoding must give the same tokens.
Each server gets the same workload:

1. ``main``: prompts of 3K-12K tokens, 64 new tokens, ``ignore_eos``,
   8 concurrent clients;
2. ``short``: ``2 x --max-running-requests`` requests, one after the other, that
   finish at their prefill (``max_new_tokens=1``: what ``/health_generate``
   sends). Under the overlap scheduler each of them is already in the next
   decode batch when its prefill result says it finished; each must give its
   decode region back (a leaked region is reused stale by the next request
   with the same request slot, or runs the server out of regions);
3. ``after_short``: concurrent long requests again; they reuse every request
   slot (and region) the short ones had;
4. idle: the scheduler goes idle (its own leak checks run), then the server
   must still answer ``/health_generate`` and a generation request.

The test checks identical ``output_ids`` for every phase and a healthy server
(the offload server runs with its default LRU units: idle regions and prefill
staging lent as extra buffers), also for a server with one fixed buffer per
request (``--nsa-kv-offload-max-units 1``) and one with the experimental
cross-layer prefetch (``SGLANG_NSA_KV_OFFLOAD_CROSS_LAYER_PREFETCH=1``). A
subclass repeats the no-offload / offload comparison with a bf16 KV cache
(FlashMLA sparse decode, ``--nsa-decode-backend flashmla_sparse``). Another
class starts a PD decode server (``--disaggregation-mode decode``, sglang's
fake KV transfer: no prefill server, KV unwritten, so no output comparison)
with the offload and checks that it admits, decodes, idles and still serves.
It needs a Hopper GPU with the DSA stack (``sgl_kernel.flash_mla``) and is
skipped elsewhere (e.g. in the CPU test suite).

    python -m pytest test/srt/test_decode_nsa_kv_offload.py -s
"""

import importlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_DSV32_CONFIG = (
    REPO_ROOT / "benchmark" / "nsa_offload" / "server" / "tiny_dsv32_config.json"
)
VOCAB_SIZE = 4096  # of the tiny config


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
# lack (datasets, aiohttp, ...): import it only where the test can run, and
# fall back to a minimal launcher when it is not importable.
CustomTestCase = unittest.TestCase
DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH = 600
DEFAULT_URL_FOR_TEST = "http://127.0.0.1:21000"
popen_launch_server = None
if SKIP_REASON is None:
    try:
        from sglang.test.test_utils import (
            DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
            DEFAULT_URL_FOR_TEST,
            CustomTestCase,
            popen_launch_server,
        )
    except Exception as e:  # pragma: no cover - depends on the GPU stack
        print(f"sglang.test.test_utils not importable ({e}); using a local launcher")

# Server flags of benchmark/nsa_offload/server/server_utils.py: fp8 KV with FlashMLA
# sparse prefill + FlashMLA fp8 decode, token ids only.
BASE_ARGS = [
    "--load-format",
    "dummy",
    "--kv-cache-dtype",
    "fp8_e4m3",
    "--nsa-prefill-backend",
    "flashmla_sparse",
    "--nsa-decode-backend",
    "flashmla_kv",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
    "--skip-tokenizer-init",
    "--disable-radix-cache",
    "--mem-fraction-static",
    "0.7",
]
BASE_ENV = {
    "SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0",
    "HF_HUB_OFFLINE": "1",
    # Both servers on the positional top-k path (see module docstring).
    "SGLANG_NSA_FUSE_TOPK": "0",
}
# Request slots = decode regions; more than the main phase's concurrency, so
# the main phase never reuses a slot of a request that finished at prefill.
MAX_RUNNING_REQUESTS = 32
OFFLOAD_ARGS = [
    "--enable-decode-nsa-kv-offload",
    "--nsa-kv-offload-host-pool-gb",
    "8",
]

MAX_NEW_TOKENS = 64
CONCURRENCY = 8
MAIN_PROMPT_LENS = [3000 + i * 600 for i in range(16)]  # 3000 .. 12000
SHORT_PROMPT_LENS = [100 + 37 * i for i in range(2 * MAX_RUNNING_REQUESTS)]
AFTER_SHORT_PROMPT_LENS = [3000 + i * 400 for i in range(CONCURRENCY)]
IDLE_WAIT_S = 12


def _random_prompts(lengths: List[int], seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def _post_json(url: str, payload: dict, timeout: float = 1800) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


# Known harmless traceback: sglang logs one at startup when the optional
# openai_harmony package is missing (OpenAIServingResponses is then off).
_HARMLESS_TRACEBACK = "Can not initialize OpenAIServingResponses, error: Traceback"


def _unexpected_tracebacks(log: str) -> int:
    return log.count("Traceback") - log.count(_HARMLESS_TRACEBACK)


def _get_status(url: str, timeout: float = 60) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return -1


def _generate(base_url: str, input_ids: List[int], max_new_tokens: int) -> List[int]:
    out = _post_json(
        base_url + "/generate",
        {
            "input_ids": input_ids,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        },
    )
    return out["output_ids"]


def _generate_many(
    base_url: str, prompts: List[List[int]], max_new_tokens: int, concurrency: int
) -> List[List[int]]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: _generate(base_url, p, max_new_tokens), prompts))


def _local_popen_launch_server(
    model, base_url, timeout, other_args=(), env=None, return_stdout_stderr=None
):
    """Minimal stand-in for sglang.test.test_utils.popen_launch_server."""
    host, port = base_url.split("//")[1].split(":")
    command = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        *[str(x) for x in other_args],
        "--host",
        host,
        "--port",
        port,
    ]
    stdout, stderr = return_stdout_stderr or (None, None)
    process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env)
    tic = time.perf_counter()
    while time.perf_counter() - tic < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode}")
        if _get_status(base_url + "/health_generate", timeout=5) == 200:
            return process
        time.sleep(5)
    _kill(process)
    raise TimeoutError("server failed to start within the timeout period")


def _launch_env(tmp_dir: str, extra_env: Optional[Dict[str, str]] = None) -> dict:
    env = {**os.environ, **BASE_ENV, **(extra_env or {})}
    if popen_launch_server is not None and shutil.which("sglang") is None:
        # popen_launch_server runs the `sglang` console script; provide it
        # when sglang is installed without scripts (e.g. pip --target).
        bin_dir = os.path.join(tmp_dir, "bin")
        os.makedirs(bin_dir, exist_ok=True)
        script = os.path.join(bin_dir, "sglang")
        with open(script, "w") as f:
            f.write(
                f'#!/bin/sh\nexec "{sys.executable}" -c "import sys; '
                'from sglang.cli.main import main; sys.exit(main())" "$@"\n'
            )
        os.chmod(script, 0o755)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    return env


def _kill(process) -> None:
    if process is None or process.poll() is not None:
        return
    try:
        from sglang.srt.utils import kill_process_tree

        kill_process_tree(process.pid)
    except Exception:
        process.kill()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass


@unittest.skipIf(SKIP_REASON is not None, SKIP_REASON or "")
class TestDecodeNSAKVOffload(CustomTestCase):
    """Same greedy outputs with and without the decode NSA KV offload."""

    # KV dtype and NSA backends of every server of the class (fp8 + FlashMLA
    # fp8 decode; the bf16 subclass swaps them) and its servers.
    KV_ARGS: List[str] = []
    SERVERS = ("baseline", "offload", "offload_fixed", "offload_prefetch")

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
        cls.model_dir = os.path.join(cls.tmp_dir, "tiny_dsv32")
        os.makedirs(cls.model_dir)
        shutil.copy(TINY_DSV32_CONFIG, os.path.join(cls.model_dir, "config.json"))
        cls.base_url = DEFAULT_URL_FOR_TEST
        cls.process = None
        cls.log_files = []
        cls.workload = {
            "main": (_random_prompts(MAIN_PROMPT_LENS, seed=0), MAX_NEW_TOKENS),
            "short": (_random_prompts(SHORT_PROMPT_LENS, seed=1), 1),
            "after_short": (
                _random_prompts(AFTER_SHORT_PROMPT_LENS, seed=2),
                MAX_NEW_TOKENS,
            ),
        }
        common = ["--max-running-requests", str(MAX_RUNNING_REQUESTS)]
        cls.results = {}
        servers = {
            "baseline": (common, None),
            "offload": (common + OFFLOAD_ARGS, None),
            "offload_fixed": (
                common + OFFLOAD_ARGS + ["--nsa-kv-offload-max-units", "1"],
                None,
            ),
            "offload_prefetch": (
                common + OFFLOAD_ARGS,
                {"SGLANG_NSA_KV_OFFLOAD_CROSS_LAYER_PREFETCH": "1"},
            ),
        }
        for name in cls.SERVERS:
            args, env = servers[name]
            cls.results[name] = cls._run_server(name, cls.KV_ARGS + args, env)

    @classmethod
    def tearDownClass(cls):
        _kill(getattr(cls, "process", None))
        for f in getattr(cls, "log_files", []):
            f.close()
        shutil.rmtree(getattr(cls, "tmp_dir", ""), ignore_errors=True)

    @classmethod
    def _run_server(
        cls, name: str, extra_args: List[str], extra_env: Optional[Dict] = None
    ) -> dict:
        log_out = os.path.join(cls.tmp_dir, f"{name}.stdout.log")
        log_err = os.path.join(cls.tmp_dir, f"{name}.stderr.log")
        # Closed in tearDownClass: popen_launch_server's reader threads may
        # still write to them after the server is killed.
        out, err = open(log_out, "w"), open(log_err, "w")
        cls.log_files += [out, err]
        launch = popen_launch_server or _local_popen_launch_server
        cls.process = launch(
            cls.model_dir,
            cls.base_url,
            timeout=DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
            # later flags win: KV_ARGS may override BASE_ARGS' dtype/backends
            other_args=BASE_ARGS + extra_args,
            env=_launch_env(cls.tmp_dir, extra_env),
            return_stdout_stderr=(out, err),
        )
        try:
            result = cls._run_workload(name)
        finally:
            _kill(cls.process)
            cls.process = None
        out.flush()
        err.flush()
        result["log_tail"] = cls._tail(log_err) + cls._tail(log_out)
        return result

    @classmethod
    def _run_workload(cls, name: str) -> dict:
        """Outputs per phase (a list of output_ids lists, or the error text
        when the phase failed: the tests report it with the server log)."""
        url = cls.base_url

        def phase(run):
            try:
                return run()
            except Exception as e:
                return f"{type(e).__name__}: {e}"

        result = {}
        tic = time.perf_counter()
        prompts, max_new = cls.workload["main"]
        result["main"] = phase(
            lambda: _generate_many(url, prompts, max_new, CONCURRENCY)
        )
        # One after the other: each is the only request when its prefill runs.
        short, short_max_new = cls.workload["short"]
        result["short"] = phase(
            lambda: [_generate(url, p, short_max_new) for p in short]
        )
        after, after_max_new = cls.workload["after_short"]
        result["after_short"] = phase(
            lambda: _generate_many(url, after, after_max_new, CONCURRENCY)
        )
        print(f"[{name}] workload done in {time.perf_counter() - tic:.1f} s")

        # Idle: the scheduler runs its self-checks; the server must still serve.
        time.sleep(IDLE_WAIT_S)
        result["alive_after_idle"] = cls.process.poll() is None
        result["health_generate_after_idle"] = _get_status(
            url + "/health_generate", timeout=120
        )
        prompt = _random_prompts([500], seed=3)[0]
        result["after_idle"] = phase(lambda: _generate(url, prompt, 16))
        result["alive_at_end"] = cls.process.poll() is None
        return result

    @staticmethod
    def _tail(path: str, lines: int = 40) -> str:
        try:
            with open(path) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def _assert_phase_identical(self, phase: str, offload: str = "offload"):
        base = self.results["baseline"][phase]
        ours = self.results[offload][phase]
        for name, outputs in (("baseline", base), (offload, ours)):
            self.assertIsInstance(
                outputs,
                list,
                f"{phase} failed on the {name} server: {outputs}; log tail:\n"
                f"{self.results[name]['log_tail']}",
            )
        self.assertEqual(len(base), len(ours))
        mismatched = []
        for i, (a, b) in enumerate(zip(base, ours)):
            self.assertEqual(len(a), self.workload[phase][1])
            if a != b:
                first = next(
                    (j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                    min(len(a), len(b)),
                )
                mismatched.append((i, first))
        self.assertEqual(
            mismatched,
            [],
            f"{phase}: (request, first differing token) with the offload; "
            f"{offload} server log tail:\n{self.results[offload]['log_tail']}",
        )

    def test_decode_outputs_identical(self):
        self._assert_phase_identical("main")

    def test_requests_finishing_at_prefill(self):
        # The short requests' outputs come from their prefill; the requests
        # after them reuse their request slots (and must not inherit any
        # offload state of theirs).
        self._assert_phase_identical("short")
        self._assert_phase_identical("after_short")

    def test_fixed_buffer_outputs_identical(self):
        if "offload_fixed" not in self.SERVERS:
            self.skipTest("no fixed-buffer server in this class")
        for phase in ("main", "short", "after_short"):
            self._assert_phase_identical(phase, offload="offload_fixed")

    def test_cross_layer_prefetch_outputs_identical(self):
        if "offload_prefetch" not in self.SERVERS:
            self.skipTest("no prefetch server in this class")
        for phase in ("main", "short", "after_short"):
            self._assert_phase_identical(phase, offload="offload_prefetch")
        log = self.results["offload_prefetch"]["log_tail"]
        self.assertEqual(_unexpected_tracebacks(log), 0, log)

    def test_server_healthy_after_idle(self):
        for name in self.SERVERS:
            result = self.results[name]
            msg = f"{name} server log tail:\n{result['log_tail']}"
            self.assertTrue(result["alive_after_idle"], msg)
            self.assertEqual(result["health_generate_after_idle"], 200, msg)
            self.assertIsInstance(result["after_idle"], list, msg)
            self.assertEqual(len(result["after_idle"]), 16, msg)
            self.assertTrue(result["alive_at_end"], msg)
        self.assertEqual(
            self.results["baseline"]["after_idle"],
            self.results["offload"]["after_idle"],
        )


@unittest.skipIf(SKIP_REASON is not None, SKIP_REASON or "")
class TestDecodeNSAKVOffloadBF16(TestDecodeNSAKVOffload):
    """The same with a bf16 KV cache: FlashMLA sparse prefill and decode
    (``flashmla_sparse``), the offload's other supported pair."""

    # = BF16_KV_ARGS of benchmark/nsa_offload/server/server_utils.py (this upstream-
    # style test stays self-contained, as with BASE_ARGS).
    KV_ARGS = [
        "--kv-cache-dtype",
        "bfloat16",
        "--nsa-prefill-backend",
        "flashmla_sparse",
        "--nsa-decode-backend",
        "flashmla_sparse",
    ]
    SERVERS = ("baseline", "offload")


@unittest.skipIf(SKIP_REASON is not None, SKIP_REASON or "")
class TestDecodeNSAKVOffloadPDDecode(CustomTestCase):
    """A PD decode server with the offload: requests arrive through sglang's
    fake KV transfer (KV unwritten), are admitted into host slots, decode and
    finish; the server idles and still serves."""

    PROMPT_LENS = [20000 + 1000 * i for i in range(8)]
    MAX_NEW_TOKENS = 32

    @classmethod
    def setUpClass(cls):
        cls.tmp_dir = tempfile.mkdtemp(prefix="test_decode_nsa_kv_offload_pd_")
        model_dir = os.path.join(cls.tmp_dir, "tiny_dsv32")
        os.makedirs(model_dir)
        shutil.copy(TINY_DSV32_CONFIG, os.path.join(model_dir, "config.json"))
        cls.log = open(os.path.join(cls.tmp_dir, "server.log"), "w")
        launch = popen_launch_server or _local_popen_launch_server
        cls.process = None
        try:
            cls.process = launch(
                model_dir,
                DEFAULT_URL_FOR_TEST,
                timeout=DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
                other_args=BASE_ARGS
                + OFFLOAD_ARGS
                + [
                    "--max-running-requests",
                    "16",
                    "--disaggregation-mode",
                    "decode",
                    "--disaggregation-transfer-backend",
                    "fake",
                ],
                env=_launch_env(cls.tmp_dir),
                return_stdout_stderr=(cls.log, cls.log),
            )
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        _kill(getattr(cls, "process", None))
        log = getattr(cls, "log", None)
        if log is not None:
            log.close()
        shutil.rmtree(getattr(cls, "tmp_dir", ""), ignore_errors=True)

    def _generate(self, input_ids, room):
        out = _post_json(
            DEFAULT_URL_FOR_TEST + "/generate",
            {
                "input_ids": input_ids,
                "sampling_params": {
                    "max_new_tokens": self.MAX_NEW_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
                # sglang's fake transfer: this bootstrap host marks the request
                "bootstrap_host": "2.2.2.2",
                "bootstrap_port": 8998,
                "bootstrap_room": room,
            },
        )
        return out["output_ids"]

    def test_admit_decode_idle(self):
        prompts = _random_prompts(self.PROMPT_LENS, seed=5)
        with ThreadPoolExecutor(4) as pool:
            outputs = list(pool.map(self._generate, prompts, range(1, 9)))
        self.assertEqual([len(o) for o in outputs], [self.MAX_NEW_TOKENS] * 8)
        time.sleep(IDLE_WAIT_S)
        self.assertIsNone(self.process.poll())
        self.assertEqual(
            _get_status(DEFAULT_URL_FOR_TEST + "/health_generate", timeout=120), 200
        )
        self.log.flush()
        with open(self.log.name) as f:
            text = f.read()
        self.assertIn("0 staging rows", text)
        self.assertIn("nsa-offload hit rate", text)
        self.assertEqual(_unexpected_tracebacks(text), 0, text[-8000:])


if __name__ == "__main__":
    unittest.main()
