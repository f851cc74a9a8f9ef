"""End-to-end exactness of --enable-decode-nsa-kv-offload on weights that make
attention matter (GPU host).

Generates a checkpoint (``make_checkpoint.py``: ``tiny`` or ``rank``), starts
the servers of ``--servers`` (all at once for ``tiny``, one after the other
for ``rank``, whose weights take a third of the GPU each) and sends each the
same requests:

* ``seq``: prompts of the boundary lengths (1, 63, 64, 65, 2047, 2048, 2049,
  buffer +-1, buffer + window +-1, buffer - 32 so that decode crosses the
  buffer, >= 30K, ...) and random ones, one request at a time (batch 1: the
  batch composition, which changes GEMM and MoE rounding, is the same on
  every server), greedy, ``--max-new-tokens``;
* ``abort``: streamed requests the client closes after a few tokens (what a
  client abort mid-stream is), then the same prompts again, one at a time:
  the partial outputs must be prefixes, the repeated ones identical;
* ``concurrent``: the ``seq`` prompts again, ``--concurrency`` at a time (the
  batch composition then follows timing: compared as reported agreement);
* ``nc`` (negative control, on the servers with ``nc``): the control prompts
  one at a time without and with the benchmark-only top-k corruption armed
  (``nsa_topk_trace.TopkCorruption``: in layer 0, the first top-k entry of a
  row replaced by another token's position at the decode step whose
  sequence length is a multiple of 64; one wrong KV row read once). A request
  flips when its greedy output differs within the 64 tokens from that step;
  before it the output must be unchanged.

Every offload server is compared with the no-offload server of its KV dtype
(same top-k path: positional top-k, ``SGLANG_DSA_FUSE_TOPK=0``); the
``stock`` server (sglang's defaults: fused top-k, no hooks) with the
no-offload one; ``*_retract`` servers force retraction
(``SGLANG_TEST_RETRACT``: sglang retracts decode requests every
``SGLANG_TEST_RETRACT_INTERVAL`` forwards) and are compared with each other.
The ``*_mtp*`` servers (``--servers mtp``) run MTP (NextN, eagle topk 1,
1 to 3 steps, without the overlap scheduler; one pair with forced retraction) with and without
the offload, the ``*_mtp*_v2*`` ones (``--servers mtp_v2``) the same with
spec v2 (the overlap scheduler); besides the outputs,
each request's accept counts (verify forwards, accepted drafts, histogram)
must match the no-offload MTP server's (``summary.json``'s ``mtp``).
Writes ``exactness.json`` (every output) and ``summary.json``/``summary.md``.

    python benchmark/nsa_offload/server/exactness.py --model tiny --out /tmp/exact_tiny
"""

import argparse
import gzip
import json
import os
import random
import re
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

from make_checkpoint import (
    RECORD_OUT_GAIN,
    RECORD_QK_GAIN,
    load_config,
    write_checkpoint,
)
from server_utils import (
    BF16_KV_ARGS,
    ENV_UNPROVEN_PARALLEL,
    SHAPES,
    UNITS_RE,
    Server,
    git_commit,
    mtp_args,
    random_prompts,
    sglang_version,
)

NC_PERIOD = 64  # corrupted decode step: seq_len % NC_PERIOD == 0
# Negative-control modes: the arm file's "M R" (corrupt where seq_len % M == R).
# step: one decode step in every 64 (one wrong KV row read once); persistent:
# every decode step (the same request position's row read wrong each time,
# as a stale row would be until evicted).
NC_MODES = {"step": (NC_PERIOD, 0), "persistent": (1, 0)}
# The seq phase saves what it has every this many requests (``seq_partial``).
PARTIAL_EVERY = 8
# Phases counted in ``identical`` / ``total``: batch 1 (seq, abort) and the
# bf16 retraction case (see SERVERS).
STRICT_PHASES = ("seq", "abort", "retract", "level")
# Leveling's server (``ours_bf16_level``): more request slots than the
# concurrent phase fills and more units per request than the free regions
# give everyone, meant to leave uneven holders whose region units move (its
# decode log's ``units moved``; on the H200 the staging units lent beside
# them kept every request within one unit: 0 moved).
LEVEL_MAX_RUNNING = 24
LEVEL_MAX_UNITS = 6
# traces/nsa_topk_trace.py: the layer whose top-k the control corrupts.
ENV_CORRUPT_LAYER = "SGLANG_NSA_TOPK_CORRUPT_LAYER"
SORTED_TOPK_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "sorted_topk"
)

# name -> how the server differs from the no-offload fp8 server on the
# checkpoint. "base": the server it is compared with.
# MTP's heavy eviction: the smallest buffer verify allows (q x top-k at 3
# steps) and window (2q - 1), one unit.
MTP_HEAVY_OFFLOAD_ARGS = [
    "--nsa-kv-offload-max-units",
    "1",
    "--nsa-kv-offload-gpu-buffer-size",
    "8192",
    "--nsa-kv-offload-recent-window",
    "8",
]
# The unit cap the rank bench met its latency target with (results/rank_speed/,
# cfdc9bc; int32 slot ids). Its other settings then (warm units, direct slots,
# spare regions) are the offload's design now; its flat miss copy was removed.
# The tiny checkpoint's default units: its context's (10).
ELASTIC_UNITS = ["--nsa-kv-offload-max-units", "10"]
TUNED_MAX_UNITS = 8


def tuned_server(**spec) -> dict:
    """A server spec with the tuned unit cap (``spec`` may override it)."""
    offload = ["--nsa-kv-offload-max-units", str(TUNED_MAX_UNITS)]
    return {"offload": offload, **spec}


