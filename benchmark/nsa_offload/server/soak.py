"""GPU soak of --enable-decode-nsa-kv-offload on the tiny attention-dependent
checkpoint (issue 21, item 4), or on the rank model (``--model rank``: 61
layers, dummy weights; the verify mode is its oracle).

One offload server (CUDA graphs and the overlap scheduler on, fp8 KV,
``--enable-metrics``) on the ``tiny`` checkpoint of ``make_checkpoint.py``
(written like ``exactness.py`` does, the gains of record by default), with the
deterministic top-k of ``exactness.py`` (``sorted_topk/``,
``SGLANG_DSA_FUSE_TOPK=0``, a fixed cuBLAS workspace), then:

1. a fixed probe set (lengths 1 to 32K), one request at a time once the
   server is idle, greedy, ``--probe-tokens`` tokens;
2. the soak: ``--num-requests`` requests from a seeded RNG, ``--concurrency``
   clients at a time; prompt lengths log-uniform in [``--min-len``,
   ``--max-len``] (skewed short: the median of 1..32K is ~180 tokens, the
   mean ~3.1K, 1 in 15 is over 16K), ``max_new_tokens`` uniform in
   [``--min-new-tokens``, ``--max-new-tokens``]; ``--abort-fraction`` of them
   streamed and closed by the client at a random point (a share
   ``--abort-before-output`` right after the response headers, while queued
   or in prefill; the others after a random number of output chunks, in
   decode); progress every ``--progress-interval`` seconds;
3. the same probes again once the server is idle (``probe_identical``: every
   output equal to its first run), then the server idles ``--idle-wait``
   seconds (sglang's idle check runs, the offload's leak check with it), its
   ``/metrics`` are scraped and it must still be alive and answer.

Pressure. The host pool holds one row per token loc (host slot = token loc),
so its size and sglang's token budget are one number: the server allocates
``min(--max-total-tokens, what --nsa-kv-offload-host-pool-gb holds)`` locs,
and ``--host-pool-gb`` defaults to just what ``--max-total-tokens`` needs,
unless the GPU budget holds fewer: in verify mode each loc also keeps the
full KV row of every layer (on the rank model 12 GiB held 69,440 locs).
A tight budget (default 96K locs against ``--concurrency`` 64 clients whose
requests average ~3.3K tokens) keeps the pool full: admission refuses new
requests (they wait in sglang's queue) and decode runs out of pages, which
makes sglang retract (``update_running_batch``: ``check_decode_mem`` fails,
``retract_decode`` frees the requests with the fewest outputs and logs
``KV cache pool is full. Retract requests. #retracted_reqs: N, ...``). The
soak's requests do not set ``ignore_eos`` (``--ignore-eos`` sets it): with
``ignore_eos`` and the radix cache off, sglang's admission
(``add_one_req_ignore_eos``) reserves every request's whole remaining output
and decode never runs out; without it, running requests reserve only
``new_token_ratio`` (0.7 decaying to ~0.1) of theirs, so a full pool
over-commits and decode retracts.

``waited_on_host_pool``: no product counter says that admission refused a
request because the host pool was full (the offload admits after sglang's
``PrefillAdder``, whose ``NO_TOKEN`` is neither logged nor counted per
request). It is counted from what is observable: ``/get_load`` is sampled
every ``--sample-interval`` seconds; a sample is *pool-bound* when requests
wait and what they hold (``num_total_tokens - num_used_tokens``, sglang's
waiting-queue tokens) exceeds the free locs (``max_total_num_tokens -
num_used_tokens``). A request waited on the host pool when its first wait
in sglang's queue (``meta_info``'s ``queue_time`` and
``forward_entry_time`` with ``--enable-metrics``; for a stream closed
before any output, the client's send-to-close interval) contains a
pool-bound sample. The count is a lower bound (waits shorter than the
sampling interval are missed). The fill of the pool itself is in the
offload's gauge ``sglang:nsa_kv_offload_host_pool_used_tokens``, scraped
every ``--metrics-interval`` seconds.

Leaks: sglang's idle check (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``,
on by default) and the offload's (``check_idle``: decode regions, lent
units, staging rows) report through ``_report_leak``: ``<pool> memory leak
detected! ...``, an exception that ends the scheduler in strict mode;
``leaks`` counts those log lines. ``crashed``: the server process died, a
request failed with a server error (5xx, a server-side abort, a connection
error or timeout; client aborts are not failures) or the server did not
answer at the end.

Writes ``soak.json`` (config, per-request records, load samples, probes),
``summary.json`` (the churn soak's keys first, ``SUMMARY_KEYS``: units
moved / reclaimed / kept, rows verified, mismatches, leaks, failures; then
extras; ``--report --mtp-from`` / ``--rank-from`` add the MTP run's and
the rank model's run's keys under ``mtp`` / ``rank``),
``summary.md`` and the server log (gzipped). Exit status 0 only if every
criterion holds (``build_summary``).

    python benchmark/nsa_offload/server/soak.py --out /tmp/soak
    python benchmark/nsa_offload/server/soak.py --quick --out /tmp/soak_quick
    python benchmark/nsa_offload/server/soak.py --report --out /tmp/soak
    python benchmark/nsa_offload/server/soak.py --report --out /tmp/soak \
        --mtp-from /tmp/soak_mtp --rank-from /tmp/soak_rank
"""

import argparse
import bisect
import gzip
import http.client
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from capacity import ROW_BYTES_FP8
from exactness import ExactServer, open_log, scan_log, scrape_offload_metrics
from exactness import server_args as exactness_server_args
from make_checkpoint import (
    RECORD_OUT_GAIN,
    RECORD_QK_GAIN,
    load_config,
    write_checkpoint,
)
from server_utils import git_commit, random_prompts, sglang_version, use_model

