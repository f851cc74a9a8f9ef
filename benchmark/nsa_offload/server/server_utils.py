"""Launch a real sglang server with a DeepSeek-V3.2-shaped model and talk to it
with token ids only (stdlib HTTP, no tokenizer).

The model is the tiny config with dummy weights unless ``use_model`` names
another config (``rank``) or a generated checkpoint (``make_checkpoint.py``),
which every ``Server`` then loads with sglang's own loader."""

import importlib.metadata
import importlib.util
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
TINY_CONFIG = HERE / "tiny_dsv32_config.json"
VOCAB_SIZE = 4096

# The stack on the H200 host (see ../shared/DEVICE.md): trimmed sgl-kernel
# without FA3, fp8 KV with FlashMLA sparse prefill + FlashMLA fp8 decode.
BASE_ARGS = [
    "--load-format",
    "dummy",
    "--kv-cache-dtype",
    "fp8_e4m3",
    "--dsa-prefill-backend",
    "flashmla_sparse",
    "--dsa-decode-backend",
    "flashmla_kv",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
    "--skip-tokenizer-init",
    "--disable-radix-cache",
]

# The other KV dtype the offload supports: bf16 KV, FlashMLA sparse prefill
# and decode. Appended after BASE_ARGS (sglang's argparse: the later flag wins).
BF16_KV_ARGS = [
    "--kv-cache-dtype",
    "bfloat16",
    "--dsa-prefill-backend",
    "flashmla_sparse",
    "--dsa-decode-backend",
    "flashmla_sparse",
]
KV_DTYPE_ARGS = {"fp8_e4m3": [], "bfloat16": BF16_KV_ARGS}
# The offload refuses attention TP / DP attention unless this is set
# (docs/MULTI_GPU.md): the only environment variable the offload reads.
ENV_UNPROVEN_PARALLEL = "SGLANG_NSA_KV_OFFLOAD_UNPROVEN_PARALLEL"
# The decode log's units (nsa_kv_offload_coordinator.py): extra units held, and
# since 64f802f the units moved between requests over the log interval.
# With idle-loc units: how many of them the idle locs' keys lend.
UNITS_RE = re.compile(
    r"extra units: (\d+) \(\d+ of staging(?:, (\d+) moved)?(?:, (\d+) of idle locs)?\)"
)
# Since stop 60: the units the poorest and the richest running request hold.
UNITS_PER_REQUEST_RE = re.compile(r", units per request: (\d+)-(\d+)")
# Since stop 61: units taken back by their lenders over the log interval, and
# of those the ones whose rows a copy kept (shown when any was taken back).
UNITS_RECLAIMED_RE = re.compile(r", units reclaimed: (\d+) \((\d+) kept by a copy\)")
# With direct slots: the requests swapping in direct mode (slot = position).
DIRECT_RE = re.compile(r", direct: (\d+)")
# Admissions warmed over the log interval, and the GB their warm-ups copied.
WARMED_RE = re.compile(r", warmed: (\d+) \(([\d.]+) GB\)")
# The server flags of the two-GPU shapes: attention TP, DP attention.
SHAPES = {
    "tp2": ["--tp-size", "2"],
    "dp2": ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"],
}