# Unit leveling: its concurrent batches against the batch-1 outputs (bf16
# batches do not change the outputs on this checkpoint: the control is the
# no-offload server's own concurrent phase).
LEVEL_SPEC = dict(
    kv="bf16",
    offload=["--nsa-kv-offload-max-units", str(LEVEL_MAX_UNITS)],
    max_running=LEVEL_MAX_RUNNING,
    base="base_bf16",
    control="base_bf16",
    batch_phase="level",
)
# Heavy eviction: one unit of 2,048 rows (index_topk) and an 8-row window.
HEAVY_OFFLOAD = [
    "--nsa-kv-offload-max-units",
    "1",
    "--nsa-kv-offload-gpu-buffer-size",
    "2048",
    "--nsa-kv-offload-recent-window",
    "8",
]
SERVERS = {
    "base_fp8": dict(nc=True, repeat=True),
    "ours_fp8": dict(offload=[], base="base_fp8", metrics=True),
    # 2 request slots at the tiny context's units: a request's units beyond
    # the free regions come from spare regions and the indexer keys of free
    # locs (the arena; its decode log's "of idle locs").
    "ours_fp8_idle_locs": dict(
        offload=ELASTIC_UNITS,
        max_running=2,
        base="base_fp8",
    ),
    # At most 2 units: the tiny prompts past 8,192 positions walk the LRU over
    # two chunks of per-unit state, beside direct ones (with the tiny
    # context's 10 units every tiny prompt fits its units at batch 1 and none
    # walks). Its earlier flat-copy twin read wrong KV on the H200 (52/64 and
    # 44/64, results/units/per_unit_gpu_gate/).
    "ours_fp8_2units": dict(
        offload=["--nsa-kv-offload-max-units", "2"], base="base_fp8"
    ),
    # The default in verify mode (--nsa-kv-offload-verify count): every KV row
    # attention reads is compared with the full pool kept beside the offload.
    "ours_fp8_verify": dict(
        offload=["--nsa-kv-offload-verify", "count"], base="base_fp8", metrics=True
    ),
    "ours_fp8_1unit": dict(
        offload=["--nsa-kv-offload-max-units", "1"], base="base_fp8"
    ),
    "ours_fp8_heavy": dict(
        offload=HEAVY_OFFLOAD,
        base="base_fp8",
    ),
    "ours_fp8_tuned": tuned_server(base="base_fp8"),
    # Units cut to a 30K context (7 x 4,416 = 30,912 slots): every request of
    # the rank bench's 30K x 64 direct in 448 regions (results/rank_speed/).
    "ours_fp8_tuned_4416": tuned_server(
        offload=[
            "--nsa-kv-offload-max-units",
            "7",
            "--nsa-kv-offload-gpu-buffer-size",
            "4416",
        ],
        base="base_fp8",
    ),
    "base_bf16": dict(kv="bf16"),
    "ours_bf16": dict(kv="bf16", offload=[], base="base_bf16"),
    "ours_bf16_tuned": tuned_server(kv="bf16", base="base_bf16"),
    "base_fp8_retract": dict(retract=True),
    "ours_fp8_retract": dict(offload=[], retract=True, base="base_fp8_retract"),
    # sglang retracts only from batches of two or more, and fp8 outputs change
    # with the batch: the retraction case is bf16, its concurrent phase
    # against the no-offload server's batch-1 outputs. base_bf16_retract is
    # its control, sglang's own retraction the same way: the case is strict
    # only where the control is identical (the checkpoint is batch-invariant
    # under retraction), otherwise reported beside the control.
    "base_bf16_retract": dict(kv="bf16", retract=True),
    "ours_bf16_level": dict(LEVEL_SPEC),
    "ours_bf16_retract": dict(
        kv="bf16",
        offload=[],
        retract=True,
        base="base_bf16",
        control="base_bf16_retract",
    ),
    # The tuned unit cap through retraction (a retracted request is warmed
    # again when it comes back); its leveling twin is ours_bf16_level (whose
    # own unit cap it took: with the tuned env gone, the same server).
    "ours_bf16_tuned_retract": tuned_server(
        kv="bf16", retract=True, base="base_bf16", control="base_bf16_retract"
    ),
    "stock_fp8": dict(stock=True, repeat=True, base="base_fp8"),
    "dummy_fp8": dict(dummy=True, nc=True),
    # MTP (EAGLE / NextN, eagle topk 1, draft tokens = steps + 1, without the
    # overlap scheduler: spec v1 on sglang 0.5.12, the v2 worker run
    # synchronously since 0.5.17):
    # each offload server against the no-offload server with the same MTP
    # settings, outputs and accept counts (docs/MTP.md).
    # Its negative control corrupts verify rows (traces/bench_hooks/0001).
    "base_fp8_mtp": dict(mtp=3, nc=True),
    "ours_fp8_mtp": dict(mtp=3, offload=[], base="base_fp8_mtp"),
    "ours_fp8_mtp_heavy": dict(
        mtp=3, offload=MTP_HEAVY_OFFLOAD_ARGS, base="base_fp8_mtp"
    ),
    "base_fp8_mtp1": dict(mtp=1),
    "ours_fp8_mtp1": dict(mtp=1, offload=[], base="base_fp8_mtp1"),
    "base_fp8_mtp2": dict(mtp=2),
    "ours_fp8_mtp2": dict(mtp=2, offload=[], base="base_fp8_mtp2"),
    # Retraction mid-speculation; a retracted request is prefilled again,
    # which rounds differently from decode: against a retracting server.
    "base_fp8_mtp_retract": dict(mtp=3, retract=True),
    "ours_fp8_mtp_retract": dict(
        mtp=3, offload=[], retract=True, base="base_fp8_mtp_retract"
    ),
    "base_bf16_mtp": dict(mtp=3, kv="bf16"),
    "ours_bf16_mtp": dict(mtp=3, kv="bf16", offload=[], base="base_bf16_mtp"),
    # Spec v2 (the overlap scheduler, sglang's default with MTP): the same
    # MTP flags without --disable-overlap-schedule, against the no-offload
    # spec v2 server ('mtp_v2' group, not in 'mtp').
    "base_fp8_mtp_v2": dict(mtp=3, spec_v2=True),
    "ours_fp8_mtp_v2": dict(mtp=3, spec_v2=True, offload=[], base="base_fp8_mtp_v2"),
    "ours_fp8_mtp_v2_heavy": dict(
        mtp=3, spec_v2=True, offload=MTP_HEAVY_OFFLOAD_ARGS, base="base_fp8_mtp_v2"
    ),
    "base_fp8_mtp1_v2": dict(mtp=1, spec_v2=True),
    "ours_fp8_mtp1_v2": dict(mtp=1, spec_v2=True, offload=[], base="base_fp8_mtp1_v2"),
    "base_fp8_mtp_v2_retract": dict(mtp=3, spec_v2=True, retract=True),
    "ours_fp8_mtp_v2_retract": dict(
        mtp=3, spec_v2=True, offload=[], retract=True, base="base_fp8_mtp_v2_retract"
    ),
    "base_bf16_mtp_v2": dict(mtp=3, spec_v2=True, kv="bf16"),
    "ours_bf16_mtp_v2": dict(
        mtp=3, spec_v2=True, kv="bf16", offload=[], base="base_bf16_mtp_v2"
    ),
    # Two GPUs (docs/MULTI_GPU.md): attention TP (one host pool shared by the
    # ranks) and DP attention (each rank its own requests), each against the
    # no-offload server of the same shape.
    "base_fp8_tp2": dict(shape="tp2"),
    "ours_fp8_tp2": dict(shape="tp2", offload=[], base="base_fp8_tp2"),
    "base_fp8_dp2": dict(shape="dp2"),
    "ours_fp8_dp2": dict(shape="dp2", offload=[], base="base_fp8_dp2"),
}
TINY_SERVERS = ",".join(
    n for n, spec in SERVERS.items() if "mtp" not in spec and "shape" not in spec
)
RANK_SERVERS = "base_fp8,ours_fp8"
MTP_SERVERS = ",".join(
    n for n, spec in SERVERS.items() if "mtp" in spec and not spec.get("spec_v2")
)
MTP_V2_SERVERS = ",".join(n for n, spec in SERVERS.items() if spec.get("spec_v2"))
MULTIGPU_SERVERS = ",".join(n for n, spec in SERVERS.items() if "shape" in spec)