# summary.json: the keys of the churn soak (issue 65), in its order, before
# the extras.
SUMMARY_KEYS = (
    "settings",
    "requests",
    "aborted",
    "retracted",
    "units_moved",
    "units_reclaimed",
    "units_kept",
    "idle_loc_units_lent",
    "verify_checked_rows",
    "verify_mismatches",
    "leaks",
    "failed",
    "code_commit",
)
# The offload's counters behind them (summed over the run, /metrics).
COUNTER_KEYS = {
    "units_moved": "sglang:nsa_kv_offload_units_moved_total",
    "units_reclaimed": "sglang:nsa_kv_offload_units_reclaimed_total",
    "units_kept": "sglang:nsa_kv_offload_units_kept_total",
    "verify_checked_rows": "sglang:nsa_kv_offload_verify_checked_rows_total",
    "verify_mismatches": "sglang:nsa_kv_offload_verify_mismatches_total",
}
IDLE_LOC_GAUGE = "sglang:nsa_kv_offload_idle_loc_units_used"
EXTRA_UNITS_GAUGE = "sglang:nsa_kv_offload_extra_units_used"
# The churn soak's floor: a run that sent fewer shows too little churn
# (--min-requests; the rank model's 61 layers admit ~1.2 requests/s, 200).
MIN_REQUESTS = 1000
# The end of a run after its soak, beyond the probes' own time (--wall-budget-s):
# in-flight requests (up to ~20 s of queued prefills on the rank model), two
# 10 s idle waits, /metrics, the server's stop.
FINISH_RESERVE_S = 60.0
# The probe set: page, top-k (2048) and GPU buffer (4096 + 64) edges, long ones.
PROBE_LENGTHS = (
    1,
    63,
    64,
    65,
    2047,
    2048,
    2049,
    4095,
    4097,
    4161,
    8192,
    12000,
    16385,
    24000,
    30000,
    32768,
)
# Defaults of the full soak and of --quick (a smoke run of a minute or two).
FULL_DEFAULTS = dict(
    num_requests=5000, concurrency=64, max_len=32768, max_total_tokens=98304
)
QUICK_DEFAULTS = dict(
    num_requests=300, concurrency=32, max_len=8192, max_total_tokens=24576
)
PAGE = 64  # the offload's page size

LEAK_MARK = "memory leak detected"
TRACEBACK_MARK = "Traceback (most recent call last)"
# sglang's own retraction on a full KV pool (not SGLANG_TEST_RETRACT's).
KV_FULL_MARK = "KV cache pool is full. Retract requests."
OOM_ABORT_MARK = "Out of memory even after retracting"
USAGE_RE = re.compile(r"token usage: ([0-9.]+)")
QUEUE_RE = re.compile(r"#queue-req: (\d+)")
HOST_LOCS_RE = re.compile(r"(\d+) (?:logical )?token locs \(host capacity (\d+)\)")
# The offload's decode-log fields the soak reports (the startup line and the
# decode line's "direct: D, warmed: W (...)" and "N of idle locs").
RUNNING_RE = re.compile(r"#running-req: (\d+)")
DIRECT_RE = re.compile(r"direct: (\d+)")
WARMED_RE = re.compile(r"warmed: (\d+)")
IDLE_LOCS_RE = re.compile(r"(\d+) of idle locs")
MAX_TOTAL_RE = re.compile(r"max_total_num_tokens=(\d+)")
# sglang's counters on /metrics, cross-checks of the client's and the log's.
CORE_SERIES = (
    "sglang:num_requests_total",
    "sglang:num_aborted_requests_total",
    "sglang:num_retracted_requests_total",
    "sglang:queue_time_seconds_count",
    "sglang:queue_time_seconds_sum",
)


# ------------------------------------------------------------------ workload


@dataclass(frozen=True)
class SoakRequest:
    index: int
    prompt_len: int
    max_new_tokens: int
    # None: read to the end. k: a stream the client closes after k output
    # chunks (0: right after the response headers).
    abort_after: Optional[int]