def git_commit() -> str:
    """The code a run ran on. The device's copy of the tree may carry a
    stale .git: the caller's ``CODE_COMMIT`` wins."""
    if os.environ.get("CODE_COMMIT"):
        return os.environ["CODE_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


def sglang_version() -> str:
    """The sglang release a run's servers import (the installed package's
    metadata; the GPU host's comes from its wheelhouse)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# Runs that predate the key ran on sglang 0.5.12.post1 (the only release then).
UNRECORDED_SGLANG_VERSION = "0.5.12.post1"


def recorded_sglang_version(record: dict):
    """A result's ``sglang_version`` (a release, or a list of them), or the
    release of the runs that predate the key."""
    return record.get("sglang_version") or UNRECORDED_SGLANG_VERSION


def release_key(version: str) -> tuple:
    """Orders sglang releases: 0.5.12.post1 < 0.5.17 < 0.5.23."""
    return tuple(int(part) for part in version.replace(".post", ".").split("."))


def one_or_sorted(values):
    """A summary's ``code_commit`` / ``sglang_version``: the one value, or
    the sorted list of several."""
    distinct = sorted(set(values))
    return distinct[0] if len(distinct) == 1 else distinct


def mtp_args(steps: int, spec_v2: bool = False) -> List[str]:
    """sglang's MTP recipe for DeepSeek-V3.2 with ``steps`` draft steps,
    without the overlap scheduler (``--disable-overlap-schedule``), or with
    ``spec_v2`` with it (sglang's default)."""
    args = [
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(steps + 1),
    ]
    return args if spec_v2 else args + ["--disable-overlap-schedule"]


# Upstream HiSparse, the peer (seen working on the H200, ../shared/DEVICE.md):
# with fp8 KV it insists on FlashMLA fp8 for prefill as well.
HISPARSE_CONFIG = {"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 4}
HISPARSE_ARGS = [
    "--enable-hisparse",
    "--hisparse-config",
    json.dumps(HISPARSE_CONFIG),
    "--dsa-prefill-backend",
    "flashmla_kv",
    "--dsa-decode-backend",
    "flashmla_kv",
]

# The context length of the checkpoints the benchmarks run (DeepSeek-V3.2's
# max_position_embeddings: the rank and tiny checkpoints keep it).
MODEL_CONTEXT_LEN = 163840


def offload_max_units(
    max_units: Optional[int],
    buffer_size: Optional[int],
    context_len: int = MODEL_CONTEXT_LEN,
    recent_window: int = 64,
) -> int:
    """LRU units per request an offload server runs with: ``max_units`` if
    given, else its default, the units that hold ``context_len`` below the
    window (``nsa_kv_offload_units.units_for_context``; the tests compare)."""
    if max_units is not None:
        return max_units
    below_window = max(context_len - recent_window, 0)
    return max(1, -(-below_window // (buffer_size or 4096)))


def widest_units(buffer_size: Optional[int]) -> int:
    """The most LRU units a request may span with int16 slot ids."""
    return 32767 // (buffer_size or 4096)


# A PD decode server with no prefill server: the fake transfer backend admits
# requests at once with their KV unwritten (capacity and speed only).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang.srt.disaggregation.utils
PD_DECODE_FAKE_ARGS = [
    "--disaggregation-mode",
    "decode",
    "--disaggregation-transfer-backend",
    "fake",
]
BASE_ENV = {
    "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0",
    "HF_HUB_OFFLINE": "1",
}


# What every Server loads: a config with dummy weights, or a checkpoint.
_MODEL = {"config": TINY_CONFIG, "checkpoint": None}


def use_model(config: str = "tiny", checkpoint: Optional[str] = None) -> None:
    """Make every later ``Server`` load ``config`` (``tiny``, ``rank`` or a
    config.json path) with dummy weights, or, with ``checkpoint``, that
    generated checkpoint directory (its own config.json) by sglang's loader."""
    if checkpoint is not None:
        config = os.path.join(checkpoint, "config.json")
    elif config in ("tiny", "rank"):
        config = HERE / f"{config}_dsv32_config.json"
    if not os.path.exists(config):
        raise FileNotFoundError(f"model config {config} does not exist")
    _MODEL.update(config=Path(config), checkpoint=checkpoint)


def model_config() -> dict:
    with open(_MODEL["config"]) as f:
        return json.load(f)


def num_model_layers() -> int:
    """Layers of the model the servers load."""
    return int(model_config()["num_hidden_layers"])


def model_weights_gib() -> float:
    """GPU memory of the model's weights (bf16, as sglang loads them here)."""
    from make_checkpoint import checkpoint_bytes

    return checkpoint_bytes(model_config()) / 2**30


def make_model_dir() -> str:
    d = tempfile.mkdtemp(prefix="dsv32_")
    shutil.copy(_MODEL["config"], os.path.join(d, "config.json"))
    return d


# The benchmark-only top-k tools (trace override, recorder, negative control)
# that scripts/apply_patch.py --with-bench-hooks installs into sglang.
BENCH_HOOKS_MODULE = "sglang.srt.layers.attention.nsa_topk_trace"


def bench_hooks_missing() -> Optional[str]:
    """Why the installed sglang lacks the benchmark hooks, or None. Looks for
    the module's file without importing sglang (servers started from this
    interpreter import the same one)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return "sglang is not installed"
    rel = Path(*BENCH_HOOKS_MODULE.split(".")[1:]).with_suffix(".py")
    for root in spec.submodule_search_locations:
        if (Path(root) / rel).is_file():
            return None
    return (
        f"the installed sglang has no {BENCH_HOOKS_MODULE} (install the "
        "benchmark hooks: scripts/apply_patch.py --with-bench-hooks)"
    )


class Server:
    """A sglang server process; ``with Server(...) as s:`` waits for health."""

    def __init__(
        self,
        name: str,
        extra_args: Sequence[str],
        port: int,
        log_dir: str,
        env: Optional[Dict[str, str]] = None,
        timeout: float = 600.0,
    ):
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(log_dir, f"server_{name}.log")
        checkpoint = _MODEL["checkpoint"]
        # A checkpoint is shared by the servers and outlives them.
        self.model_dir = None if checkpoint else make_model_dir()
        self.cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            checkpoint or self.model_dir,
            "--port",
            str(port),
            *BASE_ARGS,
            *(["--load-format", "auto"] if checkpoint else []),
            *extra_args,
        ]
        self.env = {**os.environ, **BASE_ENV, **(env or {})}
        self.timeout = timeout
        self.proc = None
        args = list(extra_args)
        self.fake_transfer = any(
            args[i : i + 2] == PD_DECODE_FAKE_ARGS[2:] for i in range(len(args))
        )
        self._room_lock = threading.Lock()
        self._next_room = 0

    def __enter__(self):
        return self.start().wait_ready()

    def start(self) -> "Server":
        """Launch the server process without waiting for it (several servers
        can then start at once)."""
        # A port already taken would make the health check below answer for
        # another process's server.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                raise RuntimeError(
                    f"[{self.name}] port {self.port} is in use (another server?): "
                    "pass another --port"
                )
        print(f"[{self.name}] {' '.join(self.cmd)}", flush=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env
        )
        self.started = time.time()
        return self

    def wait_ready(self) -> "Server":
        """Until ``/health`` answers (the process dying or the timeout raise)."""
        while time.time() - self.started < self.timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"[{self.name}] server exited with {self.proc.returncode}:\n"
                    + self.tail()
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        print(
                            f"[{self.name}] ready in {time.time() - self.started:.0f} s",
                            flush=True,
                        )
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        raise RuntimeError(f"[{self.name}] not healthy after {self.timeout} s")

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()
        if self.model_dir is not None:
            shutil.rmtree(self.model_dir, ignore_errors=True)

    def tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def transfer_fields(self) -> dict:
        """What a request needs on this server: with sglang's fake KV transfer
        a bootstrap host that marks the request (without one the decode
        scheduler fails to build its address) and a room of its own."""
        if not self.fake_transfer:
            return {}
        with self._room_lock:
            self._next_room += 1
            room = self._next_room
        return dict(
            bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_port=8998, bootstrap_room=room
        )

    def generate(self, input_ids: List[int], max_new_tokens: int) -> dict:
        payload = {
            "input_ids": input_ids,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        }
        payload.update(self.transfer_fields())
        body = json.dumps(payload).encode()
        req = urllib.request.Request(
            self.url + "/generate",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=1800) as r:
            return json.loads(r.read())

    def generate_many(
        self, prompts: List[List[int]], max_new_tokens: int, concurrency: int
    ) -> List[dict]:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda p: self.generate(p, max_new_tokens), prompts))


def random_prompts(
    lengths: Sequence[int], seed: int, vocab: int = VOCAB_SIZE
) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]