def case_lengths(
    buffer: int, window: int, longest: int, max_new_tokens: int = 65
) -> List[int]:
    # c - cross: decode crosses the buffer size halfway through the output.
    cross = max(1, max_new_tokens // 2)
    edges = [1, 63, 64, 65, 2047, 2048, 2049]
    for c, w in ((buffer, window), (2048, 8)):
        edges += [c - 1, c, c + 1, c + w - 1, c + w, c + w + 1, c - cross]
    edges += [4 * buffer - 1, 4 * buffer + 1, 30000, longest]
    return sorted(set(edges))


class ExactServer(Server):
    """A ``Server`` with what the exactness phases need besides generate."""

    def stop(self):
        self.__exit__(None, None, None)

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Until the server runs and queues no request (an aborted stream is
        dropped at its next output, not when the client closes)."""
        tic = time.time()
        while time.time() - tic < timeout:
            with urllib.request.urlopen(self.url + "/get_load", timeout=10) as r:
                if sum(x["num_reqs"] for x in json.loads(r.read())) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"[{self.name}] still busy after {timeout} s")

    def stream_abort(self, input_ids: List[int], after: int) -> List[int]:
        """Stream a request and close the connection after ``after`` chunks."""
        body = json.dumps(
            {
                "input_ids": input_ids,
                "stream": True,
                "sampling_params": {
                    "max_new_tokens": 4096,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            }
        ).encode()
        req = urllib.request.Request(
            self.url + "/generate",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        ids: List[int] = []
        r = urllib.request.urlopen(req, timeout=600)
        try:
            chunks = 0
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                out = json.loads(line[5:])
                ids = list(out.get("output_ids", ids))
                chunks += 1
                if chunks >= after:
                    break
        finally:
            r.close()
        return ids


def server_args(spec: dict, args, ckpt: str) -> (List[str], Dict[str, str]):
    extra = [
        "--mem-fraction-static",
        str(args.mem_fraction_static),
        "--max-total-tokens",
        str(args.max_total_tokens),
        "--max-running-requests",
        str(spec.get("max_running", args.concurrency)),
        "--cuda-graph-max-bs-decode",
        str(args.concurrency),
        "--context-length",
        str(args.context_length),
        "--decode-log-interval",
        "10",
    ]
    env = {}
    if not spec.get("dummy"):
        extra += ["--load-format", "auto", "--model-path", ckpt]
    if spec.get("metrics"):
        extra += ["--enable-metrics"]
    if spec.get("kv") == "bf16":
        extra += BF16_KV_ARGS
    if spec.get("mtp"):
        extra += mtp_args(spec["mtp"], spec_v2=spec.get("spec_v2", False))
        if spec.get("spec_v2"):
            env["SGLANG_ENABLE_SPEC_V2"] = "1"  # sglang's default, stated
    if spec.get("shape"):
        extra += SHAPES[spec["shape"]]
        if spec.get("offload") is not None:
            env[ENV_UNPROVEN_PARALLEL] = "1"
    if spec.get("offload") is not None:
        extra += [
            "--enable-decode-nsa-kv-offload",
            "--nsa-kv-offload-host-pool-gb",
            str(args.host_pool_gb),
            *spec["offload"],
        ]
    if not spec.get("stock"):
        # Positional top-k in a deterministic order (sorted_topk/).
        env["SGLANG_DSA_FUSE_TOPK"] = "0"
        env["SGLANG_NSA_TOPK_SORTED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (SORTED_TOPK_DIR, os.environ.get("PYTHONPATH")) if p
        )
        # cuBLAS picks its workspace per stream; a fixed one keeps its
        # reductions the same from run to run.
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if spec.get("nc"):
        env[ENV_CORRUPT_LAYER] = str(args.nc_layer)
    if spec.get("retract"):
        env["SGLANG_TEST_RETRACT"] = "1"
        env["SGLANG_TEST_RETRACT_INTERVAL"] = str(args.retract_interval)
    env.update(spec.get("env", {}))
    return extra, env


def run_phases(srv: ExactServer, spec: dict, args, prompts, nc_prompts, res, save):
    n = args.max_new_tokens
    # Retracting servers: which phase the retractions fell in (sglang keeps
    # one request: none at batch 1), from the log's running count.
    retracted, counted = {}, [0]

    def count_retracted(phase: str) -> None:
        if spec.get("retract"):
            total = scan_log(srv.log_path)["retracted_reqs"]
            retracted[phase], counted[0] = total - counted[0], total

    if not spec.get("nc_only"):
        t = time.time()
        outs = []
        for i, p in enumerate(prompts):
            outs.append(srv.generate(p, n))
            if (i + 1) % PARTIAL_EVERY == 0 and i + 1 < len(prompts):
                # A call cut by its time limit keeps what ran (reported only).
                res["seq_partial"] = [o["output_ids"] for o in outs]
                if spec.get("mtp"):
                    res["seq_accept_partial"] = [
                        accept_record(o["meta_info"]) for o in outs
                    ]
                save()
        res.pop("seq_partial", None)
        res.pop("seq_accept_partial", None)
        res["seq_s"] = round(time.time() - t, 1)
        res["seq"] = [o["output_ids"] for o in outs]
        count_retracted("seq")
        if spec.get("mtp"):
            # Verify forwards per request and how many drafts each accepted:
            # the same outputs with other accept lengths would mean that the
            # target's verify read other KV rows.
            res["seq_accept"] = [accept_record(o["meta_info"]) for o in outs]
        save()
    if spec.get("repeat") and not args.skip_repeat:
        # The same requests again: the server's own run-to-run agreement.
        res["seq_again"] = [srv.generate(p, n)["output_ids"] for p in prompts]
        save()
    if spec.get("nc"):
        arm = srv.env["SGLANG_NSA_TOPK_CORRUPT"]
        nc_tokens = 2 * NC_PERIOD + 1
        res["nc_clean"] = [srv.generate(p, nc_tokens)["output_ids"] for p in nc_prompts]
        res["nc_hits"] = {}
        for mode in args.nc_modes.split(","):
            with open(arm, "w") as f:
                f.write("%d %d" % NC_MODES[mode])
            time.sleep(1.0)  # the server's poll thread reads it every 0.2 s
            res[f"nc_armed_{mode}"] = [
                srv.generate(p, nc_tokens)["output_ids"] for p in nc_prompts
            ]
            os.remove(arm)
            time.sleep(1.0)
            try:
                with open(arm + ".hits") as f:
                    res["nc_hits"][mode] = int(f.read())
            except OSError:
                res["nc_hits"][mode] = 0
            save()
    if spec.get("dummy") or spec.get("nc_only"):
        return
    # One aborted stream at a time, each alone on the server (batch 1: its
    # partial output must be a prefix of its seq output), then the same
    # prompts again once the server is idle.
    k = args.abort_requests
    res["abort_partial"] = []
    for i in range(k):
        res["abort_partial"].append(srv.stream_abort(prompts[i], 4 + 3 * i))
        srv.wait_idle()
    res["abort_again"] = [srv.generate(p, n)["output_ids"] for p in prompts[:k]]
    count_retracted("abort")
    save()
    if not args.skip_concurrent:
        t = time.time()
        res["concurrent"] = srv.generate_many(prompts, n, args.concurrency)
        res["concurrent"] = [r["output_ids"] for r in res["concurrent"]]
        res["concurrent_s"] = round(time.time() - t, 1)
        count_retracted("concurrent")
    if retracted:
        res["retracted_reqs"] = retracted
    # The scheduler goes idle: sglang's own leak check runs, the server must
    # still answer.
    time.sleep(args.idle_wait)
    res["after_idle"] = srv.generate(prompts[0], n)["output_ids"]
    res["alive"] = srv.proc.poll() is None
    if spec.get("metrics"):
        res["metrics"] = scrape_offload_metrics(srv.url)
    save()


def scrape_offload_metrics(url: str) -> Dict[str, float]:
    """The offload's series on the server's ``/metrics`` (summed over labels)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sglang:nsa_kv_offload_"):
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# The offload's startup lines: each host pool a process maps, and the pool's
# scope (nsa_kv_only_host_pool.py, arg_groups/nsa_kv_offload_hook.py).
HOST_POOL_LINE = re.compile(
    r"NSA KV-only host pool: (\d+) tokens x (\d+) layers x (\d+) B = [0-9.]+ GB"
)
HOST_POOL_SCOPE = re.compile(
    r"host pool [0-9.]+ GB (shared by (\d+) attention-TP ranks|per rank)"
)


# The verify mode's part of the decode log line (totals since startup).
VERIFY_RE = re.compile(r"verify: (\d+) rows checked, (\d+) mismatches")


def open_log(path: str):
    """A server log for reading as text, gzipped (``.gz``) or not."""
    return (gzip.open if path.endswith(".gz") else open)(path, "rt", errors="replace")


def scan_log(path: str) -> dict:
    """Retractions, errors and the offload's decode-log counters (summed over
    the run: misses are KV rows copied from host, all layers); the host pools
    the server's processes mapped (bytes per token of each) and their scope."""
    out = {"retractions": 0, "retracted_reqs": 0, "errors": 0, "offload_line": None}
    misses, min_hit, moved, idle_locs = 0, None, None, None
    pools, ranks_per_pool = [], None
    with open_log(path) as f:
        for line in f:
            m = HOST_POOL_LINE.search(line)
            if m:
                pools.append(int(m.group(2)) * int(m.group(3)))
            m = HOST_POOL_SCOPE.search(line)
            if m:
                ranks_per_pool = int(m.group(2)) if m.group(2) else 1
            if "#retracted_reqs:" in line:
                out["retractions"] += 1
                out["retracted_reqs"] += int(
                    line.split("#retracted_reqs:")[1].split(",")[0]
                )
            if "Traceback" in line and "OpenAIServingResponses" not in line:
                out["errors"] += 1  # that one: openai_harmony missing, harmless
            elif "memory leak" in line.lower():
                out["errors"] += 1
            if "nsa-offload hit rate" in line:
                out["offload_line"] = line.strip()[-200:]
                hit = float(line.split("nsa-offload hit rate: ")[1].split(",")[0])
                min_hit = hit if min_hit is None else min(min_hit, hit)
                misses += int(line.split(" misses: ")[1].split(",")[0])
                m = UNITS_RE.search(line)
                if m and m.group(2) is not None:
                    moved = (moved or 0) + int(m.group(2))
                if m and m.group(3) is not None:
                    idle_locs = max(idle_locs or 0, int(m.group(3)))
                m = VERIFY_RE.search(line)
                if m:  # cumulative: the last line holds the totals
                    out["verify_checked_rows"] = int(m.group(1))
                    out["verify_mismatches"] = int(m.group(2))
    if min_hit is not None:
        out.update(misses=misses, min_hit_rate=min_hit)
    if moved is not None:
        out["units_moved"] = moved
    if idle_locs is not None:
        # The most units the idle locs' keys lent at once (decode log).
        out["max_idle_loc_units"] = idle_locs
    if pools:
        out.update(host_pool_bytes_per_token=pools, host_pool_ranks=ranks_per_pool)
    return out


def accept_record(meta: dict) -> Optional[dict]:
    """What sglang's ``meta_info`` says of a request's speculation (None
    when it says nothing: then there is nothing to compare)."""
    if not meta.get("spec_verify_ct"):
        return None
    return {
        "verify_ct": meta["spec_verify_ct"],
        "correct_drafts": meta.get("spec_num_correct_drafts"),
        "histogram": meta.get("spec_correct_drafts_histogram"),
        "accept_length": meta.get("spec_accept_length"),
    }


def compare_accept(a: List[Optional[dict]], b: List[Optional[dict]]) -> dict:
    """Per request: the same verify count, accepted drafts and histogram on
    both servers; a request without a record counts as differing."""
    same = [x is not None and x == y for x, y in zip(a, b)]
    lengths = [x["accept_length"] for x in a if x and x["accept_length"]]
    return {
        "identical": sum(same),
        "total": len(same),
        "first_differing": [i for i, ok in enumerate(same) if not ok][:8],
        "mean_accept_length": (
            round(sum(lengths) / len(lengths), 3) if lengths else None
        ),
    }


def first_diff(a: List[int], b: List[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def negative_control(res: dict, nc_lens: List[int], mode: str = "step") -> dict:
    """Flips of one control mode: the output differs within the 64 tokens
    from the first corrupted decode step; it must not differ before it."""
    period, residue = NC_MODES[mode]
    flips, early, later = 0, 0, 0
    for clean, armed, plen in zip(res["nc_clean"], res[f"nc_armed_{mode}"], nc_lens):
        # Output token i is decoded at sequence length plen + i (i >= 1).
        ic = (residue - plen) % period or period
        d = first_diff(clean, armed)
        if d is not None and d < ic:
            early += 1
        if d is not None and ic <= d < ic + NC_PERIOD:
            flips += 1
        if d is not None and d >= ic + NC_PERIOD:
            later += 1
    n = len(nc_lens)
    return {
        "requests": n,
        "flipped": flips,
        "flip_fraction": round(flips / max(n, 1), 4),
        # differs only after the 64 tokens (reported, not counted)
        "flipped_later": later,
        "changed_before_corruption": early,
        "rows_corrupted": (res.get("nc_hits") or {}).get(mode),
    }


def compare(a: List[List[int]], b: List[List[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    diffs = [first_diff(x, y) for x, y in zip(a, b) if x != y]
    return {
        "identical": same,
        "total": len(a),
        "first_diff": diffs[:8],
        # The first output token comes from the prefill, which the offload
        # does not read: a difference there is the prefill batch's rounding.
        "at_first_token": diffs.count(0),
    }


def summarize(result: dict, model: str) -> dict:
    """Offload vs no offload, case by case. Strict (counted in ``identical``
    / ``total``): the batch-1 phases, ``seq`` and ``abort``, and ``retract``
    (a bf16 server's retracting batches vs batch-1 outputs). Reported only:
    ``concurrent``, whose batch composition follows timing and changes GEMM
    and MoE rounding (``concurrent_vs_own_seq`` shows by how much), and the
    stock server's agreement. ``deterministic_prompts``: the prompts on which
    the no-offload server gave the same output twice (``seq_again``), where a
    difference cannot be sglang's own run-to-run noise."""
    srv = result["servers"]
    specs = result["specs"]
    self_agreement = {
        n: compare(r["seq_again"], r["seq"]) for n, r in srv.items() if "seq_again" in r
    }
    cases, identical, total, comparisons = [], 0, 0, {}
    # Servers cut before their seq phase ended: the prefix that ran.
    partial = {}
    for name, res in srv.items():
        base = srv.get(specs[name].get("base", ""), {})
        if "seq_partial" in res and "seq" not in res and "seq" in base:
            partial[name] = compare(res["seq_partial"], base["seq"])
            if "seq_accept_partial" in res and "seq_accept" in base:
                partial[name]["accept"] = compare_accept(
                    res["seq_accept_partial"], base["seq_accept"]
                )
    on_det = {"identical": 0, "total": 0}
    for name, res in srv.items():
        spec = specs[name]
        base = srv.get(spec.get("base", ""), {})
        if not spec.get("base") or "seq" not in base or "seq" not in res:
            continue
        rows = {"seq": compare(res["seq"], base["seq"])}
        if "abort_again" in res:
            k = len(res["abort_again"])
            rows["abort"] = compare(res["abort_again"], base["seq"][:k])
            rows["abort"]["partial_prefixes"] = sum(
                p == s[: len(p)] for p, s in zip(res["abort_partial"], base["seq"])
            )
        if "concurrent" in res and "concurrent" in base:
            rows["concurrent"] = compare(res["concurrent"], base["concurrent"])
        # Runs recorded before specs named their control: today's spec's.
        control_name = spec.get("control") or SERVERS.get(name, {}).get("control")
        control = srv.get(control_name or "", {})
        if control_name and "concurrent" in res:
            # The concurrent batches (retracting ones, or ones whose units
            # move) vs the batch-1 outputs, beside the control's batches
            # compared the same way (None: not run, the case is reported only).
            batched = compare(res["concurrent"], base["seq"])
            batched["retracted_reqs"] = res.get("retracted_reqs", {}).get("concurrent")
            batched["units_moved"] = (result.get("logs", {}).get(name) or {}).get(
                "units_moved"
            )
            batched["control"] = None
            if "concurrent" in control:
                batched["control"] = compare(control["concurrent"], base["seq"])
                batched["control"]["retracted_reqs"] = control.get(
                    "retracted_reqs", {}
                ).get("concurrent")
            c = batched["control"]
            strict = c is not None and c["identical"] == c["total"]
            phase = spec.get("batch_phase") or SERVERS.get(name, {}).get(
                "batch_phase", "retract"
            )
            rows[phase if strict else f"{phase}_reported"] = batched
        if "seq_accept" in res and "seq_accept" in base:
            rows["accept"] = compare_accept(res["seq_accept"], base["seq_accept"])
        if "seq_again" in base:
            det = [
                i
                for i, (a, b) in enumerate(zip(base["seq"], base["seq_again"]))
                if a == b
            ]
            same = sum(res["seq"][i] == base["seq"][i] for i in det)
            rows["seq_on_deterministic_prompts"] = {
                "identical": same,
                "total": len(det),
            }
            if not spec.get("stock"):
                on_det["identical"] += same
                on_det["total"] += len(det)
        comparisons[name] = rows
        if spec.get("stock"):
            continue  # sglang's defaults: reported agreement, not an offload case
        for phase in STRICT_PHASES:
            if phase in rows:
                cases.append(f"{model}:{name}:{phase}")
                identical += rows[phase]["identical"]
                total += rows[phase]["total"]
    nc = {
        n: {
            m: negative_control(r, result["nc_lens"], m)
            for m in NC_MODES
            if f"nc_armed_{m}" in r
        }
        for n, r in srv.items()
        if "nc_clean" in r
    }
    own = {
        n: compare(r["concurrent"], r["seq"])
        for n, r in srv.items()
        if "concurrent" in r and "seq" in r
    }
    base_nc = nc.get("base_fp8", {})
    summary = {
        "weights": "checkpoint",
        "model": model,
        "checkpoint": result.get("ckpt_meta"),
        "sweep": result.get("sweep"),
        "negative_control_flip_fraction": base_nc.get("step", {}).get("flip_fraction"),
        "negative_control_flip_fraction_persistent": base_nc.get("persistent", {}).get(
            "flip_fraction"
        ),
        "negative_control": nc,
        "negative_control_layer": result.get("nc_layer", 0),
        "identical": identical,
        "total": total,
        "identical_on_deterministic_prompts": on_det,
        "self_agreement": self_agreement,
        "cases": cases,
        "comparisons": comparisons,
        "concurrent_vs_own_seq": own,
        "seq_partial": partial,
        "retracted_reqs_by_phase": {
            n: r["retracted_reqs"] for n, r in srv.items() if "retracted_reqs" in r
        },
        "metrics": {n: r["metrics"] for n, r in srv.items() if "metrics" in r},
        "logs": result.get("logs", {}),
        "prompt_lens": result["prompt_lens"],
        "code_commit": result["code_commit"],
        "sglang_version": result.get("sglang_version"),
    }
    if result.get("merged_from"):
        summary["merged_from"] = result["merged_from"]
    mtp = mtp_summary(summary, specs)
    if mtp:
        summary["mtp"] = mtp
    multigpu = multigpu_summary(summary, specs)
    if multigpu:
        summary["multigpu"] = multigpu
    return summary


def multigpu_summary(summary: dict, specs: dict) -> Optional[dict]:
    """The two-GPU servers' part (results/multigpu/summary.json's keys): each
    shape's batch-1 cases, and the node's host bytes per request against one
    GPU's, from the pools the offload servers' processes logged: a request's
    KV lives in tp / (ranks per pool) pools under attention TP, in one under
    DP attention (each rank holds its own requests)."""
    logs = summary["logs"]
    single = (logs.get("ours_fp8") or {}).get("host_pool_bytes_per_token")
    out, ratios = {"total": None}, {}
    for name, rows in summary["comparisons"].items():
        shape = specs[name].get("shape")
        if not shape or specs[name].get("offload") is None:
            continue
        phases = [rows[p] for p in ("seq", "abort") if p in rows]
        out[f"{shape}_identical"] = sum(p["identical"] for p in phases)
        out["total"] = sum(p["total"] for p in phases)
        log = logs.get(name) or {}
        pools, per_pool = log.get("host_pool_bytes_per_token"), log.get(
            "host_pool_ranks"
        )
        if pools and per_pool:
            copies = len(pools) // per_pool if shape == "tp2" else 1
            ref = single[0] if single else pools[0]
            ratios[shape] = round(copies * pools[0] / ref, 3)
    if len(out) == 1:
        return None
    out["host_bytes_per_request_ratio"] = max(ratios.values()) if ratios else None
    out["host_bytes_per_request_ratio_by_shape"] = ratios
    out["code_commit"] = summary["code_commit"]
    return out


def mtp_summary(summary: dict, specs: dict) -> Optional[dict]:
    """The MTP servers' part (results/mtp/summary.json's exactness keys):
    their batch-1 cases, and whether every request's accept counts match the
    no-offload MTP server's."""
    names = [n for n, rows in summary["comparisons"].items() if specs[n].get("mtp")]
    if not names:
        return None
    rows = {n: summary["comparisons"][n] for n in names}
    phases = [r[p] for r in rows.values() for p in ("seq", "abort") if p in r]
    accept = {n: r.get("accept") for n, r in rows.items()}
    return {
        "identical": sum(p["identical"] for p in phases),
        "total": sum(p["total"] for p in phases),
        "accept_length_equal": all(
            a is not None and a["total"] and a["identical"] == a["total"]
            for a in accept.values()
        ),
        "num_steps": sorted({specs[n]["mtp"] for n in names}),
        "negative_control": {
            n: modes
            for n, modes in summary["negative_control"].items()
            if specs[n].get("mtp")
        },
        "accept": accept,
        "code_commit": summary["code_commit"],
        "sglang_version": summary.get("sglang_version"),
    }


def summary_markdown(summary: dict) -> str:
    def frac(c):
        return f"{c['identical']}/{c['total']}" if c else "-"

    nc = summary["negative_control"]
    lines = [
        f"# Exactness on the `{summary['model']}` checkpoint",
        "",
        f"Code `{summary['code_commit'][:10]}`; weights: {summary['checkpoint']}.",
        "",
    ]
    for call in summary.get("merged_from", []):
        lines.append(
            f"- `{call['file']}` (code `{call['code_commit'][:10]}`) ran "
            + ", ".join(call["ran"])
        )
    lines += [
        "",
        "| server | seq (batch 1) | seq, prompts the no-offload server repeats | "
        "abort | concurrent (reported) | concurrent vs own seq |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    own = summary["concurrent_vs_own_seq"]
    for name, rows in summary["comparisons"].items():
        lines.append(
            f"| {name} | {frac(rows['seq'])} | "
            f"{frac(rows.get('seq_on_deterministic_prompts'))} | "
            f"{frac(rows.get('abort'))} | {frac(rows.get('concurrent'))} | "
            f"{frac(own.get(name))} |"
        )
    lines += [
        "",
        "| negative control | mode | flipped within 64 tokens | only later | "
        "changed before it | rows |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, modes in nc.items():
        for mode, r in modes.items():
            lines.append(
                f"| {name} | {mode} | {r['flipped']}/{r['requests']} | "
                f"{r.get('flipped_later', '-')} | "
                f"{r['changed_before_corruption']} | {r['rows_corrupted']} |"
            )

    def batched_phase(phase: str, title: str, detail) -> List[str]:
        """The concurrent batches of ``phase``'s servers vs batch-1 outputs,
        strict where their control's batches agree (``detail``: one server's
        figures)."""
        rows = {
            (n, p): r[p]
            for n, r in summary["comparisons"].items()
            for p in (phase, f"{phase}_reported")
            if p in r
        }
        out = ["", title] if rows else []
        for (n, p), r in rows.items():
            out.append(
                f"- {n}: {detail(r, r['control'])}: "
                + ("strict" if p == phase else "reported, not counted")
            )
        return out

    lines += batched_phase(
        "retract",
        "Forced retraction (bf16: retracting batches vs batch-1 outputs; strict "
        "where sglang's own retraction, the control, is identical):",
        lambda r, c: f"{frac(r)} identical ({r['at_first_token']} differ at the "
        f"first token), {r['retracted_reqs']} requests retracted; "
        + (
            f"control {frac(c)} ({c['at_first_token']} at the first token), "
            f"{c['retracted_reqs']} retracted"
            if c
            else "control not run"
        ),
    )
    lines += batched_phase(
        "level",
        "Unit leveling (bf16: concurrent batches whose region units move vs "
        "batch-1 outputs; strict where the no-offload server's own concurrent "
        "batches, the control, are identical):",
        lambda r, c: f"{frac(r)} identical, {r['units_moved']} units moved; "
        + (f"control {frac(c)}" if c else "control not run"),
    )
    if summary.get("seq_partial"):
        lines += ["", "Cut before their seq phase ended (reported, not counted):"]
        for n, c in summary["seq_partial"].items():
            accept = f", accept counts {frac(c['accept'])}" if "accept" in c else ""
            lines.append(f"- {n}: the first {c['total']} requests {frac(c)}{accept}")
    mtp = summary.get("mtp")
    if mtp:
        lines += [
            "",
            f"MTP (steps {mtp['num_steps']}): outputs {frac(mtp)}, accept counts "
            f"equal on every request: {mtp['accept_length_equal']}",
        ]
        for name, a in mtp["accept"].items():
            lines.append(
                f"- {name}: accept counts {frac(a)}, mean accept length "
                f"{a['mean_accept_length'] if a else '-'}"
            )
    lines += ["", "Self-agreement (the same requests twice, batch 1):"]
    for name, c in summary["self_agreement"].items():
        lines.append(f"- {name}: {frac(c)}, first differing tokens {c['first_diff']}")
    return "\n".join(lines) + "\n"


def write_summary(result: dict, model: str, out: str) -> dict:
    summary = summarize(result, model)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary_markdown(summary))
    return summary


def server_names(text: str) -> List[str]:
    """``--servers``: names in order, once each; "mtp", "mtp_v2" and
    "multigpu" stand for their groups, alone or in a list."""
    groups = {
        "mtp": MTP_SERVERS,
        "mtp_v2": MTP_V2_SERVERS,
        "multigpu": MULTIGPU_SERVERS,
    }
    names: List[str] = []
    for n in text.split(","):
        for name in groups.get(n, n).split(","):
            if name and name not in names:
                names.append(name)
    return names


def parse_sweep(text: str) -> List[tuple]:
    """``qk:out[:attn_out[:layer]],...`` -> (qk, out, attn_out, layer) tuples,
    missing fields at 1.0 and layer 0."""
    out = []
    for entry in filter(None, text.split(",")):
        fields = entry.split(":")
        if not 2 <= len(fields) <= 4:
            raise SystemExit(f"--sweep: {entry!r} is not qk:out[:attn_out[:layer]]")
        q, o, a, layer = (fields + ["1", "0"][len(fields) - 2 :])[:4]
        out.append((float(q), float(o), float(a), int(layer)))
    return out


def merge_runs(paths: List[str]) -> dict:
    """One result from several calls' exactness.json (the same prompts and
    weights, e.g. one rank server per device call): a server's keys from a
    later --nc-only file update the earlier ones' (it adds the control to
    the outputs kept from before), a server run again replaces its earlier
    record. Records which call ran what, at which code."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append((path, json.load(f)))
    merged = {**runs[0][1], "servers": {}, "specs": {}, "logs": {}}
    merged.pop("resumed", None)
    weights = ("seed", "qk_gain", "out_gain", "attn_out_gain", "num_tensors")
    merged["merged_from"] = []
    for path, run in runs:
        if (run["prompt_lens"], run["nc_lens"]) != (
            merged["prompt_lens"],
            merged["nc_lens"],
        ):
            raise SystemExit(f"--merge: {path} sent other prompts")
        meta, first = run.get("ckpt_meta") or {}, merged.get("ckpt_meta") or {}
        if any(meta.get(k) != first.get(k) for k in weights):
            raise SystemExit(f"--merge: {path} had other weights: {meta}")
        kept = set((run.get("resumed") or {}).get("servers", []))
        ran = sorted(n for n in run["servers"] if n not in kept)
        if run.get("resumed") and run["config"].get("nc_only"):
            ran = [
                f"{n} (negative control)" for n in run["config"]["servers"].split(",")
            ]
        for name, res in run["servers"].items():
            if name in ran:
                # Run again: nothing of its earlier run stays (a case the new
                # run did not reach must not show the old code's outputs).
                merged["servers"][name] = dict(res)
            else:
                merged["servers"].setdefault(name, {}).update(res)
        merged["specs"].update(run["specs"])
        merged["logs"].update(run["logs"])
        if run.get("merged_from") and not run.get("resumed"):
            # An earlier merge: keep which call ran what.
            merged["merged_from"].extend(run["merged_from"])
        else:
            merged["merged_from"].append(
                {
                    "file": os.path.basename(path),
                    "code_commit": run["code_commit"],
                    "ran": ran,
                }
            )
    merged["code_commit"] = runs[-1][1]["code_commit"]
    merged["sglang_version"] = runs[-1][1].get("sglang_version")
    return merged


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results directory")
    p.add_argument(
        "--report",
        action="store_true",
        help="only rewrite summary.json/.md from --out's exactness.json",
    )
    p.add_argument(
        "--code-commit",
        help="the commit the run used (default: git's HEAD, which a device's "
        "stale copy of .git can misname)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="EXACTNESS_JSON",
        help="with --report: first write --out's exactness.json from these runs "
        "(the same prompts; later ones add or replace servers)",
    )
    p.add_argument("--model", default="tiny", choices=["tiny", "rank"], help="config")
    p.add_argument("--ckpt", help="checkpoint dir prefix (written there if absent)")
    p.add_argument(
        "--sweep",
        default="",
        help="qk:out[:attn_out[:layer]] gains (and the corrupted layer, default "
        "0) to try the negative control on first, e.g. 1:1,1:1:32,1:1:1:2",
    )
    p.add_argument("--flip-target", type=float, default=0.9, help="for --sweep")
    p.add_argument(
        "--sweep-requests",
        type=int,
        default=32,
        help="control requests per sweep server",
    )
    p.add_argument(
        "--servers",
        help="comma list of server names (default by model); in it 'mtp' stands "
        f"for the MTP servers ({MTP_SERVERS}), 'mtp_v2' for the spec v2 MTP ones "
        f"({MTP_V2_SERVERS}), 'multigpu' for the two-GPU ones ({MULTIGPU_SERVERS})",
    )
    p.add_argument("--seed", type=int, default=0, help="weights' and prompts' seed")
    p.add_argument(
        "--skip-repeat",
        action="store_true",
        help="no second seq pass on the no-offload server (its self-agreement)",
    )
    p.add_argument(
        "--qk-gain",
        type=float,
        default=RECORD_QK_GAIN,
        help=f"make_checkpoint --qk-gain ({RECORD_QK_GAIN:g})",
    )
    p.add_argument(
        "--out-gain",
        type=float,
        default=RECORD_OUT_GAIN,
        help=f"make_checkpoint --out-gain ({RECORD_OUT_GAIN:g})",
    )
    p.add_argument(
        "--attn-out-gain",
        type=float,
        default=1.0,
        help="make_checkpoint --attn-out-gain",
    )
    p.add_argument("--num-requests", type=int, default=64, help="seq requests")
    p.add_argument(
        "--nc-requests", type=int, default=64, help="negative control requests"
    )
    p.add_argument("--max-new-tokens", type=int, default=65, help="per request")
    p.add_argument(
        "--concurrency", type=int, default=8, help="concurrent phase, max running"
    )
    p.add_argument(
        "--skip-concurrent",
        action="store_true",
        help="no concurrent phase (reported only; saves ~90 s per rank server)",
    )
    p.add_argument("--abort-requests", type=int, default=6, help="aborted streams")
    p.add_argument("--longest", type=int, default=33000, help="longest prompt")
    p.add_argument("--context-length", type=int, default=40000, help="server context")
    p.add_argument("--max-total-tokens", type=int, default=300000, help="token locs")
    p.add_argument("--mem-fraction-static", type=float, default=0.5, help="per server")
    p.add_argument("--host-pool-gb", type=float, default=4.0, help="offload host pool")
    p.add_argument("--retract-interval", type=int, default=25, help="forced retraction")
    p.add_argument(
        "--idle-wait", type=float, default=6.0, help="idle seconds at the end"
    )
    p.add_argument("--parallel", type=int, default=11, help="tiny servers at once")
    p.add_argument(
        "--nc-modes", default="step,persistent", help="negative control modes to run"
    )
    p.add_argument(
        "--nc-layer",
        type=int,
        default=0,
        help="layer the negative control corrupts (a --sweep picks its own)",
    )
    p.add_argument(
        "--resume-from",
        help="an earlier run's exactness.json: keep its servers' outputs (same "
        "prompts) and run only --servers, e.g. one rank server per device call",
    )
    p.add_argument(
        "--nc-only",
        action="store_true",
        help="with --resume-from: run only the negative control on --servers "
        "(servers with one, e.g. base_fp8), keeping their earlier outputs",
    )
    p.add_argument("--port", type=int, default=32000, help="first server's port")
    p.add_argument("--timeout", type=float, default=900.0, help="server start timeout")
    args = p.parse_args(argv)
    if args.merge and not args.report:
        p.error("--merge needs --report")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        # Recompute summary.json / summary.md from a run's exactness.json.
        if args.merge:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "exactness.json"), "w") as f:
                json.dump(merge_runs(args.merge), f)
        with open(os.path.join(args.out, "exactness.json")) as f:
            result = json.load(f)
        if args.code_commit:
            result["code_commit"] = args.code_commit
        if "specs" not in result:  # runs before the specs were saved
            result["specs"] = {n: SERVERS[n] for n in result["servers"]}
        print(summary_markdown(write_summary(result, args.model, args.out)))
        return 0
    os.makedirs(args.out, exist_ok=True)
    config = load_config(args.model)

    def checkpoint(qk: float, out: float, attn: float) -> str:
        path = f"{args.ckpt or '/tmp/ckpt'}_{args.model}_s{args.seed}_q{qk:g}_o{out:g}_a{attn:g}"
        if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
            device = "cuda" if args.model == "rank" else "cpu"
            meta = write_checkpoint(
                config, path, args.seed, qk, out, device, attn_out_gain=attn
            )
            print(f"[exactness] checkpoint {path}: {json.dumps(meta)}", flush=True)
        return path

    if args.servers is None:
        args.servers = TINY_SERVERS if args.model == "tiny" else RANK_SERVERS
    names = server_names(args.servers)  # "--servers=": the sweep only
    unknown = [n for n in names if n not in SERVERS]
    if unknown:
        raise SystemExit(f"--servers: unknown {unknown}; known: {', '.join(SERVERS)}")
    if args.nc_only:
        without = [n for n in names if not SERVERS[n].get("nc")]
        if not args.resume_from or without:
            raise SystemExit(
                "--nc-only needs --resume-from and servers with a negative "
                f"control (not {without})"
            )
    lengths = case_lengths(4096, 64, args.longest, args.max_new_tokens)
    rng = random.Random(args.seed + 1)
    while len(lengths) < args.num_requests:
        lengths.append(rng.randrange(100, 12000))
    prompts = random_prompts(lengths, args.seed + 2, config["vocab_size"])
    nc_lens = [rng.randrange(100, 12000) for _ in range(args.nc_requests)]
    nc_prompts = random_prompts(nc_lens, args.seed + 3, config["vocab_size"])
    result = {
        "config": vars(args),
        "nc_layer": args.nc_layer,
        "prompt_lens": lengths,
        "nc_lens": nc_lens,
        "code_commit": args.code_commit or git_commit(),
        "sglang_version": sglang_version(),
        "servers": {},
        "specs": {},
        "logs": {},
    }
    if args.resume_from:
        # Servers run by an earlier call (same prompts: same seed and flags);
        # the servers named again are run anew.
        with open(args.resume_from) as f:
            earlier = json.load(f)
        if earlier["prompt_lens"] != lengths or earlier["nc_lens"] != nc_lens:
            raise SystemExit("--resume-from: that run sent other prompts")
        for key in ("servers", "specs", "logs"):
            # --nc-only adds the control to the named servers' earlier results.
            keep = args.nc_only and key == "servers"
            result[key].update(
                {n: v for n, v in earlier[key].items() if keep or n not in names}
            )
        missing = [
            n
            for n in names
            if args.nc_only and "seq" not in result["servers"].get(n, {})
        ]
        if missing:
            raise SystemExit(f"--nc-only: {missing} have no earlier outputs to keep")
        result["resumed"] = {
            "from": args.resume_from,
            "code_commit": earlier["code_commit"],
            "servers": sorted(
                n for n in earlier["servers"] if args.nc_only or n not in names
            ),
        }
        result["ckpt_meta"] = earlier.get("ckpt_meta")
    lock = threading.Lock()

    def save():
        # Servers run in threads that add keys to their own results without
        # the lock: a dump that meets one mid-iteration is tried again.
        with lock:
            for attempt in range(50):
                try:
                    text = json.dumps(result)
                    break
                except RuntimeError:
                    if attempt == 49:
                        raise
                    time.sleep(0.02)
            with open(os.path.join(args.out, "exactness.json"), "w") as f:
                f.write(text)

    def run_stage(plan):
        """plan: (name, spec, checkpoint dir) of servers to run."""
        servers = []
        for i, (name, spec, ckpt) in enumerate(plan):
            extra, env = server_args(spec, args, ckpt)
            if spec.get("nc"):
                env["SGLANG_NSA_TOPK_CORRUPT"] = os.path.join(args.out, f"arm_{name}")
            port = args.port + 10 * (i + len(result["specs"]))
            servers.append(
                (
                    name,
                    spec,
                    ExactServer(name, extra, port, args.out, env, args.timeout),
                )
            )
            result["specs"][name] = spec

        def run_one(item):
            name, spec, srv = item
            res = result["servers"].setdefault(name, {})
            try:
                srv.wait_ready()
                run_phases(srv, spec, args, prompts, nc_prompts, res, save)
            except Exception as e:  # keep the other servers' results
                res["error"] = f"{type(e).__name__}: {e}"[:2000]
                print(f"[{name}] FAILED: {res['error']}", flush=True)
            finally:
                srv.stop()
                result["logs"][name] = scan_log(srv.log_path)
                save()

        # Tiny servers all start at once; rank servers each take a third of
        # the GPU's memory in weights, and sglang sizes a pool from the
        # memory free at its own start: the next one starts once the
        # previous is up.
        if args.model == "tiny":
            # --parallel at a time: each server's processes take host memory.
            for i in range(0, len(servers), args.parallel):
                group = servers[i : i + args.parallel]
                for _, _, srv in group:
                    srv.start()
                with ThreadPoolExecutor(len(group)) as pool:
                    list(pool.map(run_one, group))
        else:
            threads = []
            for item in servers:
                item[2].start().wait_ready()
                th = threading.Thread(target=run_one, args=(item,))
                th.start()
                threads.append(th)
            for th in threads:
                th.join()

    gains = parse_sweep(args.sweep)
    qk, out, attn = args.qk_gain, args.out_gain, args.attn_out_gain
    if gains:
        # The negative control alone on each candidate checkpoint (and
        # corrupted layer); the run takes the first (in the given order)
        # whose control flips enough.
        plan = [
            (
                f"nc_q{q:g}_o{o:g}_a{a:g}_l{layer}",
                dict(nc=True, nc_only=True, env={ENV_CORRUPT_LAYER: str(layer)}),
                checkpoint(q, o, a),
            )
            for q, o, a, layer in gains
        ]
        all_nc = nc_prompts
        nc_prompts = nc_prompts[: args.sweep_requests]
        run_stage(plan)
        nc_prompts = all_nc
        sweep = []
        for (q, o, a, layer), (name, _, _) in zip(gains, plan):
            res = result["servers"][name]
            frac = (
                negative_control(res, nc_lens, "step")["flip_fraction"]
                if "nc_armed_step" in res
                else None
            )
            sweep.append(
                {
                    "qk_gain": q,
                    "out_gain": o,
                    "attn_out_gain": a,
                    "layer": layer,
                    "flip_fraction": frac,
                }
            )
        result["sweep"] = sweep
        print(f"[exactness] sweep: {json.dumps(sweep)}", flush=True)
        good = [g for g in sweep if (g["flip_fraction"] or 0) >= args.flip_target]
        best = good[0] if good else max(sweep, key=lambda g: g["flip_fraction"] or 0)
        qk, out, attn = best["qk_gain"], best["out_gain"], best["attn_out_gain"]
        args.nc_layer = result["nc_layer"] = best["layer"]
    if names:
        ckpt = checkpoint(qk, out, attn)
        with open(os.path.join(ckpt, "checkpoint_meta.json")) as f:
            meta = json.load(f)
        earlier = result.get("ckpt_meta") or {}
        weights = ("seed", "qk_gain", "out_gain", "attn_out_gain", "num_tensors")
        if earlier and any(earlier.get(k) != meta.get(k) for k in weights):
            raise SystemExit(f"--resume-from: that run had other weights: {earlier}")
        result["ckpt_meta"] = meta
        only = {"nc_only": True} if args.nc_only else {}
        run_stage([(n, {**SERVERS[n], **only}, ckpt) for n in names])
    save()
    summary = write_summary(result, args.model, args.out)
    print(
        json.dumps(
            {
                k: summary[k]
                for k in ("negative_control_flip_fraction", "identical", "total")
            }
        ),
        flush=True,
    )
    print(json.dumps(summary["negative_control"]), flush=True)
    for name, rows in summary["comparisons"].items():
        print(
            name, json.dumps({k: (v["identical"], v["total"]) for k, v in rows.items()})
        )
    print(json.dumps(summary["logs"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