def log_uniform_length(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi], log-uniform (as many in 1-10 as in 1K-10K)."""
    x = math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))
    return min(hi, max(lo, int(x)))


def make_workload(
    n: int,
    seed: int,
    min_len: int = 1,
    max_len: int = 32768,
    min_new: int = 1,
    max_new: int = 256,
    abort_fraction: float = 0.1,
    abort_before_output: float = 0.2,
) -> List[SoakRequest]:
    """``n`` requests, the same for the same arguments. Exactly
    ``round(n * abort_fraction)`` are streams the client closes."""
    rng = random.Random(seed)
    aborted = set(rng.sample(range(n), round(n * abort_fraction)))
    out = []
    for i in range(n):
        length = log_uniform_length(rng, min_len, max_len)
        new = rng.randint(min_new, max_new)
        abort_after = None
        if i in aborted:
            # Before any output (queued or in prefill), or in decode before
            # the last token.
            if new == 1 or rng.random() < abort_before_output:
                abort_after = 0
            else:
                abort_after = rng.randint(1, new - 1)
        out.append(SoakRequest(i, length, new, abort_after))
    return out


def request_prompt(req: SoakRequest, seed: int, vocab: int) -> List[int]:
    """The prompt of ``req``, drawn when it is sent (the probes' seeds are
    small, these start above 1e6)."""
    prompt_seed = (seed + 1) * 1_000_003 + req.index
    return random_prompts([req.prompt_len], prompt_seed, vocab)[0]


def probe_lengths(max_len: int) -> List[int]:
    return [n for n in PROBE_LENGTHS if n < max_len] + [max_len]


# ------------------------------------------------------------------- client


class RequestError(Exception):
    def __init__(self, message: str, server_side: bool):
        super().__init__(message)
        self.server_side = server_side


def _post_generate(url: str, payload: dict, timeout: float):
    req = urllib.request.Request(
        url + "/generate",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        body = e.read()[:300].decode(errors="replace")
        raise RequestError(f"HTTP {e.code}: {body}", e.code >= 500) from e


def _take_meta(rec: dict, meta: dict) -> None:
    rec["num_retractions"] = meta.get("num_retractions")
    if "queue_time" in meta and "forward_entry_time" in meta:
        rec["queue_time"] = meta["queue_time"]
        rec["forward_entry"] = meta["forward_entry_time"]


def send_request(
    url: str,
    req: SoakRequest,
    input_ids: List[int],
    ignore_eos: bool,
    timeout: float,
) -> dict:
    """Send one soak request; its record. ``status``: ``ok`` (finished by the
    server, ``closed_early`` if a stream meant to be closed finished first),
    ``aborted`` (closed by the client before it finished) or ``error``
    (``server_error``: a failure on the server's side)."""
    stream = req.abort_after is not None
    payload = {
        "input_ids": input_ids,
        "stream": stream,
        "sampling_params": {
            "max_new_tokens": req.max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": ignore_eos,
        },
    }
    rec = {
        "i": req.index,
        "len": req.prompt_len,
        "new": req.max_new_tokens,
        "abort_after": req.abort_after,
        "t_send": time.time(),
        "chunks": 0,
        "output_len": 0,
        "finish": None,
        "error": None,
        "server_error": False,
    }
    try:
        resp = _post_generate(url, payload, timeout)
        try:
            if stream:
                _read_stream(resp, req.abort_after, rec)
            else:
                out = json.loads(resp.read())
                rec["output_len"] = len(out.get("output_ids", []))
                meta = out.get("meta_info", {})
                _take_meta(rec, meta)
                rec["finish"] = (meta.get("finish_reason") or {}).get("type")
        finally:
            resp.close()
        if rec["finish"] == "abort":
            raise RequestError("aborted by the server", True)
        if rec["finish"] is None and not stream:
            raise RequestError("no finish reason", True)
        if rec["finish"] is None and rec["chunks"] < (req.abort_after or 0):
            raise RequestError("stream ended without a finish reason", True)
        if rec["finish"] is not None:
            rec["status"] = "ok"
            rec["closed_early"] = stream
        else:
            rec["status"] = "aborted"
    except RequestError as e:
        rec.update(status="error", error=str(e)[:300], server_error=e.server_side)
    except (
        OSError,  # connection refused or reset, timeouts (URLError included)
        http.client.HTTPException,
        ValueError,  # a malformed response
    ) as e:
        rec.update(
            status="error", error=f"{type(e).__name__}: {e}"[:300], server_error=True
        )
    rec["t_end"] = time.time()
    return rec


def _read_stream(resp, abort_after: int, rec: dict) -> None:
    """Read output chunks until the server's finish or ``abort_after``
    chunks, whichever comes first (then the caller closes)."""
    if abort_after == 0:
        return
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        out = json.loads(line[5:])
        if "error" in out:
            raise RequestError(f"stream error: {out['error']}", True)
        rec["chunks"] += 1
        rec["output_len"] = len(out.get("output_ids", []))
        meta = out.get("meta_info", {})
        _take_meta(rec, meta)
        finish = meta.get("finish_reason")
        if finish is not None:
            rec["finish"] = finish.get("type")
            return
        if rec["chunks"] >= abort_after:
            return


# max_total_num_tokens per server URL (fixed for a server's life).
_MAX_TOTAL: Dict[str, int] = {}


def fetch_load(url: str) -> Optional[dict]:
    """One rank's load from ``/get_load`` (the legacy shape; sglang's own
    ``/v1/loads`` fails with ``--enable-metrics`` under the GPU host's
    fastapi: the metrics middleware reads ``.path`` of an included router)
    plus ``max_total_num_tokens`` from ``/get_server_info``, read once; None
    if the server did not answer."""
    try:
        if url not in _MAX_TOTAL:
            with urllib.request.urlopen(url + "/get_server_info", timeout=30) as r:
                _MAX_TOTAL[url] = int(json.loads(r.read())["max_total_num_tokens"])
        with urllib.request.urlopen(url + "/get_load", timeout=10) as r:
            load = json.loads(r.read())[0]
        waiting = load["num_waiting_reqs"]
        return {
            "running": load["num_reqs"] - waiting,
            "waiting": waiting,
            "used": load["num_tokens"] - load["num_pending_tokens"],
            "total": load["num_tokens"],
            "max_total": _MAX_TOTAL[url],
        }
    except (OSError, ValueError, KeyError, IndexError, http.client.HTTPException):
        return None


def scrape_series(url: str, names: Sequence[str]) -> Dict[str, float]:
    """These series of ``/metrics`` (summed over labels)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: Dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):
        return False


def pool_bound(sample: dict) -> bool:
    """Requests wait and need more locs than are free (the host pool is full
    for them)."""
    free = sample["max_total"] - sample["used"]
    return sample["waiting"] > 0 and sample["total"] - sample["used"] > free


def wait_interval(rec: dict) -> Optional[Tuple[float, float]]:
    """When ``rec``'s request first waited in sglang's queue (wall clock)."""
    if rec.get("queue_time") is not None:
        return rec["forward_entry"] - rec["queue_time"], rec["forward_entry"]
    if rec.get("status") == "aborted" and rec.get("chunks") == 0:
        return rec["t_send"], rec["t_end"]  # may never have left the queue
    return None


def count_waited_on_host_pool(records: List[dict], samples: List[dict]) -> int:
    """Requests whose wait in the queue contains a pool-bound sample."""
    bound = sorted(s["t"] for s in samples if pool_bound(s))
    n = 0
    for rec in records:
        interval = wait_interval(rec)
        if interval is None:
            continue
        k = bisect.bisect_left(bound, interval[0])
        if k < len(bound) and bound[k] <= interval[1]:
            n += 1
    return n


class SoakRunner:
    """Send the workload ``concurrency`` requests at a time; sample the load
    and the offload's host-pool gauge meanwhile; print progress. Stops
    sending when the server dies or at ``deadline`` (wall clock)."""

    def __init__(
        self,
        url: str,
        workload: List[SoakRequest],
        prompt: Callable[[SoakRequest], List[int]],
        concurrency: int,
        alive: Callable[[], bool],
        ignore_eos: bool = False,
        request_timeout: float = 900.0,
        deadline: Optional[float] = None,
        sample_interval: float = 0.5,
        progress_interval: float = 10.0,
        metrics_interval: float = 5.0,
        log=print,
    ):
        self.url = url
        self.workload = workload
        self.prompt = prompt
        self.concurrency = concurrency
        self.alive = alive
        self.ignore_eos = ignore_eos
        self.request_timeout = request_timeout
        self.deadline = deadline
        self.sample_interval = sample_interval
        self.progress_interval = progress_interval
        self.metrics_interval = metrics_interval
        self.log = log
        self.records: List[Optional[dict]] = [None] * len(workload)
        self.samples: List[dict] = []
        self.host_pool: Dict[str, float] = {}
        self.stopped_by: Optional[str] = None
        self._t0 = time.time()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._counts = {"sent": 0, "ok": 0, "aborted": 0, "error": 0}

    def _one(self, req: SoakRequest) -> None:
        if self._stop.is_set():
            return
        if self.deadline is not None and time.time() > self.deadline:
            self.stopped_by = self.stopped_by or "time budget"
            return
        with self._lock:
            self._counts["sent"] += 1
        rec = send_request(
            self.url, req, self.prompt(req), self.ignore_eos, self.request_timeout
        )
        self.records[req.index] = rec
        with self._lock:
            self._counts[rec["status"]] += 1
        if rec["server_error"] and not self.alive():
            self.stopped_by = "server died"
            self._stop.set()

    def _watch(self, t0: float) -> None:
        next_progress = t0 + self.progress_interval
        next_metrics = t0
        while True:
            now = time.time()
            if not self.alive():
                self.stopped_by = self.stopped_by or "server died"
                self._stop.set()
                return
            load = fetch_load(self.url)
            if load is not None:
                load["t"] = now
                self.samples.append(load)
            if now >= next_metrics:
                next_metrics = now + self.metrics_interval
                self._observe_host_pool()
            if now >= next_progress:
                next_progress = now + self.progress_interval
                self.log(self._progress_line(now - t0, load))
            if self._done.wait(self.sample_interval):
                return

    def _observe_host_pool(self) -> None:
        try:
            m = scrape_offload_metrics(self.url)
        except (OSError, ValueError, http.client.HTTPException):
            return
        for gauge in (IDLE_LOC_GAUGE, EXTRA_UNITS_GAUGE):
            if gauge in m:
                self.host_pool[gauge] = max(self.host_pool.get(gauge, 0), m[gauge])
        used = m.get("sglang:nsa_kv_offload_host_pool_used_tokens")
        if used is not None and used >= self.host_pool.get("max_used_tokens", -1):
            self.host_pool["max_used_tokens"] = used
            self.host_pool["total_tokens"] = m.get(
                "sglang:nsa_kv_offload_host_pool_total_tokens"
            )

    def _progress_line(self, elapsed: float, load: Optional[dict]) -> str:
        c = dict(self._counts)
        finished = c["ok"] + c["aborted"] + c["error"]
        line = (
            f"[soak] {elapsed:.0f} s: {c['sent']}/{len(self.workload)} sent, "
            f"{c['ok']} done, {c['aborted']} aborted, {c['error']} failed "
            f"({finished / max(elapsed, 1e-9):.1f} req/s)"
        )
        if load is not None:
            line += (
                f"; running {load['running']}, waiting {load['waiting']}, "
                f"token usage {load['used'] / max(load['max_total'], 1):.2f}"
            )
        return line

    def run(self) -> dict:
        t0 = self._t0 = time.time()
        watcher = threading.Thread(target=self._watch, args=(t0,), daemon=True)
        watcher.start()
        pool = ThreadPoolExecutor(self.concurrency)
        try:
            list(pool.map(self._one, self.workload))
        finally:
            # Interrupted (SIGTERM): what was not sent is not sent; what is
            # in flight finishes.
            self._stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            self._done.set()
            watcher.join()
        self.log(self._progress_line(time.time() - t0, None))
        return self.outcome()

    def outcome(self) -> dict:
        """What ran so far: after ``run`` returns, and after a SIGTERM cut it
        (the requests that finished keep their records)."""
        return {
            "records": self.records,
            "samples": self.samples,
            "host_pool_seen": self.host_pool,
            "stopped_by": self.stopped_by,
            "soak_s": round(time.time() - self._t0, 1),
        }


# --------------------------------------------------------------- log, summary


def scan_soak_log(path: str) -> dict:
    """``exactness.scan_log`` (retractions, the offload's decode-log
    counters) plus what the soak judges: leak reports, tracebacks, OOM aborts,
    sglang's own retractions, the highest token usage and queue logged, and
    the pool sizes logged at startup."""
    try:
        out = scan_log(path)
    except OSError:
        return {"missing": True, "leaks": 0, "retracted_reqs": 0}
    out.update(
        leaks=0,
        leak_lines=[],
        tracebacks=0,
        traceback_lines=[],
        oom_aborts=0,
        kv_full_retractions=0,
        max_token_usage=None,
        max_queue_reqs=None,
        lines_queued_at_full=0,
        host_locs=None,
        host_capacity_locs=None,
        max_total_num_tokens=None,
        warmed=0,
        lines_direct_beside_walking=0,
        max_idle_loc_units_logged=0,
        lines_idle_loc_units_back=0,
    )
    idle_before = 0
    with open_log(path) as f:
        for line in f:
            running, direct = RUNNING_RE.search(line), DIRECT_RE.search(line)
            if running and direct:
                # Direct requests beside walking ones in one batch.
                d = int(direct.group(1))
                out["lines_direct_beside_walking"] += 0 < d < int(running.group(1))
            m = WARMED_RE.search(line)
            out["warmed"] += int(m.group(1)) if m else 0
            m = IDLE_LOCS_RE.search(line)
            if m:
                idle = int(m.group(1))
                out["max_idle_loc_units_logged"] = max(
                    out["max_idle_loc_units_logged"], idle
                )
                out["lines_idle_loc_units_back"] += idle < idle_before
                idle_before = idle
            if LEAK_MARK in line:
                out["leaks"] += 1
                if len(out["leak_lines"]) < 5:
                    out["leak_lines"].append(line.strip()[:400])
            # exactness.scan_log's one harmless traceback (openai_harmony).
            if TRACEBACK_MARK in line and "OpenAIServingResponses" not in line:
                out["tracebacks"] += 1
                if len(out["traceback_lines"]) < 5:
                    out["traceback_lines"].append(line.strip()[:400])
            out["oom_aborts"] += OOM_ABORT_MARK in line
            out["kv_full_retractions"] += KV_FULL_MARK in line
            usage, queue = USAGE_RE.search(line), QUEUE_RE.search(line)
            if usage and queue:
                u, q = float(usage.group(1)), int(queue.group(1))
                out["max_token_usage"] = max(out["max_token_usage"] or 0.0, u)
                out["max_queue_reqs"] = max(out["max_queue_reqs"] or 0, q)
                out["lines_queued_at_full"] += q > 0 and u >= 0.9
            m = HOST_LOCS_RE.search(line)
            if m:
                out["host_locs"] = int(m.group(1))
                out["host_capacity_locs"] = int(m.group(2))
            m = MAX_TOTAL_RE.search(line)
            if m and out["max_total_num_tokens"] is None:
                out["max_total_num_tokens"] = int(m.group(1))
    return out


def _quantiles(values: List[float]) -> Optional[dict]:
    if not values:
        return None
    values = sorted(values)

    def pick(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return {
        "p50": round(pick(0.5), 3),
        "p90": round(pick(0.9), 3),
        "p99": round(pick(0.99), 3),
        "max": round(values[-1], 3),
        "mean": round(statistics.fmean(values), 3),
    }


def build_summary(result: dict) -> dict:
    """summary.json from a run's result (soak.json): the issue's keys first."""
    sent = [r for r in result.get("records") or [] if r is not None]
    samples = result.get("samples") or []
    log = result.get("log") or {}
    by_status = {s: [r for r in sent if r["status"] == s] for s in ("ok", "aborted")}
    failed = [r for r in sent if r["status"] == "error"]
    server_errors = sum(r["server_error"] for r in failed)
    before, after = result.get("probes_before"), result.get("probes_after")
    probe_identical = bool(
        before
        and after
        and len(before) == len(after)
        and all(a is not None and a == b for a, b in zip(after, before))
    )
    died = bool(result.get("died"))
    # None: the run ended (interrupted) before the check.
    alive = result.get("alive_at_end")
    crashed = died or server_errors > 0 or alive is False
    final = result.get("final_load") or {}
    idle_clean = bool(
        result.get("idle_reached")
        and final
        and final.get("running") == 0
        and final.get("waiting") == 0
        and final.get("used") == 0
        and log.get("leaks", 0) == 0
    )
    waited = count_waited_on_host_pool(sent, samples)
    queue_times = [r["queue_time"] for r in sent if r.get("queue_time") is not None]
    host_seen = result.get("host_pool_seen") or {}
    gauge_total = host_seen.get("total_tokens")
    metrics = result.get("metrics") or {}
    config = result.get("config") or {}
    counters = {k: int(metrics.get(name, 0)) for k, name in COUNTER_KEYS.items()}
    summary = {
        "settings": "default",
        "requests": len(sent),
        "aborted": len(by_status["aborted"]),
        "retracted": log.get("retracted_reqs", 0),
        **{k: counters[k] for k in ("units_moved", "units_reclaimed", "units_kept")},
        # The most idle-loc units lent at once (the gauge, scraped while the
        # soak ran); the gauge is back at 0 at the end when all went back.
        "idle_loc_units_lent": int(host_seen.get(IDLE_LOC_GAUGE, 0)),
        "verify_checked_rows": counters["verify_checked_rows"],
        "verify_mismatches": counters["verify_mismatches"],
        "leaks": log.get("leaks", 0),
        "failed": len(failed),
        "code_commit": result.get("code_commit"),
        "sglang_version": result.get("sglang_version"),
        # extras
        "model": config.get("model", "tiny"),
        "mtp_draft_tokens": config.get("mtp") and config["mtp"] + 1,
        "verify_mode": config.get("verify"),
        "extra_units_lent_peak": int(host_seen.get(EXTRA_UNITS_GAUGE, 0)),
        "idle_loc_units_at_end": int(metrics.get(IDLE_LOC_GAUGE, 0)),
        # From the decode log: warm-ups, direct requests beside walking ones,
        # idle-loc units given back while the soak ran.
        "warmed": log.get("warmed", 0),
        "lines_direct_beside_walking": log.get("lines_direct_beside_walking", 0),
        "max_idle_loc_units_logged": log.get("max_idle_loc_units_logged", 0),
        "lines_idle_loc_units_back": log.get("lines_idle_loc_units_back", 0),
        "waited_on_host_pool": waited,
        "crashed": crashed,
        "probe_identical": probe_identical,
        "wall_s": result.get("wall_s"),
        "completed": len(by_status["ok"]),
        "closed_after_finishing": sum(
            bool(r.get("closed_early")) for r in by_status["ok"]
        ),
        "failed": len(failed),
        "server_errors": server_errors,
        "first_errors": [f"#{r['i']}: {r['error']}" for r in failed[:5]],
        "died": died,
        "alive_at_end": alive,
        "idle_clean": idle_clean,
        "final_load": final,
        "error": result.get("error"),
        "interrupted": bool(result.get("interrupted")),
        "stopped_by": result.get("stopped_by"),
        "soak_s": result.get("soak_s"),
        "prompt_tokens": sum(r["len"] for r in sent),
        "output_tokens": sum(r["output_len"] for r in sent),
        "retraction_events": log.get("retractions", 0),
        "kv_full_retractions": log.get("kv_full_retractions", 0),
        "requests_seen_retracted": sum(
            (r.get("num_retractions") or 0) > 0 for r in sent
        ),
        "oom_aborts": log.get("oom_aborts", 0),
        "tracebacks": log.get("tracebacks", 0),
        "leak_lines": log.get("leak_lines", []),
        "traceback_lines": log.get("traceback_lines", []),
        "load_samples": len(samples),
        "pool_bound_samples": sum(pool_bound(s) for s in samples),
        "max_waiting_reqs": max((s["waiting"] for s in samples), default=None),
        "queue_time_s": _quantiles(queue_times),
        "host_pool": {
            "locs": log.get("host_locs") or (gauge_total and int(gauge_total)),
            "capacity_locs": log.get("host_capacity_locs"),
            "max_used_tokens_seen": host_seen.get("max_used_tokens"),
            "max_fill_seen": (
                round(host_seen["max_used_tokens"] / gauge_total, 4)
                if host_seen.get("max_used_tokens") is not None and gauge_total
                else None
            ),
            "max_token_usage_logged": log.get("max_token_usage"),
            "log_lines_queued_at_90pct": log.get("lines_queued_at_full", 0),
        },
        "probes": len(before or []),
        "probes_differing": [
            i
            for i, (a, b) in enumerate(zip(after or [], before or []))
            if a is None or a != b
        ],
        "metrics": result.get("metrics"),
        "offload_log": {k: log.get(k) for k in ("misses", "min_hit_rate")},
        "config": result.get("config"),
    }
    floor = config.get("min_requests") or MIN_REQUESTS
    criteria = {
        f"requests >= {floor}": summary["requests"] >= floor,
        "client aborts": summary["aborted"] > 0,
        **(
            {"retractions in the log (forced)": summary["retraction_events"] > 0}
            if config.get("retract_interval")
            else {
                "retractions on a full pool in the log": summary["kv_full_retractions"]
                > 0
            }
        ),
        # Every used loc's KV sits in the host pool: sglang's logged token
        # usage (used locs / locs, each decode-log line) is its fill too.
        "host pool full at times (>= 95% seen)": max(
            summary["host_pool"]["max_fill_seen"] or 0,
            summary["host_pool"]["max_token_usage_logged"] or 0,
        )
        >= 0.95,
        "no failed request": not failed,
        "0 leaks": summary["leaks"] == 0,
        "units moved": summary["units_moved"] > 0,
        "units reclaimed": summary["units_reclaimed"] > 0,
        "idle-loc units lent": summary["idle_loc_units_lent"] > 0,
        "idle-loc units taken back": summary["lines_idle_loc_units_back"] > 0,
        "requests warmed": summary["warmed"] > 0,
        # Direct slots need one query token per step (LRUCacheState raises
        # otherwise): with MTP no request runs direct, so no such line.
        **(
            {}
            if config.get("mtp")
            else {
                "direct beside walking requests": summary["lines_direct_beside_walking"]
                > 0
            }
        ),
        "rows verified, 0 mismatches": summary["verify_checked_rows"] > 0
        and summary["verify_mismatches"] == 0,
        "not crashed": not crashed,
        "alive at the end": alive is True,
        "probes identical": probe_identical,
        "idle-clean at the end": idle_clean,
    }
    summary["criteria"] = criteria
    summary["passed"] = all(criteria.values())
    return summary


# Runs whose keys a summary may hold beside its own, and their columns.
SIDE_RUNS = {"mtp": "MTP run", "rank": "rank model run"}


def summary_markdown(s: dict) -> str:
    hp = s["host_pool"]
    qt = s["queue_time_s"] or {}
    lines = [
        f"# GPU soak of the decode NSA KV offload ({s.get('model', 'tiny')} model)",
        "",
        f"Code `{(s['code_commit'] or '?')[:10]}`, sglang "
        f"{s.get('sglang_version') or '?'}; "
        f"{'**passed**' if s['passed'] else '**not passed**'}.",
        "",
    ]
    sides = [(n, s[n]) for n in SIDE_RUNS if isinstance(s.get(n), dict)]
    head = "| key | value |" + "".join(f" {SIDE_RUNS[n]} |" for n, _ in sides)
    lines += [head, "|---" * (2 + len(sides)) + "|"]
    lines += [
        f"| `{k}` | {s[k]} |" + "".join(f" {r.get(k)} |" for _, r in sides)
        for k in SUMMARY_KEYS
    ]
    if sides:
        lines += [
            f"| passed | {s['passed_alone']} |"
            + "".join(f" {r['passed']} |" for _, r in sides)
        ]
    lines += [
        "",
        f"- {s['completed']} completed ({s['closed_after_finishing']} streams "
        f"finished before the client closed them), {s['aborted']} closed by the "
        f"client, {s['failed']} failed ({s['server_errors']} on the server's side)"
        + (f"; first: {s['first_errors']}" if s["first_errors"] else ""),
        f"- soak {s['soak_s']} s of the {s['wall_s']} s run; "
        f"{s['prompt_tokens']:,} prompt and {s['output_tokens']:,} output tokens"
        + (f"; stopped early: {s['stopped_by']}" if s["stopped_by"] else ""),
        f"- retractions: {s['retraction_events']} in the log "
        f"({s['kv_full_retractions']} on a full pool), {s['retracted']} requests; "
        f"{s['requests_seen_retracted']} requests reported retracted in their "
        f"meta_info; OOM aborts {s['oom_aborts']}",
        f"- host pool: {hp['locs']} locs; highest fill seen in the offload's "
        f"gauge {hp['max_fill_seen']}, highest token usage logged "
        f"{hp['max_token_usage_logged']}; {s['pool_bound_samples']} of "
        f"{s['load_samples']} load samples pool-bound, up to "
        f"{s['max_waiting_reqs']} requests waiting; queue time p50 "
        f"{qt.get('p50')} s, p99 {qt.get('p99')} s, max {qt.get('max')} s",
        f"- leaks {s['leaks']}, tracebacks {s['tracebacks']}; alive at the end "
        f"{s['alive_at_end']}, idle-clean {s['idle_clean']}"
        + (f"; error: {s['error']}" if s["error"] else ""),
        f"- decode log: {s['warmed']} warm-ups, {s['lines_direct_beside_walking']} "
        f"lines with direct requests beside walking ones, idle-loc units up to "
        f"{s['max_idle_loc_units_logged']} and fewer than before in "
        f"{s['lines_idle_loc_units_back']} lines; extra units lent at once up to "
        f"{s['extra_units_lent_peak']}",
        f"- probes: {s['probes']} at batch 1 before and after; differing "
        f"{s['probes_differing'] or 'none'}",
        "",
        "| criterion (churn soak) | holds |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in s["criteria"].items()]
    return "\n".join(lines) + "\n"


def parse_printed_summary(text: str) -> dict:
    """The issue's keys from a run's printed summary (``summary_markdown``'s
    key table), for a run whose files did not come back; ``passed`` None."""
    found = dict(re.findall(r"^\| `(\w+)` \| ([^|]*?) \|", text, re.M))
    out = {k: found.get(k) for k in SUMMARY_KEYS}
    for k, v in out.items():
        out[k] = int(v) if v is not None and v.isdigit() else v
    out.update(passed=None, source="stdout.txt: its files did not come back")
    return out


def side_run_keys(run_dir: str) -> dict:
    """A side run's issue keys and ``passed``, from its summary.json or else
    its printed summary (stdout.txt, ``passed`` None)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        with open(os.path.join(run_dir, "stdout.txt")) as f:
            return parse_printed_summary(f.read())
    with open(path) as f:
        run = json.load(f)
    keys = {k: run.get(k) for k in SUMMARY_KEYS}
    keys.update(passed=run["passed"])
    for k in ("model", "sglang_version"):
        if k in run:
            keys[k] = run[k]
    return keys


def with_side_runs(summary: dict, side_dirs: Dict[str, str]) -> dict:
    """``summary`` with each side run's keys under its name (``mtp``,
    ``rank``), before ``code_commit`` (the issue's order); ``passed`` only
    if every run passed, ``passed_alone`` this run's own."""
    sides = {name: side_run_keys(d) for name, d in side_dirs.items() if d}
    out = {}
    for k, v in summary.items():
        if k == "code_commit":
            out.update(sides)
        out[k] = v
    out["passed_alone"] = summary["passed"]
    out["passed"] = summary["passed"] and all(bool(r["passed"]) for r in sides.values())
    return out


def write_summary(
    result: dict, out: str, side_dirs: Optional[Dict[str, str]] = None
) -> dict:
    summary = build_summary(result)
    if side_dirs and any(side_dirs.values()):
        summary = with_side_runs(summary, side_dirs)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary_markdown(summary))
    return summary


