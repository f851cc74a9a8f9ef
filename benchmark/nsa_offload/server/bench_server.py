"""Server benchmark: no offload vs HiSparse vs decode NSA KV offload (GPU host).

Starts the tiny DeepSeek-V3.2-shaped model three times, one server after the
other, with the same GPU memory budget (the same ``--mem-fraction-static``)
and the same request slots: without offload, with upstream ``--enable-hisparse``
and with ``--enable-decode-nsa-kv-offload``. Every server takes the positional
top-k path (``SGLANG_DSA_FUSE_TOPK=0``). Per server: a warm-up, then for each
context length and concurrency, that many requests of that many prompt tokens
with ``--new-tokens`` greedy tokens each (``ignore_eos``), streamed.

Measured per (server, context, concurrency), see README.md "Server benchmark":

* decode throughput and inter-token latency from the server's own decode log
  (``gen throughput`` of the lines logged while the batch held all requests;
  ITL = batch / throughput), and from the client (streamed chunk times);
* misses per decode step: ours from its decode log; HiSparse logs none, so
  both policies are also replayed (``replay.py`` models) on the top-k rows the
  server actually used, recorded in the server
  (``SGLANG_NSA_TOPK_TRACE_RECORD``);
* capacity: requests of a context length the server's pools admit at once,
  from the pool sizes the server logs.

``--topk model`` uses the model's own top-k, ``--topk override`` replaces it on
every server alike with a calibrated synthetic trace (``trace_gen.py``, at the
benchmark's context lengths; ``SGLANG_NSA_TOPK_TRACE_OVERRIDE``); in that mode
the recorded rows are also checked against a CPU recomputation of the override.

``--pd-decode`` makes every server a PD decode server fed by sglang's fake
KV transfer: requests are admitted without their prefill (long contexts at
large batch in seconds, e.g. the rank model at 128K), their KV unwritten, so
only with ``--topk override``.

``--churn N``: requests coming and going instead of one burst per run: each
of the ``--concurrency`` clients sends N requests back to back (a new prompt
each, the first wave ending staggered), so that admissions, and what they
stall, fall inside the measured window; P4 then compares the clients' mean
ITL (a burst's steady server-log figures leave the admissions out).

With MTP (``--servers baseline_mtp,ours_mtp,ours``, ``--mtp-steps``: NextN,
eagle topk 1, without the overlap scheduler) the target's verify forwards get the same top-k
(the override maps each query row as the decode step at its length); P4's
MTP line is ours + MTP vs no offload + MTP (ITL per output token, from the
decode log's throughput), another line ours + MTP vs ours.

    # ~6-9 min on an H200 each (warm JIT caches)
    python benchmark/nsa_offload/server/bench_server.py --quick --topk model --out OUT/model
    python benchmark/nsa_offload/server/bench_server.py --quick --topk override --out OUT/override
    # tables + PNGs of both runs (any machine with matplotlib)
    python benchmark/nsa_offload/server/bench_server.py --plot-only OUT/model/bench_server_model.json \\
        OUT/override/bench_server_override.json --out OUT

With ``--model rank`` runs among them, ``--plot-only`` over one session's runs
(model top-k, ``reported`` and ``pessimistic`` overrides) also writes
``summary_rank_model.json`` and ``summary_rank_speed.json``: the committed
summaries of results/rank_model/ and results/rank_speed/ (``rank_summaries``);
runs with the MTP pair write ``summary_mtp_speed.json`` (results/mtp/'s ITL
ratios, beside exactness.py's ``mtp`` part).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
# The trace tools (trace_format, trace_gen, replay) live in ../traces/.
TRACES_DIR = HERE.parent / "traces"
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(TRACES_DIR))

import step_profile  # noqa: E402
from server_utils import (  # noqa: E402
    DIRECT_RE,
    ENV_UNPROVEN_PARALLEL,
    HISPARSE_ARGS,
    HISPARSE_CONFIG,
    PD_DECODE_FAKE_ARGS,
    SHAPES,
    UNITS_PER_REQUEST_RE,
    UNITS_RE,
    UNITS_RECLAIMED_RE,
    VOCAB_SIZE,
    WARMED_RE,
    Server,
    git_commit,
    model_weights_gib,
    mtp_args,
    num_model_layers,
    offload_max_units,
    one_or_sorted,
    recorded_sglang_version,
    release_key,
    sglang_version,
    use_model,
    widest_units,
)

TRACE_FORMAT_PY = TRACES_DIR / "trace_format.py"
MAX_CHECKED_ROWS = 3000  # override check: rows recomputed per run
TOPK_TRACE_PY = TRACES_DIR / "nsa_topk_trace.py"
# Variants of ours measured side by side with it, each with its own P4 line
# (in the order of the reports' lines). The runnable ones differ from ours by
# real server flags only (--nsa-kv-offload-max-units); the others name
# committed runs only (READ_ONLY_KINDS).
OURS_VARIANT_KINDS = (
    "ours_fixed",
    "ours_wide",
    "ours_prefetch",
    "ours_prefetch_early",
    "ours_early",
    "ours_inline",
    "ours_direct",
    "ours_warm",
    "ours_warm_prefetch",
    "ours_warm_flat",
    "ours_warm_rope",
    "ours_warm_direct",
    "ours_warm_direct_flat",
    "ours_classic",
    "ours_8units",
    "ours_bounded_warm",
    "ours_elastic",
    "ours_idle_locs",
    "ours_idle_locs_bounded",
    "ours_clock",
    "ours_clock_warm",
    "ours_warm_direct_narrow",
    "ours_warm_late",
    "ours_units",
)
OURS_VARIANTS = {kind: "P4_" + kind[len("ours_") :] for kind in OURS_VARIANT_KINDS}
SERVER_KINDS = (
    ("baseline", "ours") + OURS_VARIANT_KINDS + ("hisparse", "baseline_mtp", "ours_mtp")
)
DEFAULT_SERVERS = "baseline,ours,hisparse"
# With MTP (--mtp-steps): each pair compared as P4 is, its own line.
MTP_COMPARISONS = {
    "P4_mtp": ("ours_mtp", "baseline_mtp"),  # the offload's cost with MTP
    "mtp_vs_no_mtp": ("ours_mtp", "ours"),  # what MTP buys the offload
}
OFFLOAD_KINDS = ("ours",) + tuple(OURS_VARIANTS) + ("ours_mtp",)
# The no-offload servers: the ratios' denominators.
REFERENCE_KINDS = ("baseline", "baseline_mtp")
# Recorded in every run (rank_summaries reads them): "ours" runs the early
# swap (before the runs that record this, "ours" was the inline swap and the
# early one "ours_early") and the elastic defaults (warm units, direct slots,
# spare regions, idle-loc units, units of the model's context; before, "ours"
# was the classic default of up to 4 cold units, ours_classic). Both are the
# design now: no switch turns them off.
OURS_EARLY_SWAP_DEFAULT = True
OURS_ELASTIC_DEFAULT = True
# Runs on the elastic defaults from before the bench recorded them: stop 58's
# H200 calls, on the tree of 834aede (the commit was 722e45f then).
ELASTIC_DEFAULT_UNRECORDED = ("722e45f",)
# Kinds of committed runs that no longer run, and why (their labels and
# colours stay: --plot-only re-renders those runs, rank_summaries reads them).
_PREFETCH_GONE = "the cross-layer prefetch was removed from the offload"
_DEFAULT_NOW = (
    "its settings are ours' default and no switch turns them off: run ours "
    "(ours_fixed: one unit, --max-units N: N units)"
)
READ_ONLY_KINDS = {
    "ours_prefetch": _PREFETCH_GONE,
    "ours_prefetch_early": _PREFETCH_GONE,
    "ours_early": "the early swap is ours' schedule (no switch): run ours",
    "ours_inline": "the inline swap cannot be configured any more (the early "
    "swap is ours' schedule)",
    "ours_direct": _DEFAULT_NOW,
    "ours_warm": _DEFAULT_NOW,
    "ours_warm_prefetch": _PREFETCH_GONE,
    "ours_warm_flat": "the flat miss copy was removed from the offload",
    "ours_warm_rope": "the swap after the rope was removed from the offload",
    "ours_warm_direct": _DEFAULT_NOW,
    "ours_warm_direct_flat": "the flat miss copy was removed from the offload",
    "ours_classic": "the classic defaults (4 cold units, no warm units or direct "
    "slots) cannot be configured any more: ours_fixed runs one unit",
    "ours_bounded_warm": "the bounded direct warm-up was removed from the offload",
    "ours_elastic": "idle-loc units cannot be turned off: run ours",
    "ours_idle_locs": _DEFAULT_NOW,
    "ours_idle_locs_bounded": "the bounded direct warm-up was removed from the "
    "offload",
    "ours_clock": "CLOCK replacement was removed from the offload",
    "ours_clock_warm": "CLOCK replacement was removed from the offload",
    "ours_units": "units are ours' default now (--max-units N sets them); "
    "ours_fixed runs ours with one unit",
    "ours_warm_late": "the late reorder was removed (07bce18, no gain: "
    "results/rank_speed/run_late_reorder/)",
    "ours_warm_direct_narrow": "the narrow reorder was removed (8315256: wrong "
    "tokens on the H200, and slower: results/exactness/tiny_reorder_regression/)",
}
RUNNABLE_KINDS = tuple(k for k in SERVER_KINDS if k not in READ_ONLY_KINDS)
LABELS = {
    "baseline": "no offload",
    "hisparse": "HiSparse",
    "ours": "ours",
    "ours_fixed": "ours, fixed buffer",
    "ours_wide": "ours, widest units",
    "ours_prefetch": "ours + prefetch",
    "ours_prefetch_early": "ours + prefetch, early swap",
    "ours_early": "ours, early swap",
    "ours_inline": "ours, inline swap",
    "ours_direct": "ours, direct slots",
    "ours_warm": "ours, warm units",
    "ours_warm_prefetch": "ours, warm units + prefetch",
    "ours_warm_flat": "ours, warm units + flat miss copy",
    "ours_warm_rope": "ours, warm units, swap after rope",
    "ours_warm_direct": "ours, warm units + direct slots",
    "ours_warm_direct_flat": "ours, warm units + direct slots + flat miss copy",
    "ours_classic": "ours, the classic defaults (4 cold units)",
    "ours_8units": "ours, at most 8 units",
    "ours_bounded_warm": "ours, direct warm-up of the newest 2,048 positions",
    "ours_elastic": "ours, elastic settings (warm units + direct slots + spare "
    "regions, 40 units)",
    "ours_idle_locs": "ours, elastic settings + idle-loc units, 40 units",
    "ours_idle_locs_bounded": "ours, idle-loc units, direct warm-up of the newest "
    "2,048 positions",
    "ours_clock": "ours, CLOCK",
    "ours_clock_warm": "ours, CLOCK + warm units + spare regions, 40 units",
    "ours_warm_direct_narrow": "ours, warm units + direct slots + flat copy + "
    "narrow reorder",
    "ours_warm_late": "ours, warm units + late reorder",
    "ours_units": "ours + units",
    "baseline_mtp": "no offload + MTP",
    "ours_mtp": "ours + MTP",
}
PAGE_SIZE = 64
ROW_BYTES = 656  # fp8 FlashMLA KV row of one token, one layer
# H2D rate of the offload's miss copy on the H200 (pinned host -> GPU, 656 B
# rows: results/copy_and_swap/bench_copy.md; 48-49 GB/s in a live server's
# profile, git history 5a9b9c1:benchmark/nsa_offload/results/h200_bench_server_s6/).
MISS_COPY_BYTES_PER_S = 48e9
INDEXER_BYTES = 132  # fp8 indexer key + fp32 scale
# The fp8 row sglang's pool sizing counts (kv_lora_rank + rope dims, one byte
# each); the offload's budget is what that pool really allocates
# (NSAKVOffloadPoolConfigurator.budget_bytes).
NOMINAL_ROW_BYTES = 576
# sglang's weight memory beyond the bf16 tensors: 0.51 GiB seen on the H200
# for the tiny model, whose tensors are 0.30 GiB.
WEIGHTS_OVERHEAD_GIB = 0.21
CUDA_CONTEXT_GIB = 0.9  # free memory before start minus sglang's "avail mem"
CAPACITY_CONTEXTS = (16384, 32768, 65536, 131072)
SINKS = 64
RECENT = 1024

MODES = {
    "quick": dict(
        contexts=[16384, 32768],
        concurrency=[1, 8, 32],
        cap_contexts=[],
        new_tokens=256,
        time_budget_s=510.0,
        trace_steps=128,
    ),
    "full": dict(
        contexts=[16384, 32768, 65536],
        concurrency=[1, 8, 32],
        cap_contexts=[131072],
        new_tokens=256,
        time_budget_s=3000.0,
        trace_steps=128,
    ),
}

DECODE_RE = re.compile(
    r"Decode batch.*?#running-req: (\d+).*?gen throughput \(token/s\): "
    r"([0-9.]+), #queue-req: (\d+)"
)
OFFLOAD_RE = re.compile(
    r"nsa-offload hit rate: ([0-9.]+), misses: (\d+), (?:prefetched: \d+, )?"
    r"H2D: ([0-9.]+) GB/s"
)
STARTUP_RES = {
    "pre_load_avail_gib": re.compile(r"Load weight begin\. avail mem=([0-9.]+) GB"),
    "post_load_avail_gib": re.compile(r"Load weight end\..*avail mem=([0-9.]+) GB"),
    "pool_end_avail_gib": re.compile(r"Memory pool end\. avail mem=([0-9.]+) GB"),
    "graph_end_avail_gib": re.compile(
        r"Capture cuda graph end\..*avail mem=([0-9.]+) GB"
    ),
    "kv_tokens": re.compile(r"KV Cache is allocated\. #tokens: (\d+)"),
    "kv_size_gib": re.compile(r"KV Cache is allocated\..*KV size: ([0-9.]+) GB"),
    # The scheduler's line (the server_args dump names some keys too).
    "max_total_num_tokens": re.compile(r"max_total_num_tokens=(\d+)"),
    "max_running_requests": re.compile(
        r"max_total_num_tokens=\d+,.*max_running_requests=(\d+)"
    ),
    "context_len": re.compile(r"max_total_num_tokens=\d+,.*context_len=(\d+)"),
    "offload_locs": re.compile(r"NSA KV offload: (\d+) logical token locs"),
    "offload_regions": re.compile(r"(\d+) decode regions of (\d+) rows"),
    "offload_staging_rows": re.compile(r"(\d+) staging rows"),
    "host_pool_pin_s": re.compile(
        r"pinned [0-9.]+ GB of host memory .* in ([0-9.]+) s"
    ),
}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def page_up(n: int) -> int:
    return -(-n // PAGE_SIZE) * PAGE_SIZE


# ---------------------------------------------------------------- GPU memory


def _first_gpu_query(fields: str) -> Optional[str]:
    """One nvidia-smi CSV row (no header, no units) of ``fields`` for the
    first GPU this process sees (``CUDA_VISIBLE_DEVICES``, e.g. when two runs
    share a host), or None without nvidia-smi."""
    gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "-i",
                gpu,
                f"--query-gpu={fields}",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
        return out.strip().splitlines()[0] or None
    except Exception:
        return None


def gpu_name() -> Optional[str]:
    """The first visible GPU's name: timings compare only within one card
    kind (an H100 run beside an H200 run says nothing)."""
    return _first_gpu_query("name")


def gpu_memory_mib() -> Optional[Tuple[float, float]]:
    """(total, used) MiB of the first visible GPU, or None."""
    row = _first_gpu_query("memory.total,memory.used")
    try:
        total, used = (float(x) for x in row.split(","))
    except (AttributeError, ValueError):  # no nvidia-smi, or "[N/A]"
        return None
    return total, used


def select_model(args) -> Optional[dict]:
    """Make the servers load ``--model``: dummy weights, or with
    ``--checkpoint`` a generated checkpoint (written first where absent; on
    the GPU for ``rank``). Returns the checkpoint's metadata."""
    if args.checkpoint in (None, "none"):
        use_model(args.model)
        return None
    path = args.checkpoint
    if path == "auto":
        path = f"/tmp/ckpt_{args.model}_s0_q1_o1_a1"
    if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        from make_checkpoint import load_config, write_checkpoint

        device = "cuda" if args.model == "rank" else "cpu"
        write_checkpoint(load_config(args.model), path, device=device, progress=log)
    use_model(args.model, checkpoint=path)
    with open(os.path.join(path, "checkpoint_meta.json")) as f:
        return json.load(f)