# --------------------------------------------------------------------- main


def default_host_pool_gb(max_total_tokens: int, num_layers: int) -> float:
    """GB (rounded up to 0.01) that hold ``max_total_tokens`` fp8 KV rows of
    every layer: the host pool then caps the locs no lower than the budget."""
    nbytes = max_total_tokens * num_layers * ROW_BYTES_FP8
    return math.ceil(nbytes / (1 << 30) * 100) / 100


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    full, quick = FULL_DEFAULTS, QUICK_DEFAULTS

    def by_mode(key: str) -> str:
        return f" (default {full[key]}; with --quick {quick[key]})"

    p.add_argument(
        "--out",
        default=os.path.join(os.environ.get("OUT", "/tmp"), "soak"),
        help="results directory (default $OUT/soak, else /tmp/soak)",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="only rewrite summary.json/.md from --out's soak.json",
    )
    p.add_argument(
        "--mtp-from",
        help="with --report: the MTP run's --out, its keys go under 'mtp'",
    )
    p.add_argument(
        "--rank-from",
        help="with --report: the rank model's run's --out, its keys go under 'rank'",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: fewer, shorter requests, a smaller budget",
    )
    p.add_argument(
        "--num-requests", type=int, help="soak requests" + by_mode("num_requests")
    )
    p.add_argument(
        "--concurrency",
        type=int,
        help="clients at a time, also the server's --max-running-requests and "
        "--cuda-graph-max-bs-decode" + by_mode("concurrency"),
    )
    p.add_argument("--min-len", type=int, default=1, help="shortest prompt (default 1)")
    p.add_argument("--max-len", type=int, help="longest prompt" + by_mode("max_len"))
    p.add_argument(
        "--min-new-tokens", type=int, default=1, help="fewest new tokens (default 1)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=128, help="most new tokens (default 128)"
    )
    p.add_argument(
        "--abort-fraction",
        type=float,
        default=0.1,
        help="share of the requests streamed and closed by the client (default 0.1)",
    )
    p.add_argument(
        "--abort-before-output",
        type=float,
        default=0.2,
        help="share of those closed right after the response headers (default 0.2)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="soak requests with ignore_eos (sglang's admission then reserves "
        "their whole output: no retraction)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="workload, probes, weights (default 0)"
    )
    p.add_argument(
        "--probe-tokens", type=int, default=64, help="new tokens per probe (default 64)"
    )
    p.add_argument(
        "--max-total-tokens",
        type=int,
        help="the server's token locs = host slots" + by_mode("max_total_tokens"),
    )
    p.add_argument(
        "--host-pool-gb",
        type=float,
        help="--nsa-kv-offload-host-pool-gb (default: what --max-total-tokens "
        "needs, rounded up to 0.01 GB)",
    )
    p.add_argument(
        "--context-length",
        type=int,
        help="server context (default --max-len + the most new tokens + 512)",
    )
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.5,
        help="server's --mem-fraction-static (default 0.5)",
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
        help="make_checkpoint --attn-out-gain (1)",
    )
    p.add_argument(
        "--model",
        choices=("tiny", "rank"),
        default="tiny",
        help="tiny: the generated checkpoint (default); rank: the 61-layer "
        "config with dummy weights (token identity means nothing there: "
        "--verify is the check)",
    )
    p.add_argument(
        "--ckpt",
        default="/tmp/ckpt",
        help="checkpoint dir prefix, exactness.py's naming: reused if there "
        "(default /tmp/ckpt)",
    )
    p.add_argument(
        "--verify",
        choices=("fail", "count"),
        default="count",
        help="--nsa-kv-offload-verify mode (default count: mismatches counted)",
    )
    p.add_argument(
        "--mtp",
        type=int,
        default=0,
        help="MTP (spec v2) with this many steps (default 0: none)",
    )
    p.add_argument(
        "--retract-interval",
        type=int,
        default=0,
        help="force a retraction every N decode steps (default 0: only on a full pool)",
    )
    p.add_argument(
        "--kv-budget-gib",
        type=float,
        help="GPU KV budget (sets --mem-fraction-static): small makes units scarce",
    )
    p.add_argument(
        "--extra-server-args", default="", help="more server flags, one string"
    )
    p.add_argument(
        "--port", type=int, default=34000, help="server port (default 34000)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="server start timeout in s (default 900)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=900.0,
        help="socket timeout per soak request in s (default 900)",
    )
    p.add_argument(
        "--time-budget-s",
        type=float,
        help="stop sending soak requests this many seconds after the soak "
        "starts (after the server start and the probes; default: no limit; the "
        "end takes ~1 min more: in-flight requests, probes, idle checks); the "
        "summary counts what was sent",
    )
    p.add_argument(
        "--wall-budget-s",
        type=float,
        help="the whole run (server start to summary) within this many "
        "seconds: the soak ends early enough for the probes after it (as long "
        f"as those before it took) and {FINISH_RESERVE_S:.0f} s more; beside "
        "--time-budget-s, the earlier end wins",
    )
    p.add_argument(
        "--min-requests",
        type=int,
        default=MIN_REQUESTS,
        help=f"the criterion's floor of requests sent (default {MIN_REQUESTS})",
    )
    p.add_argument(
        "--idle-wait",
        type=float,
        default=10.0,
        help="idle seconds after the soak and after the probes: sglang's and "
        "the offload's idle checks run (default 10)",
    )
    p.add_argument(
        "--sample-interval",
        type=float,
        default=0.5,
        help="/get_load sampling period in s (default 0.5)",
    )
    p.add_argument(
        "--metrics-interval",
        type=float,
        default=5.0,
        help="/metrics scraping period during the soak in s (default 5)",
    )
    p.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        help="progress line period in s (default 10)",
    )
    args = p.parse_args(argv)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    most_new = max(args.max_new_tokens, args.probe_tokens)
    if args.context_length is None:
        args.context_length = args.max_len + most_new + 512
    if args.max_len + most_new >= args.context_length:
        p.error("--context-length must exceed --max-len + the most new tokens")
    # sglang clamps max_new_tokens so that a request fits the token budget.
    if -(-args.max_len // PAGE) * PAGE + most_new + PAGE >= args.max_total_tokens:
        p.error("--max-total-tokens must hold the longest request")
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    if not 1 <= args.min_new_tokens <= args.max_new_tokens:
        p.error("need 1 <= --min-new-tokens <= --max-new-tokens")
    if args.host_pool_gb is None:
        args.host_pool_gb = default_host_pool_gb(
            args.max_total_tokens, load_config(args.model)["num_hidden_layers"]
        )
    return args


def ensure_checkpoint(args, config: dict) -> str:
    path = (
        f"{args.ckpt}_tiny_s{args.seed}_q{args.qk_gain:g}_o{args.out_gain:g}"
        f"_a{args.attn_out_gain:g}"
    )
    if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        meta = write_checkpoint(
            config,
            path,
            args.seed,
            args.qk_gain,
            args.out_gain,
            "cpu",
            attn_out_gain=args.attn_out_gain,
        )
        print(f"[soak] checkpoint {path}: {json.dumps(meta)}", flush=True)
    return path


def run_probes(srv: ExactServer, prompts: List[List[int]], n: int) -> list:
    """Each probe alone on the idle server; None where a probe failed."""
    outs = []
    for p in prompts:
        try:
            srv.wait_idle()
            outs.append(srv.generate(p, n)["output_ids"])
        except (OSError, RuntimeError, ValueError, http.client.HTTPException) as e:
            print(f"[soak] probe of {len(p)} tokens failed: {e}", flush=True)
            outs.append(None)
    return outs


def soak_deadline(args, t0: float, probes_s: float) -> Optional[float]:
    """When the soak stops sending: ``--time-budget-s`` after now, or early
    enough that the probes after it (``probes_s``, as long as those before)
    and the finish fit ``--wall-budget-s`` from ``t0``; None: no limit."""
    ends = []
    if args.time_budget_s:
        ends.append(time.time() + args.time_budget_s)
    if args.wall_budget_s:
        ends.append(t0 + args.wall_budget_s - probes_s - FINISH_RESERVE_S)
    return min(ends) if ends else None


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def run(args) -> dict:
    """Start the server, probe, soak, probe, check; the run's result."""
    t0 = time.time()
    config = load_config(args.model)
    vocab = config["vocab_size"]
    result = {
        "config": vars(args),
        "code_commit": git_commit(),
        "sglang_version": sglang_version(),
        "started": t0,
    }
    if args.model == "rank":
        use_model("rank")  # dummy weights: the servers copy its config
        ckpt = None
    else:
        ckpt = ensure_checkpoint(args, config)
    workload = make_workload(
        args.num_requests,
        args.seed,
        args.min_len,
        args.max_len,
        args.min_new_tokens,
        args.max_new_tokens,
        args.abort_fraction,
        args.abort_before_output,
    )
    probes = random_prompts(probe_lengths(args.max_len), args.seed + 2, vocab)
    result["probe_lens"] = [len(p) for p in probes]
    spec = {"offload": [], "metrics": True, "dummy": args.model == "rank"}
    if args.mtp:
        spec.update(mtp=args.mtp, spec_v2=True)
    if args.retract_interval:
        spec["retract"] = True  # sglang's forced retraction (SGLANG_TEST_RETRACT)
    extra, env = exactness_server_args(spec, args, ckpt)
    if args.verify:
        extra += ["--nsa-kv-offload-verify", args.verify]
    if args.kv_budget_gib:
        from bench_server import mem_fraction_for_budget

        fraction, how = mem_fraction_for_budget(args.kv_budget_gib)
        print(f"[soak] --mem-fraction-static {fraction} ({how})", flush=True)
        extra += ["--mem-fraction-static", str(fraction)]
    extra += shlex.split(args.extra_server_args)
    srv = ExactServer("soak", extra, args.port, args.out, env, args.timeout)
    runner = None
    try:
        srv.start().wait_ready()
        probes_t0 = time.time()
        result["probes_before"] = run_probes(srv, probes, args.probe_tokens)
        deadline = soak_deadline(args, t0, time.time() - probes_t0)
        print(f"[soak] {len(probes)} probes done; soak starts", flush=True)
        # For a second server started beside this one once this one's
        # memory is allocated (device_run.sh churn).
        open(os.path.join(args.out, "soak_started"), "w").close()
        runner = SoakRunner(
            srv.url,
            workload,
            lambda req: request_prompt(req, args.seed, vocab),
            args.concurrency,
            alive=lambda: srv.proc.poll() is None,
            ignore_eos=args.ignore_eos,
            request_timeout=args.request_timeout,
            deadline=deadline,
            sample_interval=args.sample_interval,
            progress_interval=args.progress_interval,
            metrics_interval=args.metrics_interval,
        )
        result.update(runner.run())
        srv.wait_idle()
        time.sleep(args.idle_wait)
        result["metrics"] = scrape_offload_metrics(srv.url)
        result["metrics"].update(scrape_series(srv.url, CORE_SERIES))
        result["probes_after"] = run_probes(srv, probes, args.probe_tokens)
        srv.wait_idle()
        result["idle_reached"] = True
        time.sleep(args.idle_wait)
        result["final_load"] = fetch_load(srv.url)
        result["alive_at_end"] = srv.proc.poll() is None and health_ok(srv.url)
    except (Exception, SystemExit, KeyboardInterrupt) as e:
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
        result["interrupted"] = not isinstance(e, Exception)
        if runner is not None and "records" not in result:
            result.update(runner.outcome(), stopped_by="interrupted")
        print(f"[soak] FAILED: {result['error']}", flush=True)
    finally:
        result["died"] = srv.proc is not None and srv.proc.poll() is not None
        if "alive_at_end" not in result and not result.get("interrupted"):
            started = srv.proc is not None and not result["died"]
            result["alive_at_end"] = started and health_ok(srv.url)
        if srv.proc is not None:
            srv.stop()
        else:
            shutil.rmtree(srv.model_dir, ignore_errors=True)
        result["log"] = scan_soak_log(srv.log_path)
        result["wall_s"] = round(time.time() - t0, 1)
        if os.path.exists(srv.log_path):
            with open(srv.log_path, "rb") as src:
                with gzip.open(srv.log_path + ".gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
            os.remove(srv.log_path)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "soak.json")
    if args.report:
        # soak.json, or soak.json.gz as committed under results/.
        packed = not os.path.exists(path) and os.path.exists(path + ".gz")
        with gzip.open(path + ".gz", "rt") if packed else open(path) as f:
            result = json.load(f)
        # The log again: what a newer scan reads from it.
        log_gz = os.path.join(args.out, "server_soak.log.gz")
        if os.path.exists(log_gz):
            result["log"] = scan_soak_log(log_gz)
    else:
        # A timeout's SIGTERM still stops the server and writes the summary.
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            result = run(args)
        finally:
            signal.signal(signal.SIGTERM, previous)
        with open(path, "w") as f:
            json.dump(result, f)
    summary = write_summary(
        result, args.out, {"mtp": args.mtp_from, "rank": args.rank_from}
    )
    print(summary_markdown(summary), flush=True)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