def mem_fraction_for_budget(budget_gib: float) -> Tuple[float, str]:
    """``--mem-fraction-static`` giving about ``budget_gib`` to the KV pools.

    sglang gives the pools ``avail_after_weights - avail_before * (1 - f)``
    (``_profile_available_bytes``), i.e. ``f * avail_before - weights``.
    """
    mem = gpu_memory_mib()
    if mem is None:
        before, how = 139.1, "nvidia-smi unavailable: assumed 139.1 GiB available"
    else:
        before = (mem[0] - mem[1]) / 1024 - CUDA_CONTEXT_GIB
        how = f"{before:.1f} GiB available at start (nvidia-smi)"
    weights = model_weights_gib() + WEIGHTS_OVERHEAD_GIB
    return round((budget_gib + weights) / before, 5), how


def wait_gpu_released(used_before_mib: Optional[float], timeout: float = 60.0):
    if used_before_mib is None:
        time.sleep(3)
        return
    tic = time.time()
    while time.time() - tic < timeout:
        mem = gpu_memory_mib()
        if mem is None or mem[1] < used_before_mib + 1024:
            return
        time.sleep(1)
    log(f"warning: GPU memory still in use after {timeout:.0f} s")


def descendants(pid: int) -> List[int]:
    """PIDs of the processes below ``pid`` (from /proc)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class BenchServer(Server):
    """``server_utils.Server`` that also ends the processes its server started
    (by PID) if they outlive it, so the next server finds the GPU free."""

    def __exit__(self, *exc):
        pids = descendants(self.proc.pid) if self.proc is not None else []
        super().__exit__(*exc)
        for pid in pids:
            try:
                os.kill(pid, 0)
            except OSError:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


# ------------------------------------------------------------------ requests


def stream_generate(
    server: Server, input_ids: List[int], new_tokens: int, timeout: float
):
    """POST /generate with ``stream``; returns send time and (time, tokens)
    per SSE chunk (``meta_info.completion_tokens``: tokens so far)."""
    body = json.dumps(
        {
            "input_ids": input_ids,
            "sampling_params": {
                "max_new_tokens": new_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            "stream": True,
            **server.transfer_fields(),
        }
    ).encode()
    req = urllib.request.Request(
        server.url + "/generate",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    chunks: List[Tuple[float, int]] = []
    t_send = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            t = time.perf_counter()
            obj = json.loads(payload)
            if "error" in obj:
                raise RuntimeError(f"server error: {obj['error']}")
            meta = obj.get("meta_info", {})
            n = meta.get("completion_tokens")
            if n is None:
                n = len(obj.get("output_ids", []))
            chunks.append((t, int(n)))
    return t_send, chunks


def make_prompts(ctx: int, count: int, seed: int) -> List[List[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB_SIZE, size=ctx).tolist() for _ in range(count)]


def client_metrics(results: List[dict], new_tokens: int) -> dict:
    ok = [r for r in results if r.get("chunks")]
    out: dict = {"requests_ok": len(ok), "requests": len(results)}
    if not ok:
        return out
    ttft = [r["chunks"][0][0] - r["t_send"] for r in ok]
    out["ttft_s_median"] = statistics.median(ttft)
    out["ttft_s_max"] = max(ttft)
    out["tokens"] = [r["chunks"][-1][1] for r in ok]
    per_req_itl = [
        (r["chunks"][-1][0] - r["chunks"][0][0])
        / (r["chunks"][-1][1] - r["chunks"][0][1])
        for r in ok
        if r["chunks"][-1][1] > r["chunks"][0][1]
    ]
    if per_req_itl:
        out["itl_ms_per_request_mean"] = 1000 * statistics.mean(per_req_itl)
    # Steady window: every request has its first token and none has finished.
    lo = max(r["chunks"][0][0] for r in ok)
    hi = min(r["chunks"][-1][0] for r in ok)
    out["window_s"] = max(hi - lo, 0.0)
    if hi - lo < 0.05:
        return out
    tokens, gaps = 0, []
    for r in ok:
        ts = np.array([c[0] for c in r["chunks"]])
        ns = np.array([c[1] for c in r["chunks"]])
        n_lo = ns[np.searchsorted(ts, lo, side="right") - 1]
        n_hi = ns[np.searchsorted(ts, hi, side="right") - 1]
        tokens += int(n_hi - n_lo)
        for i in range(1, len(ts)):
            if lo < ts[i] <= hi and ns[i] > ns[i - 1]:
                dn = int(ns[i] - ns[i - 1])
                gaps += [(ts[i] - ts[i - 1]) / dn] * dn
    out["window_tokens"] = tokens
    out["throughput_tok_s"] = tokens / (hi - lo)
    if gaps:
        g = np.array(gaps) * 1000
        out["itl_ms_p50"] = float(np.percentile(g, 50))
        out["itl_ms_p90"] = float(np.percentile(g, 90))
        out["itl_ms_mean"] = float(g.mean())
    return out


def churn_client_metrics(clients: List[List[dict]], requests: int) -> dict:
    """Client figures of a ``--churn`` run over its steady window: from when
    every client has its first token to when the first client ends its last
    request, so every client is busy in it (decoding, or waiting for its next
    request's first token). ITL: each gap between a request's tokens in the
    window, the stalls of the admissions in it included; TTFT: of the
    requests sent in it (``admissions``)."""
    done = [r for c in clients for r in c]
    out: dict = {"requests_ok": len(done), "requests": requests}
    if not done:
        return out
    out["ttft_s_max"] = max(r["chunks"][0][0] - r["t_send"] for r in done)
    if not all(clients):
        return out
    lo = max(c[0]["chunks"][0][0] for c in clients)
    hi = min(c[-1]["chunks"][-1][0] for c in clients)
    out["window_s"] = max(hi - lo, 0.0)
    if hi - lo < 0.05:
        return out
    tokens, gaps, ttft = 0, [], []
    for r in done:
        if lo <= r["t_send"] <= hi:
            ttft.append(r["chunks"][0][0] - r["t_send"])
        prev_t, prev_n = None, 0
        for t, n in r["chunks"]:
            if lo < t <= hi and n > prev_n:
                tokens += n - prev_n
                if prev_t is not None:
                    gaps += [(t - prev_t) / (n - prev_n)] * (n - prev_n)
            prev_t, prev_n = t, n
    out.update(window_tokens=tokens, throughput_tok_s=tokens / (hi - lo))
    out["admissions"] = len(ttft)
    if ttft:
        out["ttft_s_median"] = statistics.median(ttft)
        out["ttft_s_p90"] = float(np.percentile(ttft, 90))
    if gaps:
        g = np.array(gaps) * 1000
        for q in (50, 90, 99):
            out[f"itl_ms_p{q}"] = float(np.percentile(g, q))
        out["itl_ms_max"] = float(g.max())
        out["itl_ms_mean"] = float(g.mean())
    return out


def parse_decode_lines(text: str) -> List[dict]:
    rows = []
    for line in text.splitlines():
        m = DECODE_RE.search(line)
        if not m:
            continue
        row = {
            "running": int(m.group(1)),
            "throughput": float(m.group(2)),
            "queue": int(m.group(3)),
        }
        o = OFFLOAD_RE.search(line)
        if o:
            row.update(
                hit_rate=float(o.group(1)),
                misses=int(o.group(2)),
                h2d_gbps=float(o.group(3)),
            )
        u = UNITS_RE.search(line)
        if u:
            row["extra_units"] = int(u.group(1))
            if u.group(2) is not None:
                row["units_moved"] = int(u.group(2))
        per_req = UNITS_PER_REQUEST_RE.search(line)
        if per_req:
            row["fewest_units"] = int(per_req.group(1))
            row["most_units"] = int(per_req.group(2))
        reclaimed = UNITS_RECLAIMED_RE.search(line)
        if reclaimed:
            row["units_reclaimed"] = int(reclaimed.group(1))
            row["units_kept"] = int(reclaimed.group(2))
        d = DIRECT_RE.search(line)
        if d:
            row["direct_requests"] = int(d.group(1))
        w = WARMED_RE.search(line)
        if w:
            row["warmed_requests"] = int(w.group(1))
            row["warmed_gb"] = float(w.group(2))
        rows.append(row)
    return rows


def server_metrics(rows: List[dict], interval: int, layers: int) -> dict:
    """Decode-log figures at the largest batch of a run.

    Lines count when they show the run's largest #running-req and the line
    before showed the same batch and queue (no admission, hence no prefill,
    in their interval); the median over them is reported.
    """
    out: dict = {"log_lines": len(rows)}
    if not rows:
        return out
    peak = max(r["running"] for r in rows)
    out["peak_running"] = peak
    clean = [
        cur
        for prev, cur in zip(rows, rows[1:])
        if cur["running"] == peak
        and prev["running"] == peak
        and prev["queue"] == cur["queue"]
    ]
    out["clean_lines"] = len(clean)
    if any("units_moved" in r for r in rows):
        # Over the whole run: moves happen around admissions.
        out["units_moved"] = sum(r.get("units_moved", 0) for r in rows)
    if any("units_reclaimed" in r for r in rows):
        # Over the whole run: prefills and admissions take units back.
        out["units_reclaimed"] = sum(r.get("units_reclaimed", 0) for r in rows)
        out["units_kept"] = sum(r.get("units_kept", 0) for r in rows)
    if any("warmed_requests" in r for r in rows):
        # Over the whole run: the admissions' warm-ups (the batch waits).
        out["warmed_requests"] = sum(r.get("warmed_requests", 0) for r in rows)
        out["warmed_gb"] = round(sum(r.get("warmed_gb", 0.0) for r in rows), 2)
    use = clean or [r for r in rows if r["running"] == peak][1:]
    out["lines_used"] = len(use)
    if not use:
        return out
    thr = statistics.median(r["throughput"] for r in use)
    out["throughput_tok_s"] = thr
    out["itl_ms"] = 1000.0 * peak / thr if thr > 0 else None
    if all("misses" in r for r in use):
        misses = statistics.median(r["misses"] for r in use)
        out["misses_per_step"] = misses / interval
        out["misses_per_req_layer_step"] = misses / (interval * peak * layers)
        out["hit_rate"] = statistics.median(r["hit_rate"] for r in use)
        out["h2d_gbps"] = statistics.median(r["h2d_gbps"] for r in use)
    for key in ("extra_units", "direct_requests", "fewest_units", "most_units"):
        if all(key in r for r in use):
            out[key] = statistics.median(r[key] for r in use)
    return out


def median_of_runs(runs: List[dict]) -> dict:
    """Per key, the median over the runs that have a number for it (None
    when none has); other values from the last run."""
    out = dict(runs[-1])
    for key in set().union(*runs):
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        if values and not isinstance(values[0], bool):
            out[key] = statistics.median(values)
        elif isinstance(runs[-1].get(key), (int, float)):
            out[key] = None
    out["runs"] = len(runs)
    return out


def generate_with_retries(
    server: Server, input_ids: List[int], new_tokens: int, timeout: float
):
    """``stream_generate``, sent again when refused or reset before any
    token (the request then starts later: its TTFT counts from the retry)."""
    for attempt in range(3):
        try:
            return stream_generate(server, input_ids, new_tokens, timeout)
        except (ConnectionError, urllib.error.URLError):
            if attempt == 2:
                raise
            time.sleep(0.5)


def run_clients(conc: int, client, timeout: float) -> float:
    """``client(i)`` for i < ``conc`` on threads that start together; the
    seconds they took."""
    barrier = threading.Barrier(conc)

    def start(i: int) -> None:
        try:
            barrier.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass  # a thread was late: start anyway, the figures say when
        client(i)

    tic = time.time()
    threads = [threading.Thread(target=start, args=(i,)) for i in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return time.time() - tic


def log_since(server: Server, offset: int) -> str:
    time.sleep(0.5)  # let the last decode log lines reach the file
    with open(server.log_path, errors="replace") as f:
        f.seek(offset)
        return f.read()


def run_point(
    server: Server, ctx: int, conc: int, new_tokens: int, seed: int, timeout: float
) -> dict:
    prompts = make_prompts(ctx, conc, seed)
    log_off = os.path.getsize(server.log_path)
    results: List[dict] = [dict() for _ in range(conc)]

    def client(i: int) -> None:
        try:
            t_send, chunks = generate_with_retries(
                server, prompts[i], new_tokens, timeout
            )
            results[i].update(t_send=t_send, chunks=chunks)
        except Exception as e:  # reported per request
            results[i]["error"] = f"{type(e).__name__}: {e}"

    elapsed = run_clients(conc, client, timeout)
    segment = log_since(server, log_off)
    errors = [r["error"] for r in results if "error" in r]
    return {
        "elapsed_s": elapsed,
        "errors": errors[:5],
        "num_errors": len(errors),
        "client": client_metrics(results, new_tokens),
        "decode_log": parse_decode_lines(segment),
    }


def churn_new_tokens(new_tokens: int, conc: int, client: int, index: int) -> int:
    """max_new_tokens of a client's ``index``-th request under ``--churn``:
    the first wave ends staggered (client i after (i + 1) / conc of
    ``new_tokens``), so that in the steady churn a request ends and the next
    one is admitted about every new_tokens / conc steps."""
    if index == 0:
        return max(1, round(new_tokens * (client + 1) / conc))
    return new_tokens


def run_churn_point(
    server: Server,
    ctx: int,
    conc: int,
    new_tokens: int,
    seed: int,
    timeout: float,
    per_client: int,
) -> dict:
    """``--churn``: ``conc`` clients, each sending ``per_client`` requests
    back to back (a new prompt each: each admission moves a whole context),
    so the batch stays at ``conc`` while requests come and go."""
    log_off = os.path.getsize(server.log_path)
    sent: List[List[dict]] = [[] for _ in range(conc)]
    errors: List[str] = []

    def client(i: int) -> None:
        for j in range(per_client):
            # The same prompts in every run of the point (greedy: the same work).
            prompt = make_prompts(ctx, 1, [seed, i, j])[0]
            try:
                t_send, chunks = generate_with_retries(
                    server, prompt, churn_new_tokens(new_tokens, conc, i, j), timeout
                )
            except Exception as e:  # reported per request; the client stops
                errors.append(f"{type(e).__name__}: {e}")
                return
            sent[i].append({"t_send": t_send, "chunks": chunks})

    elapsed = run_clients(conc, client, timeout)
    segment = log_since(server, log_off)
    return {
        "elapsed_s": elapsed,
        "errors": errors[:5],
        "num_errors": len(errors),
        "churn": per_client,
        "client": churn_client_metrics(sent, conc * per_client),
        "decode_log": parse_decode_lines(segment),
    }


def slots_to_hold(conc: int, pd_decode: bool) -> int:
    """Request slots a server needs to decode ``conc`` prompts at once. With
    its own prefill one more: while the last-but-one prompt's final chunk
    holds its slot, sglang finds no slot for the last, marks the batch full
    and keeps it so until a request ends (every run with slots = batch peaked
    at batch - 1: rank_speed/run_h100_model_32k_x8_peak7/)."""
    return conc if pd_decode else conc + 1


def point_runner(args):
    """The function that runs one point's requests: a burst (``run_point``)
    or, with ``--churn``, requests coming and going (``run_churn_point``)."""
    if not args.churn:
        return run_point
    return functools.partial(run_churn_point, per_client=args.churn)


# ------------------------------------------------------------------- servers


def parse_startup(log_path: str) -> dict:
    try:
        with open(log_path, errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    out: dict = {}
    for key, rx in STARTUP_RES.items():
        m = rx.search(text)
        if not m:
            continue
        if key == "offload_regions":
            out["offload_regions"], out["offload_region_rows"] = map(int, m.groups())
        else:
            v = m.group(1)
            out[key] = float(v) if "." in v else int(v)
    if "post_load_avail_gib" in out and "pool_end_avail_gib" in out:
        out["pool_gpu_gib"] = out["post_load_avail_gib"] - out["pool_end_avail_gib"]
    if "pre_load_avail_gib" in out and "graph_end_avail_gib" in out:
        out["total_gpu_gib"] = out["pre_load_avail_gib"] - out["graph_end_avail_gib"]
    return out


def capacity(
    kind: str, pool: dict, ctx: int, new_tokens: int, pd_decode: bool = False
) -> Optional[int]:
    """Requests of ``ctx`` prompt + ``new_tokens`` tokens the pools hold at once.

    * no offload: ``min(max_running_requests, tokens // need)``;
    * ours: the same with ``tokens`` = logical token locs (= host slots); each
      request also needs a decode region, and there are
      ``max_running_requests`` of them;
    * HiSparse (upstream pool logic): logical tokens are
      ``host_to_device_ratio x`` the device pool, each decoding request keeps
      ``device_buffer_size`` + one page of device rows, and a prefill stages
      the whole prompt in device rows (not on a PD decode server: its KV
      transfer writes straight into host memory).
    """
    tokens = pool.get("max_total_num_tokens")
    slots = pool.get("max_running_requests")
    if tokens is None or slots is None:
        return None
    need = page_up(ctx + new_tokens)
    if kind == "hisparse":
        logical = HISPARSE_CONFIG["host_to_device_ratio"] * tokens
        per_req = HISPARSE_CONFIG["device_buffer_size"] + PAGE_SIZE
        if pd_decode:
            device = tokens // per_req
        else:
            device = 0 if tokens < need else 1 + (tokens - need) // per_req
        return int(min(slots, logical // need, device))
    return int(min(slots, tokens // need))


def ours_auto_slots(
    budget_gib: float,
    layers: int,
    new_tokens: int,
    buffer_size: int = 4096,
    max_units: int = 1,
    pd_decode: bool = False,
) -> int:
    """Decode regions that let ours fill the budget with 128K requests
    (mirrors NSAKVOffloadPoolConfigurator's arithmetic for the tiny model:
    regions of buffer_size + 64 rows, staging for context 163840 + 2 x 16384 + 64
    pages (a page per request of a prefill batch once there are more than 64
    regions; not counted here: about one request fewer at that point), per
    logical loc the indexer key, LRU map and loc->row entry; the LRU state
    of every unit a request may hold). A PD decode server stages nothing:
    its KV transfer writes into host memory. The budget: what sglang's own
    pool takes for ``budget_gib`` (its 576 B nominal row, 656 B allocated)."""
    budget = (
        budget_gib
        * (1 << 30)
        * (ROW_BYTES + INDEXER_BYTES)
        / (NOMINAL_ROW_BYTES + INDEXER_BYTES)
    )
    staging = (163840 + 2 * 16384 + 64 * PAGE_SIZE) * layers * ROW_BYTES
    if pd_decode:
        staging = 0
    region = layers * ((buffer_size + 64) * ROW_BYTES + buffer_size * max_units * 6)
    per_loc = layers * (INDEXER_BYTES + 2) + 8
    need = page_up(131072 + new_tokens)
    return max(1, int((budget - staging) // (region + need * per_loc)))


def server_specs(args, mem_fraction: Optional[float] = None) -> Dict[str, List[str]]:
    # Every server's flags but its KV budget (--mem-fraction-static, first).
    rest = [
        "--cuda-graph-max-bs-decode",
        str(args.max_running_requests),
        "--decode-log-interval",
        str(args.decode_log_interval),
    ]
    if args.interleave:
        # Servers waiting for their turn block on their sockets instead of
        # spinning a core each (every server alike).
        rest.append("--sleep-on-idle")
    if args.shape:
        rest += SHAPES[args.shape]
    # Every server alike, e.g. --disable-prefill-cuda-graph: its capture is
    # a third of a rank server's start and times no decode step.
    rest += shlex.split(args.extra_server_args)
    if args.pd_decode:
        # Every output reserved at admission: sglang's default (512) would
        # over-admit and retract, which a no-offload NSA decode server cannot.
        rest += PD_DECODE_FAKE_ARGS + [
            "--num-reserved-decode-tokens",
            str(max(512, args.new_tokens)),
        ]
    fraction = mem_fraction or args.mem_fraction_static
    common = ["--mem-fraction-static", str(fraction)] + rest
    slots = ["--max-running-requests", str(args.max_running_requests)]
    # --offload-default-slots: the offload servers size their request slots
    # (= decode regions) themselves, and idle regions are lent as units.
    ours = common + ([] if args.offload_default_slots else slots)
    ours += ["--enable-decode-nsa-kv-offload"]
    ours += ["--nsa-kv-offload-recent-window", str(args.recent_window)]
    ours += ["--nsa-kv-offload-host-pool-gb", str(args.host_pool_gb)]
    if args.buffer_size is not None:
        ours += ["--nsa-kv-offload-gpu-buffer-size", str(args.buffer_size)]
    units = "--nsa-kv-offload-max-units"
    # ours_fixed: every request keeps exactly its own buffer (no idle rows lent).
    fixed = ours + [units, "1"]
    # ours_wide: as many units as a request's int16 LRU slot ids allow (7 at
    # 4096 rows): what idle GPU memory can lend at most.
    wide = ours + [units, str(widest_units(args.buffer_size))]
    ours_base = list(ours)
    if args.max_units is not None:
        ours += [units, str(args.max_units)]
    mtp = mtp_args(args.mtp_steps, spec_v2=args.mtp_spec_v2)
    if args.hisparse_kv_budget_gib is not None:
        fraction = mem_fraction_for_budget(args.hisparse_kv_budget_gib)[0]
    his_common = ["--mem-fraction-static", str(fraction)] + rest
    return {
        "baseline": common + slots,
        "hisparse": his_common + slots + HISPARSE_ARGS,
        "ours": ours,
        "ours_fixed": fixed,
        "ours_wide": wide,
        # Their own unit cap, whatever --max-units gives the others.
        **{kind: ours_base + [units, str(n)] for kind, n in VARIANT_MAX_UNITS.items()},
        "baseline_mtp": common + slots + mtp,
        "ours_mtp": ours + mtp,
    }


# Variants with a unit cap of their own: 8 units (the rank bench at cfdc9bc).
VARIANT_MAX_UNITS = {"ours_8units": 8}


def server_env(args, kind: str) -> Dict[str, str]:
    env = {
        "SGLANG_DSA_FUSE_TOPK": "0",
        "SGLANG_NSA_TOPK_TRACE_FORMAT": str(TRACE_FORMAT_PY),
        "SGLANG_NSA_TOPK_TRACE_SINKS": str(SINKS),
        "SGLANG_NSA_TOPK_TRACE_RECENT": str(RECENT),
    }
    if args.baseline_fused_topk and kind in REFERENCE_KINDS:
        # sglang's default: the top-k kernel maps positions to locs itself
        # (the offload always takes the positional top-k).
        env["SGLANG_DSA_FUSE_TOPK"] = "1"
    if args.topk == "override":
        env["SGLANG_NSA_TOPK_TRACE_OVERRIDE"] = args.trace
        if args.trace_layer_cycle:
            # One more: the NextN layer of the MTP servers (layer id L).
            env["SGLANG_NSA_TOPK_TRACE_LAYERS"] = cycled_trace_layers(
                args.trace_layers, num_model_layers() + 1
            )
    if args.shape and kind in OFFLOAD_KINDS:
        env[ENV_UNPROVEN_PARALLEL] = "1"
    if args.record:
        env.update(
            SGLANG_NSA_TOPK_TRACE_RECORD=record_path(args, kind),
            SGLANG_NSA_TOPK_TRACE_RECORD_MAX_STEPS=str(args.record_steps),
            SGLANG_NSA_TOPK_TRACE_RECORD_MAX_ROWS=str(args.record_rows),
            SGLANG_NSA_TOPK_TRACE_RECORD_FLUSH_IDLE_S="0",
            SGLANG_NSA_TOPK_TRACE_RECORD_STAGE="output",
        )
    return env


def cycled_trace_layers(trace_layers: str, num_layers: int) -> str:
    """The trace layer of each model layer, the trace's layers in turn: with
    29,30,31 every model layer's neighbour reads a neighbouring DeepSeek-V3.2
    layer (about the adjacent-layer overlap the generator calibrates; 31 -> 29
    two layers apart), where the nearest-layer map would give most adjacent
    model layers one and the same top-k (a prefetch that cannot miss)."""
    ids = [x for x in trace_layers.split(",") if x]
    return ",".join(ids[i % len(ids)] for i in range(num_layers))


def record_path(args, kind: str) -> str:
    return os.path.join(args.out, f"topk_{kind}_{args.topk}.npz")


def flush_recording(path: str, timeout: float = 120.0) -> bool:
    """Ask the server's recorder to write its file and wait for it."""
    trigger = path + ".flush"
    before = os.path.getmtime(path) if os.path.exists(path) else None
    open(trigger, "w").close()
    tic = time.time()
    while os.path.exists(trigger) and time.time() - tic < timeout:
        time.sleep(0.2)
    if os.path.exists(trigger):
        os.remove(trigger)
        return False
    return os.path.exists(path) and os.path.getmtime(path) != before


# ------------------------------------------------------ recorded top-k check


def _load_module(name: str, path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def split_episodes(trace) -> List[Tuple[List[int], List[int]]]:
    """Runs of recorded steps linked by a request present in consecutive
    steps: (steps, request columns)."""
    active = trace.seq_lens > 0
    episodes: List[Tuple[List[int], set]] = []
    last: set = set()
    for s in range(trace.num_steps):
        cols = set(np.nonzero(active[s])[0].tolist())
        if episodes and cols & last:
            episodes[-1][0].append(s)
            episodes[-1][1].update(cols)
        else:
            episodes.append(([s], set(cols)))
        last = cols
    return [(steps, sorted(cols)) for steps, cols in episodes]


def sub_trace(trace, steps: List[int], cols: List[int]):
    import trace_format

    return trace_format.NSATopkTrace(
        trace.topk[steps][:, :, cols],
        trace.seq_lens[steps][:, cols],
        trace.layer_ids,
        [trace.request_ids[c] for c in cols],
        dict(trace.metadata),
    )


def replay_misses(trace, recent_window: int) -> dict:
    import replay

    buf = HISPARSE_CONFIG["device_buffer_size"]
    out = {}
    for name, make in (
        ("ours", lambda mp: replay.OursLRU(2 * 2048, recent_window, mp)),
        ("hisparse", lambda mp: replay.HiSparseLRU(buf, mp)),
    ):
        res = replay.replay(trace, make)
        summary = replay.summarize(res, trace)
        out[name] = summary["misses_per_row"]
        out[name + "_steady_rows"] = int(res.steady.sum()) * trace.num_layers
    return out


def check_override_rows(trace, args) -> dict:
    """Recorded rows (stage output) vs the override recomputed on the CPU."""
    ntt = _load_module("nsa_topk_trace_bench", TOPK_TRACE_PY)
    import torch

    ov = ntt.TopkTraceOverride.from_file(
        args.trace, sinks=SINKS, recent=RECENT, impl="torch"
    )
    k = trace.top_k
    nl = num_model_layers()
    ov.prepare(torch.device("cpu"), k, list(range(nl)), nl, self_check=False)
    slot = []
    for rid in trace.request_ids:
        m = re.match(r"slot(\d+)_len\d+", rid)
        slot.append(int(m.group(1)) if m else -1)
    slot = np.array(slot)
    checked = mismatched = 0
    first_bad = None
    for s in range(trace.num_steps):
        cols = np.nonzero((trace.seq_lens[s] > k) & (slot >= 0))[0]
        if cols.size == 0 or checked >= MAX_CHECKED_ROWS:
            continue
        n = torch.from_numpy(trace.seq_lens[s, cols].astype(np.int64))
        r = torch.from_numpy(slot[cols])
        x = torch.full((cols.size, k), -1, dtype=torch.int32)
        for li, layer in enumerate(trace.layer_ids.tolist()):
            want = ov.apply(int(layer), x, n, r).numpy()
            bad = ~(want == trace.topk[s, li][cols]).all(axis=1)
            checked += cols.size
            mismatched += int(bad.sum())
            if bad.any() and first_bad is None:
                first_bad = {
                    "step": s,
                    "request": trace.request_ids[cols[bad.argmax()]],
                    "layer": int(layer),
                }
    return {"rows_checked": checked, "rows_mismatched": mismatched, "first": first_bad}


def analyze_point_recording(args, point: dict) -> None:
    """Validate the top-k recorded during one run, check the override,
    replay both policies on the run's own steps (``point["replay"]``)."""
    import trace_format

    path = os.path.join(args.out, point["recording"])
    rec: dict = {}
    point["recorded"] = rec
    try:
        trace = trace_format.load_trace(path)  # validates: unique, < seq_len
    except Exception as e:
        rec["error"] = f"recorded trace invalid: {e}"
        return
    rec.update(valid=True, steps=trace.num_steps, requests=trace.num_requests)
    # The ring may still hold older steps (warm-up, earlier run): the last
    # run of steps at this context that decoded about new_tokens tokens.
    lo, hi = point["ctx"] + 1, point["ctx"] + point["new_tokens"] + 1
    match = None
    for steps, cols in split_episodes(trace):
        n = trace.seq_lens[steps][:, cols]
        n = n[n > 0]
        if n.max() - n.min() >= point["new_tokens"] // 2 and lo <= np.median(n) <= hi:
            match = (steps, cols)
    if match is None:
        rec["error"] = "no recorded steps of this run"
        return
    sub = sub_trace(trace, *match)
    rec["run_steps"], rec["run_requests"] = sub.num_steps, sub.num_requests
    if args.topk == "override":
        try:
            rec["override_check"] = check_override_rows(sub, args)
        except Exception as e:
            rec["override_check"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        point["replay"] = replay_misses(sub, args.recent_window)
    except Exception as e:
        point["replay"] = {"error": f"{type(e).__name__}: {e}"}


def summarize_recordings(points: List[dict]) -> dict:
    recs = [p["recorded"] for p in points if "recorded" in p]
    checks = [
        r["override_check"]
        for r in recs
        if "rows_checked" in r.get("override_check", {})
    ]
    out = {
        "runs_recorded": len(recs),
        "runs_valid": sum(bool(r.get("valid")) for r in recs),
        "errors": [r["error"] for r in recs if "error" in r]
        + [p["recording_error"] for p in points if "recording_error" in p],
    }
    if checks:
        out["override_rows_checked"] = sum(c["rows_checked"] for c in checks)
        out["override_rows_mismatched"] = sum(c["rows_mismatched"] for c in checks)
    return out


# ---------------------------------------------------------------- benchmark


# Locality of the generated override trace (trace_gen.py flags), by name:
# "pessimistic" is trace_gen's published-locality default (consecutive-step
# top-k overlap 1.5% in layers 0-1, 44% in 20-60: ~50% misses at a 4096-row
# LRU); "reported" keeps 75% of every layer's top-k from one step to the next,
# which replays to the miss rates HiSparse's paper reports at top-k 2048
# (results/trace_calibration/: LRU 13.1% at 4096 rows vs 13.4% reported,
# Belady 8.0% vs 8.2%, LRU 7.8% at 8192 rows vs 6.7%).
TRACE_CALIBRATIONS = {
    "pessimistic": [],
    "reported": ["--step-overlap", "0-60:0.75"],
}


def prepare_trace(args) -> None:
    if args.topk != "override" or args.trace:
        return
    lens = sorted(set(args.contexts) | set(args.cap_contexts))
    path = os.path.join(args.out, "trace_bench.npz")
    cmd = [
        sys.executable,
        str(TRACES_DIR / "trace_gen.py"),
        "--out",
        path,
        "--requests",
        str(2 * len(lens)),
        "--prompt-lens",
        ",".join(str(x) for x in lens for _ in range(2)),
        "--steps",
        str(args.trace_steps),
        "--layers",
        args.trace_layers,
        "--seed",
        "0",
        *TRACE_CALIBRATIONS[args.trace_calibration],
    ]
    log("generating the override trace: " + " ".join(shlex.quote(c) for c in cmd))
    tic = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        raise RuntimeError("trace_gen failed:\n" + proc.stdout[-3000:] + proc.stderr)
    log(f"trace ready in {time.time() - tic:.0f} s")
    args.trace = path


def bench_server(
    args, kind: str, deadline: float, servers_left: int, startup_guess: float
) -> dict:
    spec = server_specs(args)[kind]
    env = server_env(args, kind)
    res: dict = {"kind": kind, "args": spec, "env": env, "points": []}
    remaining = deadline - time.time()
    start_timeout = min(args.start_timeout, remaining - 60)
    first = first_point_estimate_s(args)
    if not start_fits(remaining, startup_guess, first):
        res["error"] = (
            f"skipped: time budget ({remaining:.0f} s left for a start of "
            f"~{startup_guess:.0f} s, a first point of ~{first:.0f} s and "
            f"{START_SPARE_S} s to spare)"
        )
        log(f"[{kind}] {res['error']}")
        return res
    if args.record and os.path.exists(record_path(args, kind)):
        os.remove(record_path(args, kind))
    mem = gpu_memory_mib()
    tic = time.time()
    name = f"{kind}_{args.topk}"
    layers = num_model_layers()
    try:
        with BenchServer(
            name, spec, args.port, args.out, env=env, timeout=start_timeout
        ) as server:
            res["startup_s"] = time.time() - tic
            res["pool"] = parse_startup(server.log_path)
            log(f"[{kind}] pools: {json.dumps(res['pool'])}")
            # Equal measuring time for this and each later server, whose
            # start-up (like this one's, plus stop) comes out of the budget.
            later = (servers_left - 1) * startup_guess
            share = (deadline - time.time() - 30 - later) / servers_left
            # A started server measures its first point even if the servers
            # after it get less time (or none: start_fits), and even if its
            # warm-up ate into the share (cfdc9bc's 30K x 64 run skipped an
            # offload server's point by a second); every ratio divides by the
            # reference's.
            keep_first = kind in REFERENCE_KINDS or deadline - time.time() - 30 >= first
            if keep_first:
                share = max(share, first)
            share_end = time.time() + max(share, 30.0)
            res["points"] = measure(args, kind, server, share_end, layers, keep_first)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        log(f"[{kind}] FAILED: {res['error']}")
        traceback.print_exc()
        try:
            with open(os.path.join(args.out, f"server_{name}.log")) as f:
                print("".join(f.readlines()[-40:]), flush=True)
        except OSError:
            pass
    if "pool" not in res or not res["pool"]:
        res["pool"] = parse_startup(os.path.join(args.out, f"server_{name}.log"))
    res["wall_s"] = time.time() - tic
    wait_gpu_released(mem[1] if mem else None)
    res["capacity"] = {
        str(c): capacity(kind, res["pool"], c, args.new_tokens, args.pd_decode)
        for c in CAPACITY_CONTEXTS
    }
    if args.record and not res.get("error", "").startswith("skipped"):
        for p in res["points"]:
            if "recording" in p:
                try:
                    analyze_point_recording(args, p)
                except Exception as e:
                    p["recorded"] = {"error": f"{type(e).__name__}: {e}"}
                if not args.keep_recordings:
                    # tens of MB each: the results must stay small to travel
                    os.remove(os.path.join(args.out, p["recording"]))
        res["recording"] = summarize_recordings(res["points"])
    return res


def warm_up(args, kind: str, server: Server) -> None:
    """A short request, then one at the first context length."""
    for ctx, n in ((4096, 32), (args.contexts[0], 8)):
        tic = time.time()
        stream_generate(server, make_prompts(ctx, 1, 7)[0], n, timeout=180)
        log(f"[{kind}] warm-up {ctx} tokens + {n}: {time.time() - tic:.1f} s")


# Planning figures (H200, tiny model, session 7's runs): a run takes its
# slowest TTFT, then its decode steps (<= 2.5 ms each, but the batch ramps up
# behind the prefills), then the 0.5 s log wait; a profiled run also writes
# its trace.
PLAN_STEP_S = 0.006
# The rank model's decode step (61 layers: 21-37 ms on an H100 at 14 GiB,
# run_h100_idle_locs_*), for runs whose decode dominates (--churn).
PLAN_STEP_S_RANK = 0.04
PLAN_RUN_OVERHEAD_S = 1.5
PLAN_PROFILE_S = 10.0


def equal_batch_points(args) -> List[Tuple[int, int]]:
    """(context, concurrency) of the P4 points: every pair, less those over
    ``--max-point-tokens`` (e.g. 128K x 32 where 32K x 32 fits)."""
    cap = args.max_point_tokens
    return [
        (c, k)
        for c in args.contexts
        for k in args.concurrency
        if cap is None or c * k <= cap
    ]


# Seconds a server's start-up and first point leave to spare (its shutdown,
# the reports).
START_SPARE_S = 30


def start_fits(remaining_s: float, startup_guess_s: float, first_point_s: float):
    """Whether a server's start-up and first point fit in the time left: one
    started only to skip its points costs its start-up for nothing."""
    return remaining_s >= startup_guess_s + first_point_s + START_SPARE_S


def first_point_estimate_s(args) -> float:
    """Seconds of the first equal-batch point (0 when there is none)."""
    points = equal_batch_points(args)
    if not points:
        return 0.0
    ctx, conc = points[0]
    return point_estimate_s(
        args, ctx, conc, args.repeats, args.prefill_rate_guess, bool(args.profile_steps)
    )


# Tokens/s a point's requests take to start, before the first measurement:
# a prefill on the rank model; a PD decode server's fake transfer plus the
# offload's admission (warm units: ~330K tok/s at 30K x 64, run_select_64/).
PREFILL_RATE_GUESS = 40000.0
PD_ADMIT_RATE_GUESS = 200000.0


def point_estimate_s(
    args, ctx: int, conc: int, runs: int, prefill_rate: float, profiled=False
) -> float:
    """Seconds a point's runs take (prefill, decode, overhead), on the safe
    side: the measured prefill rate replaces the guess after the first point."""
    step_s = PLAN_STEP_S_RANK if args.model == "rank" else PLAN_STEP_S
    one = ctx * conc / prefill_rate + args.new_tokens * step_s
    if args.churn:
        # Each client's requests one after the other, each admission moving
        # its context; the first wave ends earlier (churn_new_tokens).
        one *= args.churn
    return (runs + profiled) * (one + PLAN_RUN_OVERHEAD_S) + profiled * PLAN_PROFILE_S


def summarize_point(kind: str, point: dict, runs: List[dict], args, layers: int):
    """Fill ``point`` from its runs: medians of the server-log and client
    figures, each run's own server figures in run order."""
    r = runs[-1]
    point.update(r)
    per_run = [
        server_metrics(run["decode_log"], args.decode_log_interval, layers)
        for run in runs
    ]
    point["server"] = median_of_runs(per_run)
    point["server_runs"] = [
        {k: m.get(k) for k in ("throughput_tok_s", "itl_ms", "misses_per_step")}
        for m in per_run
    ]
    point["client"] = median_of_runs([run["client"] for run in runs])
    point["num_errors"] = sum(run["num_errors"] for run in runs)
    s, c = point["server"], r["client"]
    peak = s.get("peak_running")
    if peak is not None and peak < point["conc"]:
        # E.g. with real prefill the first requests finish before the last
        # prompt is in: the figures are those of a smaller batch.
        point["batch_short"] = (
            f"the batch never held {point['conc']} requests (peak {peak}): "
            "more --new-tokens, or more --max-running-requests (slots_to_hold)"
        )
        log(f"[{kind}] ctx {point['ctx']} x {point['conc']}: {point['batch_short']}")
    log(
        f"[{kind}] ctx {point['ctx']} x {point['conc']}: {r['elapsed_s']:.1f} s, "
        f"server {_fmt(s.get('throughput_tok_s'), '{:.0f}')} tok/s "
        f"ITL {_fmt(s.get('itl_ms'), '{:.2f}')} ms (batch "
        f"{s.get('peak_running')}, {s.get('lines_used', 0)} log lines), client "
        f"{_fmt(c.get('throughput_tok_s'), '{:.0f}')} tok/s ITL p50 "
        f"{_fmt(c.get('itl_ms_p50'), '{:.2f}')} ms, misses/step "
        f"{_fmt(s.get('misses_per_step'), '{:.0f}')}, errors {point['num_errors']}"
    )
    return point


def measured_prefill_rate(point: dict, fallback: float) -> float:
    """Prompt tokens per second of the point's last run (its slowest TTFT)."""
    ttft_max = point["client"].get("ttft_s_max")
    if not ttft_max:
        return fallback
    point["prefill_tok_s"] = max(point["ctx"] * point["conc"] / ttft_max, 1000.0)
    return point["prefill_tok_s"]


def measure(
    args,
    kind: str,
    server: Server,
    share_end: float,
    layers: int,
    keep_first: bool = False,
):
    """The server's points until ``share_end``; ``keep_first``: its first
    point runs whatever the clock says (the no-offload server's: every ratio
    divides by it, and its warm-up already ate into the share)."""
    points: List[dict] = []
    warm_up(args, kind, server)
    run = point_runner(args)
    recorder_ok = args.record
    prefill_rate = args.prefill_rate_guess
    plan = [(c, k, False) for c, k in equal_batch_points(args)]
    pool = parse_startup(server.log_path)
    for ctx in args.cap_contexts:
        cap = capacity(kind, pool, ctx, args.new_tokens, args.pd_decode)
        if cap:
            plan.append((ctx, cap, True))
    for i, (ctx, conc, at_cap) in enumerate(plan):
        point = {
            "ctx": ctx,
            "conc": conc,
            "at_capacity": at_cap,
            "new_tokens": args.new_tokens,
        }
        cap = capacity(kind, pool, ctx, args.new_tokens, args.pd_decode)
        # The same requests again (greedy: the same work) for a median; a
        # point at capacity runs once (its prefill dominates).
        reps = 1 if at_cap else args.repeats
        profiled = bool(args.profile_steps) and not at_cap
        est = point_estimate_s(args, ctx, conc, reps, prefill_rate, profiled)
        if cap is not None and conc > cap:
            point["skipped"] = f"concurrency {conc} > capacity {cap}"
        elif time.time() + est > share_end and not (keep_first and i == 0):
            point["skipped"] = f"time budget (needs ~{est:.0f} s)"
        if server.proc.poll() is not None:
            point["skipped"] = f"server exited with {server.proc.returncode}"
        if "skipped" in point:
            log(f"[{kind}] ctx {ctx} x {conc}: skipped ({point['skipped']})")
            points.append(point)
            continue
        runs = []
        for _ in range(reps):
            timeout = max(30.0, share_end - time.time() + 30)
            runs.append(run(server, ctx, conc, args.new_tokens, 1000 + i, timeout))
        summarize_point(kind, point, runs, args, layers)
        prefill_rate = measured_prefill_rate(point, prefill_rate)
        if profiled:
            point["profile"] = step_profile.profile_point(
                server,
                lambda: run(server, ctx, conc, args.new_tokens, 1000 + i, 300),
                conc,
                args.profile_steps,
                args.out,
                f"{kind}_{ctx}x{conc}",
            )
            log(
                f"[{kind}] ctx {ctx} x {conc}: profile {_profile_line(point['profile'])}"
            )
        points.append(point)
        if recorder_ok:
            # The ring holds about one run: write it now (server idle).
            path = record_path(args, kind)
            if flush_recording(path):
                dst = path.replace(".npz", f"_{ctx}x{conc}.npz")
                os.replace(path, dst)
                point["recording"] = os.path.basename(dst)
            else:
                recorder_ok = False
                point["recording_error"] = "recorder wrote nothing (server log)"
                log(f"[{kind}] top-k recorder did not write: not asked again")
    return points


def bench_interleaved(args, kinds: List[str], deadline: float, result: dict, save):
    """``--interleave``: every server up at once (each on its own port), then
    each point's runs round-robin over the servers, the order rotated every
    round, so that a drift of the host's speed hits every server alike and
    each round gives a paired ratio (``evaluate_targets``)."""
    layers = num_model_layers()
    run = point_runner(args)
    servers: Dict[str, Server] = {}
    with contextlib.ExitStack() as stack:
        for i, kind in enumerate(kinds):
            fraction, how = args.mem_fraction_static, args.mem_fraction_how
            if how != "given":
                # The servers already up hold part of the GPU: the same
                # budget is a larger share of what is left.
                fraction, how = mem_fraction_for_budget(args.kv_budget_gib)
            spec = server_specs(args, fraction)[kind]
            # HiSparse may have a budget of its own (--hisparse-kv-budget-gib).
            fraction = float(spec[spec.index("--mem-fraction-static") + 1])
            env = server_env(args, kind)
            res = {"kind": kind, "args": spec, "env": env, "points": []}
            res.update(mem_fraction_static=fraction, mem_fraction_how=how)
            result["servers"][kind] = res
            remaining = deadline - time.time()
            if remaining < 150:
                res["error"] = "skipped: time budget exhausted before start"
                continue
            log(f"=== server {i + 1}/{len(kinds)}: {kind} (port {args.port + i}) ===")
            tic = time.time()
            name = f"{kind}_{args.topk}"
            server = BenchServer(
                name,
                spec,
                args.port + i,
                args.out,
                env=env,
                timeout=min(args.start_timeout, remaining - 60),
            )
            try:
                server.__enter__()
            except Exception as e:
                server.__exit__(None, None, None)  # not healthy: stop what runs
                res["error"] = f"{type(e).__name__}: {e}"
            else:
                stack.push(server)
                res["startup_s"] = time.time() - tic
                try:
                    warm_up(args, kind, server)
                    servers[kind] = server
                except Exception as e:
                    res["error"] = f"{type(e).__name__}: {e}"
            if "error" in res:
                log(f"[{kind}] FAILED: {res['error']}")
            res["pool"] = parse_startup(server.log_path)
            res["capacity"] = {
                str(c): capacity(kind, res["pool"], c, args.new_tokens, args.pd_decode)
                for c in CAPACITY_CONTEXTS
            }
            save()
        prefill_rate = args.prefill_rate_guess
        plan = equal_batch_points(args)
        for i, (ctx, conc) in enumerate(plan):
            live = [k for k in kinds if k in servers and servers[k].proc.poll() is None]
            # Rounds (up to --repeats) while the point's share of the time
            # left holds one more: the first round on the planner's (safe)
            # estimate, the next ones on the slowest round measured.
            per_round = point_estimate_s(args, ctx, conc, len(live), prefill_rate)
            start = time.time()
            share = (deadline - 30 - start) / (len(plan) - i)
            if not live or share < per_round:
                why = (
                    f"time budget (~{per_round:.0f} s a round, its share {share:.0f} s)"
                    if live
                    else "no server running"
                )
                for k in kinds:
                    result["servers"][k]["points"].append(
                        {"ctx": ctx, "conc": conc, "skipped": why}
                    )
                log(f"ctx {ctx} x {conc}: skipped ({why})")
                continue
            runs: Dict[str, List[dict]] = {k: [] for k in live}
            orders, slowest = [], 0.0
            while len(orders) < args.repeats:
                rnd = len(orders)
                order = live[rnd % len(live) :] + live[: rnd % len(live)]
                orders.append(order)
                tic = time.time()
                for k in order:
                    timeout = max(30.0, deadline - time.time())
                    runs[k].append(
                        run(servers[k], ctx, conc, args.new_tokens, 1000 + i, timeout)
                    )
                slowest = max(slowest, time.time() - tic)
                if time.time() - start + slowest > share:
                    break
            if len(orders) < args.repeats:
                log(
                    f"ctx {ctx} x {conc}: {len(orders)} of {args.repeats} rounds in "
                    f"{time.time() - start:.0f} s (its share of the time left: "
                    f"{share:.0f} s; slowest round {slowest:.1f} s)"
                )
            for k in live:
                point = {
                    "ctx": ctx,
                    "conc": conc,
                    "at_capacity": False,
                    "new_tokens": args.new_tokens,
                    "interleaved": True,
                    "round_orders": orders,
                }
                summarize_point(k, point, runs[k], args, layers)
                prefill_rate = measured_prefill_rate(point, prefill_rate)
                result["servers"][k]["points"].append(point)
            save()


# ------------------------------------------------------------------ targets


def _fmt(v, fmt="{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _point(res: dict, ctx: int, conc: Optional[int] = None, at_cap=False):
    for p in res.get("points", []):
        if p["ctx"] != ctx or "skipped" in p or p.get("at_capacity") != at_cap:
            continue
        if conc is None or p["conc"] == conc:
            return p
    return None


def evaluate_targets(result: dict) -> dict:
    srv = result["servers"]
    base, ours, his = (srv.get(k, {}) for k in ("baseline", "ours", "hisparse"))
    t: dict = {}
    # P3: capacity
    cap = {k: srv[k].get("capacity", {}) for k in srv}
    c_b, c_o = cap.get("baseline", {}).get("131072"), cap.get("ours", {}).get("131072")
    p3 = {"ratio_128k": (c_o / c_b) if c_b and c_o is not None else None}
    p3["vs_hisparse"] = {
        c: [cap.get("ours", {}).get(c), cap.get("hisparse", {}).get(c)]
        for c in (str(x) for x in CAPACITY_CONTEXTS)
    }
    checks = [o >= h for o, h in p3["vs_hisparse"].values() if None not in (o, h)]
    if p3["ratio_128k"] is not None:
        checks.append(p3["ratio_128k"] >= 5.0)
    complete = len(checks) == 1 + len(CAPACITY_CONTEXTS)
    t["P3"] = {**p3, "met": _met(checks, complete)}
    # P4: ITL overhead at equal batch (ours; the prefetch variant apart)
    t["P4"] = _p4(base, ours)
    for kind, key in OURS_VARIANTS.items():
        if kind in srv:
            t[key] = _p4(base, srv[kind])
    for key, (kind, versus) in MTP_COMPARISONS.items():
        if kind in srv and versus in srv:
            t[key] = _p4(srv[versus], srv[kind])
    # P5: throughput at fixed memory (each server at its own capacity)
    p5 = []
    for ctx in result["config"]["cap_contexts"]:
        thr = {}
        for k in ("baseline", "ours", "hisparse"):
            p = _point(srv.get(k, {}), ctx, at_cap=True)
            thr[k] = p["server"].get("throughput_tok_s") if p else None
        row = {"ctx": ctx, "throughput": thr}
        if thr["ours"] and thr["baseline"]:
            row["vs_baseline"] = thr["ours"] / thr["baseline"]
        if thr["ours"] and thr["hisparse"]:
            row["vs_hisparse"] = thr["ours"] / thr["hisparse"]
        p5.append(row)
    checks = [r["vs_baseline"] >= 3.0 for r in p5 if "vs_baseline" in r]
    checks += [r["vs_hisparse"] >= 1.2 for r in p5 if "vs_hisparse" in r]
    t["P5"] = {"rows": p5, "met": _met(checks, len(checks) == 2 * len(p5))}
    return t


def _paired_ratios(p: dict, b: dict) -> List[float]:
    """Ours' ITL / no offload's, round by round (``--interleave``: the rounds
    ran back to back), sorted; empty when the runs were not interleaved."""
    if not (p.get("interleaved") and b.get("interleaved")):
        return []
    return sorted(
        o["itl_ms"] / n["itl_ms"]
        for o, n in zip(p["server_runs"], b["server_runs"])
        if o.get("itl_ms") and n.get("itl_ms")
    )


def paired_overhead(ratios: List[float]):
    """(median - 1, [Q1 - 1, Q3 - 1]) of per-round ITL ratios: the overhead
    and the middle half of the rounds (how much one round says)."""
    q1, q3 = np.quantile(ratios, [0.25, 0.75])
    return statistics.median(ratios) - 1, [float(q1) - 1, float(q3) - 1]


def median_ci95(
    ratios: List[float], resamples: int = 10000, seed: int = 0
) -> List[float]:
    """Percentile-bootstrap 95% interval of the median ratio, minus one.
    Seeded, so a committed table rebuilds to the same figures."""
    r = np.asarray(ratios, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(r), (resamples, len(r)))
    lo, hi = np.percentile(np.median(r[picks], axis=1), [2.5, 97.5])
    return [float(lo) - 1, float(hi) - 1]


def p4_overhead(row: dict) -> Optional[float]:
    """A P4 row's ITL overhead: under --churn the client's mean ITL ratio;
    otherwise the paired overhead where the run has one, the ratio of the
    server log's medians else."""
    if row.get("churn"):
        return row.get("overhead_client_mean")
    if row["overhead_paired"] is not None:
        return row["overhead_paired"]
    return row["overhead_server"]


def _p4(base: dict, ours: dict) -> dict:
    """ITL overhead per equal-batch point; the verdict takes each row's
    ``p4_overhead``."""
    rows = []
    for p in ours.get("points", []):
        if "skipped" in p or p.get("at_capacity"):
            continue
        b = _point(base, p["ctx"], p["conc"])
        if b is None or "batch_short" in p or "batch_short" in b:
            continue
        # Under --churn the client's mean ITL counts the admissions' stalls,
        # which the server log's steady lines leave out: it is the figure.
        churn = bool(p.get("churn"))
        ratios = [] if churn else _paired_ratios(p, b)
        paired, iqr = paired_overhead(ratios) if ratios else (None, None)
        ci95 = median_ci95(ratios) if ratios else None
        i_o, i_b = p["server"].get("itl_ms"), b["server"].get("itl_ms")
        c_o, c_bb = p["client"].get("itl_ms_p50"), b["client"].get("itl_ms_p50")
        misses = p["server"].get("misses_per_step")
        # What copying the misses alone adds to a step, if nothing hides it.
        copy_ms = misses * ROW_BYTES / MISS_COPY_BYTES_PER_S * 1e3 if misses else None
        rows.append(
            {
                "ctx": p["ctx"],
                "conc": p["conc"],
                "overhead_server": (i_o / i_b - 1) if i_o and i_b else None,
                "overhead_paired": paired,
                "overhead_paired_iqr": iqr,
                "overhead_paired_ci95": ci95,
                "overhead_client_p50": (c_o / c_bb - 1) if c_o and c_bb else None,
                "miss_copy_ms": copy_ms,
                "miss_copy_overhead": copy_ms / i_b if copy_ms and i_b else None,
            }
        )
        if churn:
            m_o, m_b = p["client"].get("itl_ms_mean"), b["client"].get("itl_ms_mean")
            rows[-1].update(
                churn=True,
                overhead_client_mean=(m_o / m_b - 1) if m_o and m_b else None,
            )
    vals = [v for v in map(p4_overhead, rows) if v is not None]
    return {
        "rows": rows,
        "max_overhead": max(vals) if vals else None,
        "met": (max(vals) <= 0.10) if vals else None,
    }


def _met(checks: List[bool], complete: bool) -> Optional[bool]:
    """False if a measured figure misses its target, True if all are
    measured and meet it, None (not measured) otherwise."""
    if not all(checks):
        return False
    return True if checks and complete else None


# ------------------------------------------------------------------- report


def _verdict(met) -> str:
    return "not measured" if met is None else ("MET" if met else "NOT MET")


def render_markdown(results: List[dict]) -> str:
    models = sorted({r["config"].get("model", "tiny") for r in results})
    out = [
        "# Server benchmark: no offload vs HiSparse vs ours "
        f"({', '.join(models)} DeepSeek-V3.2 model)",
        "",
    ]
    for result in results:
        cfg = result["config"]
        t = evaluate_targets(result)
        srv = result["servers"]
        kinds = [k for k in SERVER_KINDS if k in srv]
        offload_kinds = [k for k in OFFLOAD_KINDS if k in srv] or ["ours"]
        out += [
            f"## Top-k: {cfg['topk']}"
            + (
                f" (trace `{os.path.basename(cfg['trace'])}`)"
                if cfg.get("trace")
                else ""
            ),
            "",
            f"Mode {cfg['mode']}; budget {cfg['kv_budget_gib']} GiB for the KV pools "
            f"(`--mem-fraction-static {cfg['mem_fraction_static']}`, "
            f"{cfg['mem_fraction_how']}); `--max-running-requests "
            f"{cfg['max_running_requests']}` for all; {cfg['new_tokens']} new tokens "
            f"per request; {cfg.get('repeats', 1)} run(s) per point (medians; "
            "at capacity one); "
            f"decode log every {cfg['decode_log_interval']} steps; "
            f"{cfg['layers']} layers. Started {cfg['started']}, "
            + (f"on {cfg['gpu']}, " if cfg.get("gpu") else "")
            + f"{cfg['wall_s']:.0f} s."
            + _hisparse_budget_note(cfg)
            + _interleave_note(cfg, srv)
            + _merged_calls_note(cfg),
            "",
            "| server | start (s) | pools GPU (GiB) | KV tokens / locs | request slots "
            + "".join(f"| cap. {c // 1024}K " for c in CAPACITY_CONTEXTS)
            + "| status |",
            "|---|---:|---:|---:|---:" + "|---:" * len(CAPACITY_CONTEXTS) + "|---|",
        ]
        for k in kinds:
            r = srv[k]
            pool = r.get("pool", {})
            caps = "".join(
                f"| {_fmt(r.get('capacity', {}).get(str(c)), '{}')} "
                for c in CAPACITY_CONTEXTS
            )
            out.append(
                f"| {LABELS[k]} | {_fmt(r.get('startup_s'), '{:.0f}')} "
                f"| {_fmt(pool.get('pool_gpu_gib'), '{:.2f}')} "
                f"| {_fmt(pool.get('max_total_num_tokens'), '{:,}')} "
                f"| {_fmt(pool.get('max_running_requests'), '{}')} {caps}"
                f"| {_status(r)} |"
            )
        out += [
            "",
            "Capacity: requests of that prompt length + the new tokens that the "
            "server's pools hold at once (from the pool sizes it logs; HiSparse: "
            "4x logical tokens, 4160 device rows per request). HiSparse's pool "
            "GPU memory includes its 4x indexer buffer, which upstream does not "
            "count against the budget.",
            "",
            "| context | batch | "
            + " | ".join(
                f"{LABELS[k]} tok/s | {LABELS[k]} ITL ms (p50 client)" for k in kinds
            )
            + "".join(
                f" | {LABELS[k]} misses/step (per req-layer)" for k in offload_kinds
            )
            + " | replayed misses per req-layer-step: ours / HiSparse |",
            "|---:|---:|"
            + "---:|---:|" * len(kinds)
            + "---:|" * len(offload_kinds)
            + "---:|",
        ]
        keys = sorted(
            {
                (p["ctx"], p["conc"], p.get("at_capacity", False))
                for k in kinds
                for p in srv[k].get("points", [])
                if "skipped" not in p and not p.get("at_capacity")
            }
        )
        for ctx, conc, _ in keys:
            cells = []
            for k in kinds:
                p = _point(srv[k], ctx, conc)
                if p is None:
                    cells += ["-", "-"]
                    continue
                s, c = p["server"], p["client"]
                cells += [
                    _fmt(s.get("throughput_tok_s"), "{:.0f}"),
                    f"{_fmt(s.get('itl_ms'), '{:.2f}')} "
                    f"({_fmt(c.get('itl_ms_p50'), '{:.2f}')})",
                ]
            out.append(
                f"| {ctx // 1024}K | {conc} | "
                + " | ".join(cells)
                + "".join(
                    f" | {_misses_cell(srv.get(k, {}), ctx, conc)}"
                    for k in offload_kinds
                )
                + f" | {_replay_cell(srv, ctx, conc)} |"
            )
        out += _cap_table(srv, kinds)
        out += _churn_table(srv, kinds)
        out += _profile_table(srv, kinds)
        out += ["", *_targets_md(t), ""]
        for k in kinds:
            rec = srv[k].get("recording")
            if not rec or not (rec["runs_recorded"] or rec["errors"]):
                continue
            line = (
                f"- top-k recorded by the {LABELS[k]} server: {rec['runs_valid']} of "
                f"{rec['runs_recorded']} runs valid (unique positions < seq_len)"
            )
            if "override_rows_checked" in rec:
                line += (
                    f"; override: {rec['override_rows_mismatched']} of "
                    f"{rec['override_rows_checked']} recorded rows differ from "
                    "the CPU recomputation"
                )
            if rec["errors"]:
                line += f"; problems: {'; '.join(sorted(set(rec['errors'])))[:300]}"
            out.append(line)
        out.append("")
    return "\n".join(out)


def _hisparse_budget_note(cfg: dict) -> str:
    budget = cfg.get("hisparse_kv_budget_gib")
    if budget is None:
        return ""
    return (
        f" HiSparse runs at a {budget} GiB budget (its host pool is "
        f"{HISPARSE_CONFIG['host_to_device_ratio']}x its device pool): its "
        "capacity columns are at that budget."
    )


def _interleave_note(cfg: dict, srv: dict) -> str:
    if not cfg.get("interleave"):
        return ""
    fractions = ", ".join(
        f"{LABELS[k]} {srv[k]['mem_fraction_static']}"
        for k in SERVER_KINDS
        if srv.get(k, {}).get("mem_fraction_static")
    )
    return (
        " **Interleaved**: every server up at once (`--sleep-on-idle`), each "
        "point's runs round-robin over them, the order rotated every round; "
        f"`--mem-fraction-static` from the memory free at each start: {fractions}."
    )


def _status(r: dict) -> str:
    if "error" not in r:
        skipped = sum("skipped" in p for p in r.get("points", []))
        return f"ok ({skipped} points skipped)" if skipped else "ok"
    first = r["error"].strip().splitlines()[0] if r["error"].strip() else "error"
    return first.replace("|", "/")[:100]


def _flagged_points(srv: dict, kinds: List[str], flag: str):
    """(kind, point) of the points run (not skipped) that have ``flag`` set."""
    for k in kinds:
        for p in srv[k].get("points", []):
            if p.get(flag) and "skipped" not in p:
                yield k, p


def _cap_table(srv: dict, kinds: List[str]) -> List[str]:
    rows = []
    for k, p in _flagged_points(srv, kinds, "at_capacity"):
        s, rp = p["server"], p.get("replay") or {}
        rows.append(
            f"| {p['ctx'] // 1024}K | {LABELS[k]} | {p['conc']} "
            f"({_fmt(s.get('peak_running'), '{}')}) "
            f"| {_fmt(s.get('throughput_tok_s'), '{:.0f}')} "
            f"| {_fmt(s.get('itl_ms'), '{:.2f}')} "
            f"| {_fmt(s.get('misses_per_step'), '{:.0f}')} "
            f"| {_fmt(rp.get('ours'), '{:.0f}')} / "
            f"{_fmt(rp.get('hisparse'), '{:.0f}')} |"
        )
    if not rows:
        return []
    return [
        "",
        "Each server at its own capacity (same GPU budget):",
        "",
        "| context | server | requests (decoding at once) | tok/s | ITL ms "
        "| misses/step | replayed misses per req-layer-step ours / HiSparse |",
        "|---:|---|---:|---:|---:|---:|---:|",
        *rows,
    ]


def _churn_table(srv: dict, kinds: List[str]) -> List[str]:
    rows = []
    for k, p in _flagged_points(srv, kinds, "churn"):
        c = p["client"]
        itl = " / ".join(
            _fmt(c.get(f"itl_ms_{q}"), "{:.2f}") for q in ("mean", "p50", "p99", "max")
        )
        rows.append(
            f"| {p['ctx'] // 1024}K x {p['conc']} | {LABELS[k]} | {itl} "
            f"| {_fmt(c.get('ttft_s_median'), '{:.2f}')} / "
            f"{_fmt(c.get('ttft_s_p90'), '{:.2f}')} "
            f"| {_fmt(c.get('admissions'), '{:.0f}')} "
            f"| {_fmt(c.get('throughput_tok_s'), '{:.0f}')} |"
        )
    if not rows:
        return []
    return [
        "",
        "Requests coming and going (`--churn`): the clients' figures over the "
        "window where every client is busy (medians over the runs):",
        "",
        "| point | server | ITL ms mean / p50 / p99 / max | TTFT s median / p90 "
        "| admissions in the window | tok/s |",
        "|---|---|---:|---:|---:|---:|",
        *rows,
    ]


PROFILE_COLUMNS = ("swap", "h2d_copy", "backup", "hisparse", "other")


def _profile_line(prof: dict) -> str:
    if "error" in prof:
        return f"failed: {prof['error']}"
    gpu = prof["gpu_us_per_step"]
    host = prof.get("host_step_ms")
    return (
        f"host {'-' if host is None else f'{host:.2f}'} ms/step, GPU busy "
        f"{prof['gpu_busy_ms_per_step']:.2f} ms, "
        + ", ".join(f"{k} {gpu[k]:.0f} us" for k in sorted(gpu))
        + f", {prof['launches_per_step']:.0f} host launches/step"
    )


def _profile_table(srv: dict, kinds: List[str]) -> List[str]:
    """Per decode step of the profiled runs (--profile-steps): GPU time of
    the offload's kernels, the rest, and what the host launched."""
    rows = []
    for k in kinds:
        for p in srv[k].get("points", []):
            prof = p.get("profile")
            if not prof:
                continue
            cells = [f"{p['ctx'] // 1024}K", str(p["conc"]), LABELS[k]]
            if "error" in prof:
                cells += [prof["error"]] + [""] * 8
            else:
                gpu = prof["gpu_us_per_step"]
                host = prof.get("host_step_ms")
                cells += [
                    "-" if host is None else f"{host:.2f}",
                    f"{prof['gpu_busy_ms_per_step']:.2f}",
                    *(f"{gpu.get(c, 0.0):.0f}" for c in PROFILE_COLUMNS),
                    f"{prof['launches_per_step']:.1f}",
                    f"{prof['launch_cpu_us_per_step']:.0f}",
                ]
            rows.append("| " + " | ".join(cells) + " |")
    if not rows:
        return []
    return [
        "",
        "Profiled decode steps (one extra run per point, torch profiler on: "
        "slower than the runs above; per step: the scheduler's host time, GPU "
        "busy time, GPU us by kernel (swap and miss copy include the "
        "cross-layer prefetch's), launches outside the CUDA graphs):",
        "",
        "| context | batch | server | host ms | GPU busy ms | swap | miss copy "
        "| backup | HiSparse | other kernels | host launches | launch CPU us |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]


def _misses_cell(ours: dict, ctx: int, conc: int) -> str:
    p = _point(ours, ctx, conc)
    if p is None or p["server"].get("misses_per_step") is None:
        return "-"
    s = p["server"]
    cell = f"{s['misses_per_step']:.0f} ({s['misses_per_req_layer_step']:.0f})"
    if s.get("direct_requests") is not None:
        # With direct slots: how many of the batch swap without the LRU walk.
        cell += f", {s['direct_requests']:.0f} direct"
    if s.get("fewest_units") is not None:
        # The units of the poorest and the richest request (an uneven split).
        cell += f", units {s['fewest_units']:.0f}-{s['most_units']:.0f}"
    if s.get("units_reclaimed"):
        # Units taken back over the run (their rows read again on misses).
        cell += f", {s['units_reclaimed']:.0f} reclaimed ({s['units_kept']:.0f} kept)"
    return cell


def _replay_cell(srv: dict, ctx: int, conc: int) -> str:
    # The top-k recorded in ours' server; another server's if ours has none.
    for k in OFFLOAD_KINDS + ("hisparse", "baseline"):
        p = _point(srv.get(k, {}), ctx, conc)
        rp = (p or {}).get("replay") or {}
        if "ours" in rp:
            src = "" if k == "ours" else f" ({LABELS[k]}'s top-k)"
            return f"{rp['ours']:.0f} / {rp['hisparse']:.0f}{src}"
    return "-"


def _copy_note(row: dict) -> str:
    """The part of a P4 overhead the misses' PCIe copy alone would take."""
    if row.get("miss_copy_overhead") is None:
        return ""
    return (
        f"; the misses' copy alone {row['miss_copy_ms']:.2f} ms = "
        f"{row['miss_copy_overhead']:+.0%} at {MISS_COPY_BYTES_PER_S / 1e9:.0f} GB/s"
    )


def _p4_line(label: str, p4: dict, versus: str = "no offload") -> str:
    def paired(r):
        if r["overhead_paired"] is None:
            return ""
        lo, hi = r["overhead_paired_iqr"]
        ci = r.get("overhead_paired_ci95")  # runs before session 11: none
        ci = f", the median's 95% interval {ci[0]:+.1%}..{ci[1]:+.1%}" if ci else ""
        return (
            f"median of per-round ratios {r['overhead_paired']:+.1%}, "
            f"IQR {lo:+.0%}..{hi:+.0%}{ci}; "
        )

    def point(r):
        head = f"{r['ctx'] // 1024}K x {r['conc']}: "
        if r.get("churn"):
            return (
                head + f"{_fmt(r.get('overhead_client_mean'), '{:+.1%}')} (churn: "
                f"client mean ITL; server log {_fmt(r['overhead_server'], '{:+.1%}')}"
                f"{_copy_note(r)})"
            )
        return (
            head + f"{_fmt(r['overhead_server'], '{:+.1%}')}"
            f" ({paired(r)}client p50 {_fmt(r['overhead_client_p50'], '{:+.1%}')}"
            f"{_copy_note(r)})"
        )

    return (
        f"- **P4** ITL overhead {label} vs {versus} at equal batch (server log): "
        + ", ".join(point(r) for r in p4["rows"])
        + f" (target <= +10%): **{_verdict(p4['met'])}**"
    )


def _targets_md(t: dict) -> List[str]:
    p3, p4, p5 = t["P3"], t["P4"], t["P5"]
    lines = [
        f"- **P3** capacity ours / no offload at 128K = "
        f"{_fmt(p3['ratio_128k'], '{:.2f}')}x (target >= 5.0x); ours vs HiSparse "
        + ", ".join(
            f"{int(c) // 1024}K {_fmt(o, '{}')} vs {_fmt(h, '{}')}"
            for c, (o, h) in p3["vs_hisparse"].items()
        )
        + f" (target >=): **{_verdict(p3['met'])}**",
        _p4_line("ours", p4),
    ]
    for kind, key in OURS_VARIANTS.items():
        if key in t:
            lines.append(_p4_line(LABELS[kind], t[key]))
    for key, (kind, versus) in MTP_COMPARISONS.items():
        if key in t:
            lines.append(_p4_line(LABELS[kind], t[key], LABELS[versus]))
    if p5["rows"]:
        lines.append(
            "- **P5** throughput at fixed memory (each server at its capacity): "
            + ", ".join(
                f"{r['ctx'] // 1024}K: ours / no offload "
                f"{_fmt(r.get('vs_baseline'), '{:.2f}')}x, ours / HiSparse "
                f"{_fmt(r.get('vs_hisparse'), '{:.2f}')}x"
                for r in p5["rows"]
            )
            + f" (targets >= 3x, >= 1.2x): **{_verdict(p5['met'])}**"
        )
    else:
        lines.append(
            "- **P5** throughput at fixed memory: **not measured** in this run "
            "(needs runs at capacity: `--full` or `--cap-contexts`)"
        )
    return lines


def render_plots(results: List[dict], out_dir: str) -> List[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not available: no PNG (render later with --plot-only JSON)")
        return []
    colors = {
        "baseline": "tab:gray",
        "hisparse": "tab:orange",
        "ours": "tab:blue",
        "ours_prefetch": "tab:green",
        "ours_prefetch_early": "darkgreen",
        "ours_early": "tab:olive",
        "ours_inline": "tab:pink",
        "ours_units": "tab:purple",
        "ours_fixed": "tab:cyan",
        "ours_wide": "navy",
        "ours_direct": "goldenrod",
        "ours_warm": "maroon",
        "ours_warm_prefetch": "teal",
        "ours_warm_flat": "olivedrab",
        "ours_warm_rope": "sienna",
        "ours_warm_direct": "darkgreen",
        "ours_warm_direct_flat": "limegreen",
        "ours_classic": "slateblue",
        "ours_8units": "cadetblue",
        "ours_bounded_warm": "darkkhaki",
        "ours_elastic": "crimson",
        "ours_idle_locs": "chocolate",
        "ours_idle_locs_bounded": "peru",
        "ours_clock": "indigo",
        "ours_clock_warm": "orchid",
        "ours_warm_direct_narrow": "darkcyan",
        "ours_warm_late": "darkorange",
        "baseline_mtp": "tab:brown",
        "ours_mtp": "tab:red",
    }
    written = []
    for result in results:
        srv = result["servers"]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        styles = ["-", "--", ":", "-."]
        ctxs = sorted({p["ctx"] for r in srv.values() for p in r.get("points", [])})
        for k, r in srv.items():
            for ci, ctx in enumerate(ctxs):
                pts = [
                    p
                    for p in r.get("points", [])
                    if p["ctx"] == ctx and "skipped" not in p and "server" in p
                ]
                caps = [p for p in pts if p.get("at_capacity")]
                pts = [p for p in pts if not p.get("at_capacity")]
                for p in caps:  # each server at its own capacity: a star
                    x = p["server"].get("peak_running") or p["conc"]
                    for ax, key in ((axes[0], "throughput_tok_s"), (axes[1], "itl_ms")):
                        if p["server"].get(key) is not None:
                            ax.plot(
                                [x], [p["server"][key]], "*", ms=12, color=colors[k]
                            )
                pts.sort(key=lambda p: p["conc"])
                xs = [p["server"].get("peak_running") or p["conc"] for p in pts]
                thr = [p["server"].get("throughput_tok_s") for p in pts]
                itl = [p["server"].get("itl_ms") for p in pts]
                kw = dict(
                    color=colors[k],
                    linestyle=styles[ci % len(styles)],
                    marker="o",
                    label=f"{LABELS[k]} {ctx // 1024}K",
                )
                if any(v is not None for v in thr):
                    axes[0].plot(xs, [v or np.nan for v in thr], **kw)
                    axes[1].plot(xs, [v or np.nan for v in itl], **kw)
        for ax, title in zip(
            axes[:2], ("decode throughput (tok/s)", "inter-token latency (ms)")
        ):
            ax.set_xlabel("requests decoding (batch)")
            ax.set_title(title)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        width = 0.8 / max(len(srv), 1)
        for i, (k, r) in enumerate(srv.items()):
            caps = [r.get("capacity", {}).get(str(c)) or 0 for c in CAPACITY_CONTEXTS]
            axes[2].bar(
                np.arange(len(CAPACITY_CONTEXTS)) + i * width,
                caps,
                width,
                color=colors[k],
                label=LABELS[k],
            )
        axes[2].set_xticks(np.arange(len(CAPACITY_CONTEXTS)) + width)
        axes[2].set_xticklabels([f"{c // 1024}K" for c in CAPACITY_CONTEXTS])
        axes[2].set_title("capacity (requests at once, same GPU budget)")
        axes[2].legend(fontsize=7)
        cfg = result["config"]
        fig.suptitle(
            f"{cfg.get('model', 'tiny')} DeepSeek-V3.2 model, top-k: "
            f"{trace_name(cfg)}, mode {cfg['mode']}"
        )
        fig.tight_layout()
        path = os.path.join(out_dir, f"bench_server_{cfg['topk']}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def trace_name(config: dict) -> str:
    """model (the servers' own top-k) or the override's calibration."""
    if config.get("topk") != "override":
        return "model"
    return config.get("trace_calibration") or "pessimistic"


def _overheads(p4: dict, prefix: str = "") -> Dict[str, float]:
    """ "<prefix><context>x<batch>" -> ITL ratio - 1 (paired where run)."""
    out = {}
    for r in p4["rows"]:
        v = p4_overhead(r)
        if v is not None:
            out[f"{prefix}{r['ctx']}x{r['conc']}"] = round(v, 4)
    return out


# Per-release figures of rank_summaries' ``by_sglang_version``: what a reader
# of one release needs (the runs' commands stay in the whole summary's traces).
BY_VERSION_SKIP = ("traces", "sglang_version")


def rank_summaries(results: List[dict]) -> Dict[str, dict]:
    """``_rank_summaries`` of every rank run; where the runs span several
    sglang releases, each summary also has ``by_sglang_version``: release ->
    the same summary over that release's runs alone (non-empty keys), so
    that a figure measured on one release is never read as another's."""
    out = _rank_summaries(results)
    runs = [r for r in results if r["config"].get("model") == "rank"]
    versions = sorted(
        {str(recorded_sglang_version(r["config"])) for r in runs}, key=release_key
    )
    if len(versions) < 2:
        return out
    for name in out:
        out[name]["by_sglang_version"] = {}
    for version in versions:
        sub = _rank_summaries(
            [r for r in runs if str(recorded_sglang_version(r["config"])) == version]
        )
        for name, summary in sub.items():
            out[name]["by_sglang_version"][version] = {
                k: v
                for k, v in summary.items()
                if k not in BY_VERSION_SKIP and v not in ({}, None)
            }
    return out


def _rank_summaries(results: List[dict]) -> Dict[str, dict]:
    """The committed summaries of a session's rank-model runs (one run per
    trace): ``rank_model`` (results/rank_model/summary.json: capacity, ITL at
    the model's top-k, throughput at capacity where the misses cross PCIe)
    and ``rank_speed`` (results/rank_speed/summary.json: ITL per trace, the
    swap's GPU time per layer from the step profile, HiSparse's ITL). The ITL
    overheads are the early swap's, ours' default (``*_inline``: the inline
    swap's), whichever server kind ran it in each run: the elastic defaults'
    (runs that record ``elastic_default``, and ours_idle_locs, the same
    settings, in the runs before them), ``p4_itl_overhead_classic`` the
    classic default's ("ours" before the elastic defaults) and
    ``swap_us_per_layer_classic`` its swap time per layer;
    ``p4_itl_overhead_warm_units``: the experimental warm units' (ours_warm),
    ``p4_itl_overhead_warm_flat``: with the flat miss copy too (ours_warm_flat),
    ``p4_itl_overhead_warm_rope``: with the swap after the rope (ours_warm_rope),
    ``p4_itl_overhead_warm_direct``: with direct slots too (ours_warm_direct),
    ``p4_itl_overhead_warm_direct_flat``: and the flat miss copy
    (ours_warm_direct_flat). A ``--churn`` run's ratios
    (the clients' mean ITL, admissions included) go to ``churn_itl_overhead``
    alone: "<server kind>:<trace>:<context>x<batch>", HiSparse's too."""
    runs = [r for r in results if r["config"].get("model") == "rank"]
    if not runs:
        return {}
    speed = {
        "p4_itl_overhead": {},
        "p4_itl_overhead_inline": {},
        "p4_itl_overhead_warm_units": {},
        "p4_itl_overhead_warm_flat": {},
        "p4_itl_overhead_warm_rope": {},
        "p4_itl_overhead_warm_direct": {},
        "p4_itl_overhead_warm_direct_flat": {},
        "p4_itl_overhead_classic": {},
        "churn_itl_overhead": {},
        "swap_us_per_layer": {},
        "swap_us_per_layer_classic": {},
        "hisparse_itl_overhead": {},
        "traces": {},
        "code_commit": one_or_sorted(
            r["config"].get("code_commit", "unknown") for r in runs
        ),
        "sglang_version": one_or_sorted(
            recorded_sglang_version(r["config"]) for r in runs
        ),
    }
    model = {
        "code_commit": speed["code_commit"],
        "sglang_version": speed["sglang_version"],
        "p4_itl_overhead": {},
        "p4_itl_overhead_inline": {},
    }
    best_p5, p3_at_cap = None, False
    for run in runs:
        cfg, srv = run["config"], run["servers"]
        name = trace_name(cfg)
        speed["traces"].setdefault(name, []).append(cfg.get("command"))
        if cfg.get("churn"):
            for kind in srv:
                if kind in OFFLOAD_KINDS + ("hisparse",) and "baseline" in srv:
                    p4 = _p4(srv["baseline"], srv[kind])
                    prefix = f"{kind}:{name}:"
                    speed["churn_itl_overhead"].update(_overheads(p4, prefix))
            continue
        targets = evaluate_targets(run)
        elastic = bool(cfg.get("elastic_default")) or (
            cfg.get("code_commit") in ELASTIC_DEFAULT_UNRECORDED
        )
        # The targets of "ours" (the default) and of its inline-swap variant.
        default, inline = ("P4_early", "P4")
        if cfg.get("early_swap_default"):
            default, inline = ("P4", "P4_inline")
        outs = {
            default: "p4_itl_overhead" if elastic else "p4_itl_overhead_classic",
            inline: "p4_itl_overhead_inline",
        }
        if not elastic:
            # The elastic defaults' settings, run by name before they were
            # the default.
            outs["P4_idle_locs"] = "p4_itl_overhead"
        for key, out in outs.items():
            if key in targets:
                speed[out].update(_overheads(targets[key], name + ":"))
        if name == "model":
            # rank_model/summary.json: each run's default, whichever it was.
            for key, out in (
                (default, "p4_itl_overhead"),
                (inline, "p4_itl_overhead_inline"),
            ):
                if key in targets:
                    model[out].update(_overheads(targets[key]))
        for key, out in (
            ("P4_warm", "p4_itl_overhead_warm_units"),
            ("P4_warm_flat", "p4_itl_overhead_warm_flat"),
            ("P4_warm_rope", "p4_itl_overhead_warm_rope"),
            ("P4_warm_direct", "p4_itl_overhead_warm_direct"),
            ("P4_warm_direct_flat", "p4_itl_overhead_warm_direct_flat"),
            ("P4_classic", "p4_itl_overhead_classic"),
        ):
            if key in targets:
                speed[out].update(_overheads(targets[key], name + ":"))
        if "hisparse" in srv and "baseline" in srv:
            his = _p4(srv["baseline"], srv["hisparse"])
            speed["hisparse_itl_overhead"].update(_overheads(his, name + ":"))
        if name == "model":
            for p in srv.get("ours", {}).get("points", []):
                prof = p.get("profile") or {}
                swap = prof.get("gpu_us_per_step", {}).get("swap")
                if swap is not None:
                    per_layer = round(swap / cfg["layers"], 2)
                    # The newest run's: the swap's cost on the code measured last.
                    out = "swap_us_per_layer" + ("" if elastic else "_classic")
                    speed[out][str(p["conc"])] = per_layer
        cap = {k: srv.get(k, {}).get("capacity", {}) for k in ("baseline", "ours")}
        both = [
            c
            for c, n in cap["ours"].items()
            if n is not None and cap["baseline"].get(c)
        ]
        # P3 from the first run that ran servers at capacity (--cap-contexts),
        # else from the first run's pool sizes.
        at_cap = bool(cfg.get("cap_contexts"))
        if both and ("p3_capacity_ratio" not in model or at_cap and not p3_at_cap):
            p3_at_cap = at_cap
            c = max(both, key=int)
            model["p3_length"] = int(c)
            model["p3_capacity_ratio"] = round(cap["ours"][c] / cap["baseline"][c], 3)
        # P5 from the run whose ours moves the most over PCIe at capacity.
        for row in targets["P5"]["rows"]:
            p = _point(srv.get("ours", {}), row["ctx"], at_cap=True)
            h2d = p["server"].get("h2d_gbps") if p else None
            if h2d and (best_p5 is None or h2d > best_p5[0]):
                best_p5 = (h2d, row, name)
    if best_p5 is not None:
        h2d, row, name = best_p5
        model.update(
            p5_vs_no_offload=row.get("vs_baseline"),
            p5_vs_hisparse=row.get("vs_hisparse"),
            p5_h2d_gbps=h2d,
            p5_length=row["ctx"],
            p5_trace=name,
        )
    return {"rank_model": model, "rank_speed": speed}


def mtp_speed_summary(results: List[dict]) -> Optional[dict]:
    """results/mtp/summary.json's speed key from the runs with MTP servers:
    ours + MTP's ITL / no offload + MTP's, "<model>:<trace>:<context>x<batch>"
    -> ratio (the exactness keys come from exactness.py's ``mtp``)."""
    ratios, steps, commits, versions = {}, set(), set(), set()
    for run in results:
        cfg = run["config"]
        t = evaluate_targets(run)
        if "P4_mtp" not in t:
            continue
        prefix = f"{cfg.get('model', 'tiny')}:{trace_name(cfg)}:"
        for key, v in _overheads(t["P4_mtp"], prefix).items():
            ratios[key] = round(1 + v, 4)
        steps.add(cfg.get("mtp_steps"))
        commits.add(cfg.get("code_commit", "unknown"))
        versions.add(recorded_sglang_version(cfg))
    if not ratios:
        return None
    return {
        "itl_ratio_vs_no_offload_mtp": ratios,
        "num_steps": sorted(s for s in steps if s is not None),
        "code_commit": one_or_sorted(commits),
        "sglang_version": one_or_sorted(versions),
    }


# The config keys that name one device call, not the measurement: calls of
# one measurement differ only in these.
CALL_CONFIG_KEYS = ("command", "started", "wall_s", "servers", "concurrency")


def _measured_points(res: dict) -> int:
    return sum(1 for p in res.get("points", []) if "skipped" not in p)


def _merged_calls_note(cfg: dict) -> str:
    calls = cfg.get("merged_calls")
    if not calls:
        return ""
    parts = [
        f"{', '.join(c['servers_measured']) or 'nothing'} from the call started "
        f"{c['started']}"
        for c in calls
    ]
    return (
        f" Merged from {len(calls)} device calls of the same flags "
        f"(`--merge-calls`): {'; '.join(parts)}."
    )


def merge_calls(results: List[dict]) -> dict:
    """One run from the calls of one measurement that the device split (its
    machine lost between servers, a budget that skipped a server's points):
    every config key but ``CALL_CONFIG_KEYS`` must agree; each server comes
    from the call that measured the most of its points (a tie between calls
    that both measured it is refused); the calls' commands and start times
    stay under ``config["merged_calls"]``."""
    if len(results) < 2:
        raise ValueError("merging needs the JSONs of at least two calls")
    first = results[0]["config"]
    for r in results[1:]:
        for key in sorted(set(first) | set(r["config"])):
            if key in CALL_CONFIG_KEYS:
                continue
            if first.get(key) != r["config"].get(key):
                raise ValueError(
                    f"config key {key!r} differs between the calls "
                    f"({first.get(key)!r} vs {r['config'].get(key)!r}): "
                    "not one measurement"
                )
    servers: Dict[str, dict] = {}
    for r in results:
        for kind, res in r["servers"].items():
            old = servers.get(kind)
            n = _measured_points(res)
            if old is not None and n and n == _measured_points(old):
                raise ValueError(
                    f"server {kind!r} measured {n} point(s) in two calls: "
                    "which one counts is not clear"
                )
            if old is None or n > _measured_points(old):
                servers[kind] = res
    config = dict(first)
    config["servers"] = [k for k in SERVER_KINDS if k in servers]
    concurrency: List[int] = []
    for r in results:
        for c in r["config"]["concurrency"]:
            if c not in concurrency:
                concurrency.append(c)
    config["concurrency"] = concurrency
    config["merged_calls"] = [
        {
            "command": r["config"].get("command"),
            "started": r["config"].get("started"),
            "servers_measured": [
                k for k, res in r["servers"].items() if servers[k] is res
            ],
        }
        for r in results
    ]
    config["command"] = " ; ".join(str(r["config"].get("command")) for r in results)
    merged = {"config": config, "servers": servers}
    merged["targets"] = evaluate_targets(merged)
    return merged


def write_report(results: List[dict], out_dir: str) -> None:
    md = render_markdown(results)
    path = os.path.join(out_dir, "bench_server.md")
    with open(path, "w") as f:
        f.write(md)
    log(f"wrote {path}")
    summaries = dict(rank_summaries(results))
    mtp = mtp_speed_summary(results)
    if mtp:
        summaries["mtp_speed"] = mtp
    for name, summary in summaries.items():
        path = os.path.join(out_dir, f"summary_{name}.json")
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
        log(f"wrote {path}")
    for p in render_plots(results, out_dir):
        log(f"wrote {p}")
    print(md, flush=True)


# --------------------------------------------------------------------- main


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="output directory")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        dest="mode",
        action="store_const",
        const="quick",
        help="the short preset (fewer points and rounds)",
    )
    mode.add_argument(
        "--full",
        dest="mode",
        action="store_const",
        const="full",
        help="the full preset (every point)",
    )
    p.set_defaults(mode="quick")
    p.add_argument(
        "--topk",
        choices=["model", "override"],
        default="model",
        help="model: the servers' own top-k; override: a top-k trace replayed into every server",
    )
    p.add_argument("--trace", help="override trace (default: generated into --out)")
    p.add_argument(
        "--servers",
        default=DEFAULT_SERVERS,
        help=f"some of {','.join(RUNNABLE_KINDS)} "
        "(ours_fixed: ours with --nsa-kv-offload-max-units 1, every request "
        "keeps exactly its own buffer; ours_wide: ours with the most units "
        "int16 slot ids allow; ours_8units: ours with at most 8 units; side by "
        "side with ours; baseline_mtp, ours_mtp: with MTP, --mtp-steps); "
        "started one after the other in the order given (the other kinds name "
        "committed runs of removed variants: --plot-only only)",
    )
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="every server on two GPUs: tp2 (attention TP) or dp2 (DP attention); "
        "the offload servers open the multi-GPU gate (docs/MULTI_GPU.md)",
    )
    p.add_argument(
        "--mtp-steps",
        type=int,
        default=3,
        choices=(1, 2, 3),
        help="draft steps of the *_mtp servers (NextN, eagle topk 1, draft "
        "tokens = steps + 1, without the overlap scheduler unless --mtp-spec-v2)",
    )
    p.add_argument(
        "--mtp-spec-v2",
        action="store_true",
        help="the *_mtp servers keep the overlap scheduler (spec v2, sglang's "
        "default with MTP) instead of --disable-overlap-schedule",
    )
    p.add_argument(
        "--contexts",
        type=_ints,
        help="comma-separated request context lengths (tokens)",
    )
    p.add_argument(
        "--concurrency",
        type=_ints,
        help="comma-separated batch sizes (concurrent requests)",
    )
    p.add_argument(
        "--max-point-tokens",
        type=int,
        help="skip the (context, concurrency) points whose context x "
        "concurrency exceeds this (host RAM, the no-offload server's KV)",
    )
    p.add_argument(
        "--cap-contexts",
        type=_ints,
        help="contexts where each server also runs at its own capacity (P5)",
    )
    p.add_argument("--new-tokens", type=int, help="decode tokens per request")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per (context, concurrency) point; its figures are medians",
    )
    p.add_argument(
        "--churn",
        type=int,
        default=0,
        metavar="N",
        help="each equal-batch point as requests coming and going: each of the "
        "--concurrency clients sends N requests back to back (the first wave "
        "ends staggered), so the batch admits a new context every ~new-tokens "
        "/ concurrency steps; P4 then compares the clients' mean ITL, which "
        "counts the admissions' stalls (0: one burst per run)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="start every server at once (own port, the budget's share of the "
        "memory free at its start, --sleep-on-idle) and run each point's "
        "repeats round-robin over them, rotating the order: host-speed drift "
        "hits all alike, and P4 also gives the median of per-round ratios",
    )
    p.add_argument(
        "--time-budget-s",
        type=float,
        help="wall time of the whole run, server starts included, seconds (a "
        "server is skipped when less than 150 s are left at its start)",
    )
    p.add_argument(
        "--trace-steps",
        type=int,
        help="decode steps of the generated top-k trace (--topk override)",
    )
    p.add_argument(
        "--trace-calibration",
        choices=sorted(TRACE_CALIBRATIONS),
        default="pessimistic",
        help="locality of the generated override trace: pessimistic (trace_gen's "
        "published-locality default, ~50%% misses at a 4096-row LRU) or reported "
        "(~13%%, the miss rates HiSparse's paper reports)",
    )
    p.add_argument(
        "--trace-layers",
        default="0,30,60",
        help="DeepSeek-V3.2 layers of the generated override trace, one per "
        "model layer (adjacent ones, e.g. 29,30,31, share most of their top-k: "
        "what the cross-layer prefetch needs)",
    )
    p.add_argument(
        "--trace-layer-cycle",
        action="store_true",
        help="model layer i reads trace layer i mod len(--trace-layers) (e.g. "
        "29,30,31: adjacent model layers read adjacent DeepSeek-V3.2 layers, "
        "for the cross-layer prefetch) instead of the nearest one",
    )
    p.add_argument(
        "--model",
        default="tiny",
        choices=["tiny", "rank"],
        help="tiny (3 layers, 1024 wide) or rank (61 layers, DeepSeek-V3.2 "
        "attention width, MoE and vocab shrunk)",
    )
    p.add_argument(
        "--checkpoint",
        help="none (dummy weights, the default), auto (the seed-0 checkpoint "
        "of --model, generated into /tmp if absent) or a checkpoint directory "
        "written by make_checkpoint.py",
    )
    p.add_argument(
        "--kv-budget-gib",
        type=float,
        default=4.0,
        help="GPU memory for the KV pools of every server (sets "
        "--mem-fraction-static); ~ a 61-layer model's KV budget x 3/61",
    )
    p.add_argument(
        "--hisparse-kv-budget-gib",
        type=float,
        help="HiSparse's KV budget instead of --kv-budget-gib: it pins "
        "host_to_device_ratio x its device pool in host memory, more than the "
        "host has at a large budget (its ITL at an equal batch does not need it)",
    )
    p.add_argument("--mem-fraction-static", type=float, help="overrides the budget")
    p.add_argument(
        "--extra-server-args",
        default="",
        help="more flags for every server, one string",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        help="request slots of every server (= ours' decode regions); default: "
        "what lets ours fill the budget with 128K requests, at least the "
        "largest concurrency",
    )
    p.add_argument(
        "--offload-default-slots",
        action="store_true",
        help="the offload servers without --max-running-requests: their own "
        "default request slots (decode regions up to 40%% of the KV budget), "
        "whose idle regions lend their rows to running requests as extra units; "
        "the other servers keep --max-running-requests",
    )
    p.add_argument(
        "--baseline-fused-topk",
        action="store_true",
        help="the no-offload servers keep sglang's default fused top-k "
        "(SGLANG_DSA_FUSE_TOPK=1) instead of the positional one every other "
        "server runs; only with --topk model (the override needs positions)",
    )
    p.add_argument("--host-pool-gb", type=float, help="ours' pinned host pool")
    p.add_argument(
        "--recent-window",
        type=int,
        default=64,
        help="recent-window rows per request (W)",
    )
    p.add_argument(
        "--buffer-size",
        type=int,
        help="ours' LRU rows per request and layer "
        "(--nsa-kv-offload-gpu-buffer-size; default: the server's, 2 x index_topk): "
        "more rows, fewer misses per step, fewer requests per GiB",
    )
    p.add_argument(
        "--max-units",
        type=int,
        help="ours: LRU buffers one request may hold while GPU rows are idle "
        "(--nsa-kv-offload-max-units; default: the server's, the units that hold "
        "the model's context)",
    )
    p.add_argument(
        "--decode-log-interval",
        type=int,
        default=32,
        help="decode steps between the servers' log lines (their throughput readings)",
    )
    p.add_argument("--port", type=int, default=31200, help="first server port")
    p.add_argument(
        "--start-timeout",
        type=float,
        default=420.0,
        help="seconds to wait for a server to come up",
    )
    p.add_argument(
        "--prefill-rate-guess",
        type=float,
        default=None,
        help="prefill tokens/s assumed before the first measurement (plans the "
        f"rounds; default {PREFILL_RATE_GUESS:.0f}, with --pd-decode "
        f"{PD_ADMIT_RATE_GUESS:.0f}: no prefill, only the fake transfer and "
        "the offload's admission)",
    )
    p.add_argument(
        "--no-record",
        dest="record",
        action="store_false",
        help="do not record the top-k in the servers",
    )
    p.add_argument(
        "--record-rows",
        type=int,
        default=2,
        help="batch rows the top-k recorder keeps per step",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after a point's measured runs, run it once more and profile this "
        "many decode steps (torch profiler: GPU time by kernel category, host "
        "launches; step_profile.py); needs --no-record",
    )
    p.add_argument(
        "--keep-recordings",
        action="store_true",
        help="keep the recorded top-k files (topk_<server>_<topk>_<ctx>x<conc>.npz)",
    )
    p.add_argument(
        "--pd-decode",
        action="store_true",
        help="every server a PD decode server fed by sglang's fake KV transfer "
        "(no prefill: long contexts at large batch in seconds; the KV stays "
        "unwritten, so only with --topk override)",
    )
    p.add_argument(
        "--plot-only",
        nargs="+",
        metavar="JSON",
        help="render the table and PNGs of earlier runs (no GPU)",
    )
    p.add_argument(
        "--merge-calls",
        action="store_true",
        help="with --plot-only: the JSONs are device calls of one measurement "
        "(same flags, servers split between them): write them as one run, "
        "bench_server_<topk>.json in --out, each server from the call "
        "that measured it",
    )
    args = p.parse_args(argv)
    if args.prefill_rate_guess is None:
        args.prefill_rate_guess = (
            PD_ADMIT_RATE_GUESS if args.pd_decode else PREFILL_RATE_GUESS
        )
    if args.merge_calls and not args.plot_only:
        p.error("--merge-calls goes with --plot-only")
    if args.profile_steps and args.record and not args.plot_only:
        # The recorder's ring would hold the profiled run, not the point's.
        p.error("--profile-steps needs --no-record")
    for key, value in MODES[args.mode].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.pd_decode and args.topk != "override" and not args.plot_only:
        p.error(
            "--pd-decode takes --topk override: the model's top-k over unwritten "
            "KV says nothing about misses"
        )
    if args.baseline_fused_topk and args.topk == "override":
        p.error(
            "--baseline-fused-topk takes --topk model: the override needs positions"
        )
    if args.interleave and not args.plot_only:
        if args.record or args.profile_steps or args.cap_contexts:
            p.error(
                "--interleave measures equal-batch points only: it takes "
                "--no-record and no --profile-steps or --cap-contexts"
            )
    # The profile starts at the first decode log line of the full batch and
    # must end while it still decodes (a profiler left on would stop inside
    # the next point and slow it down).
    if args.profile_steps + 2 * args.decode_log_interval > args.new_tokens:
        p.error(
            f"--profile-steps {args.profile_steps}: at most --new-tokens "
            f"({args.new_tokens}) - 2 x --decode-log-interval "
            f"({args.decode_log_interval})"
        )
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        results = []
        for path in args.plot_only:
            with open(path) as f:
                results.append(json.load(f))
        out = args.out or os.path.dirname(os.path.abspath(args.plot_only[0]))
        os.makedirs(out, exist_ok=True)
        if args.merge_calls:
            try:
                merged = merge_calls(results)
            except ValueError as e:
                raise SystemExit(f"--merge-calls: {e}")
            results = [merged]
            path = os.path.join(out, f"bench_server_{merged['config']['topk']}.json")
            with open(path, "w") as f:
                json.dump(merged, f, indent=1)
            log(f"wrote {path}")
        write_report(results, out)
        return 0
    if not args.out:
        raise SystemExit("--out is required")
    started = time.time()
    deadline = started + args.time_budget_s
    os.makedirs(args.out, exist_ok=True)
    args.out = os.path.abspath(args.out)
    args.checkpoint_meta = select_model(args)
    asked = [k for k in args.servers.split(",") if k]
    unknown = sorted(set(asked) - set(SERVER_KINDS))
    if unknown:
        raise SystemExit(f"--servers: unknown {unknown}; choose from {RUNNABLE_KINDS}")
    for kind in asked:
        if kind in READ_ONLY_KINDS:
            raise SystemExit(f"--servers {kind}: {READ_ONLY_KINDS[kind]}")
    # In the order asked: with a tight --time-budget-s the pair to compare
    # goes first (a cold server's JIT can take minutes).
    kinds = asked_kinds = list(dict.fromkeys(asked))
    if args.pd_decode and args.mtp_spec_v2 and any(k.endswith("_mtp") for k in kinds):
        # The offload refuses spec v2 on a PD decode server (docs/MTP.md).
        raise SystemExit("--pd-decode with --mtp-spec-v2: drop one")
    layers = num_model_layers()
    if args.mem_fraction_static is None:
        args.mem_fraction_static, how = mem_fraction_for_budget(args.kv_budget_gib)
    else:
        how = "given"
    args.mem_fraction_how = how
    if args.max_running_requests is None:
        args.max_running_requests = max(
            ours_auto_slots(
                args.kv_budget_gib,
                layers,
                args.new_tokens,
                args.buffer_size or 4096,
                offload_max_units(args.max_units, args.buffer_size),
                args.pd_decode,
            ),
            slots_to_hold(max(args.concurrency), args.pd_decode),
        )
    if args.host_pool_gb is None:
        # Enough host slots for every logical loc the budget allows.
        per_loc = layers * (INDEXER_BYTES + 2) + 8
        args.host_pool_gb = math.ceil(
            args.kv_budget_gib * (1 << 30) / per_loc * layers * ROW_BYTES / 1e9 + 1
        )
    # One run's decode steps (flushed after each run), plus slack.
    args.record_steps = args.new_tokens + 64
    if args.trace:
        args.trace = os.path.abspath(args.trace)
    log(
        f"mode {args.mode}, top-k {args.topk}, servers {kinds}, contexts "
        f"{args.contexts}, concurrency {args.concurrency}, capacity runs at "
        f"{args.cap_contexts}, {args.new_tokens} new tokens; mem fraction "
        f"{args.mem_fraction_static} ({how}), {args.max_running_requests} request "
        f"slots, host pool {args.host_pool_gb} GB; budget {args.time_budget_s:.0f} s"
    )
    result = {
        "config": {
            "mode": args.mode,
            "topk": args.topk,
            "trace": None,
            "trace_calibration": (
                args.trace_calibration if args.topk == "override" else None
            ),
            "trace_layers": args.trace_layers if args.topk == "override" else None,
            "trace_layer_cycle": args.trace_layer_cycle,
            "servers": kinds,
            "contexts": args.contexts,
            "concurrency": args.concurrency,
            "cap_contexts": args.cap_contexts,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "churn": args.churn,
            "interleave": args.interleave,
            "kv_budget_gib": args.kv_budget_gib,
            "hisparse_kv_budget_gib": args.hisparse_kv_budget_gib,
            "mem_fraction_static": args.mem_fraction_static,
            "mem_fraction_how": how,
            "max_running_requests": args.max_running_requests,
            "offload_default_slots": args.offload_default_slots,
            "baseline_fused_topk": args.baseline_fused_topk,
            "host_pool_gb": args.host_pool_gb,
            "recent_window": args.recent_window,
            "buffer_size": args.buffer_size,
            # ours' LRU units per request (ours_fixed: 1).
            "ours_max_units": offload_max_units(args.max_units, args.buffer_size),
            "decode_log_interval": args.decode_log_interval,
            "model": args.model,
            "shape": args.shape,
            "pd_decode": args.pd_decode,
            "mtp_steps": args.mtp_steps,
            "mtp_spec_v2": args.mtp_spec_v2,
            "checkpoint": args.checkpoint_meta,
            "layers": layers,
            "sinks": SINKS,
            "recent": RECENT,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(shlex.quote(a) for a in sys.argv),
            "code_commit": git_commit(),
            "sglang_version": sglang_version(),
            "gpu": gpu_name(),
            # ours' swap schedule without the env var (rank_summaries).
            "early_swap_default": OURS_EARLY_SWAP_DEFAULT,
            "elastic_default": OURS_ELASTIC_DEFAULT,
        },
        "servers": {},
    }
    json_path = os.path.join(args.out, f"bench_server_{args.topk}.json")

    def save():
        result["config"]["wall_s"] = time.time() - started
        result["targets"] = evaluate_targets(result)
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    try:
        prepare_trace(args)
        result["config"]["trace"] = args.trace
        startup_guess = 90.0
        if args.interleave:
            bench_interleaved(args, kinds, deadline, result, save)
            kinds = []  # measured
        for i, kind in enumerate(kinds):
            log(f"=== server {i + 1}/{len(kinds)}: {kind} ===")
            res = bench_server(args, kind, deadline, len(kinds) - i, startup_guess)
            if "startup_s" in res and i > 0:
                # The first start compiles the JIT kernels (minutes on a cold
                # machine) that the later ones reuse: plan with a warm start.
                startup_guess = res["startup_s"] + 20
            result["servers"][kind] = res
            save()
            args.port += 1
    except KeyboardInterrupt:
        log("interrupted: writing what was measured")
    save()
    log(f"wrote {json_path}")
    write_report([result], args.out)
    failed = [k for k, r in result["servers"].items() if "error" in r]
    return 1 if failed or len(result["servers"]) < len(asked_kinds) else 0


if __name__ == "__main__":
    raise SystemExit(main())
