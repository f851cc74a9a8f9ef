"""Demo of the decode-side NSA KV offload.

What it shows. The offload keeps only C = 4096 rows (plus a W = 64 window) of a
request's KV per layer on the GPU and copies each decode step's misses (top-k
tokens not on the GPU) from host memory. Fewer GPU rows per request means more
requests per GPU; the price is the misses' PCIe traffic.

Without a GPU (CPU replay, under a minute): it replays the embedded synthetic
DeepSeek-V3.2 top-k trace (``traces/dsv32_synth_default.npz``) through our LRU
policy and HiSparse's (sglang's own sparse KV offload) with the same GPU rows
and prints, first, the default server's result: misses per (request, layer,
step), ours vs HiSparse. Good: a ratio <= 1.00 (no more host->GPU copies than
HiSparse with the same GPU memory). Then the full sweep over buffer sizes, the
experimental cross-layer prefetch (good: <= 0.80x HiSparse's demand misses),
and the exactness check of the reference engine (good: "exact": our engine's
page tables and copy lists equal the replay model's). PNGs and the full report
go to ``--out-dir`` (default ``/tmp/nsa_offload_demo``, printed).

On a GPU host with sglang 0.5.12.post1 installed and patched it runs real
servers without and with ``--enable-decode-nsa-kv-offload`` instead
(:func:`run_gpu_comparison`). First exactness (``server/exactness.py``): both
servers load a generated checkpoint of the tiny model whose weights make the
tokens depend on the KV rows attention reads, sglang's top-k is made
deterministic on both, and the same prompts go one at a time (batch 1: with
fp8 KV the batch composition changes sglang's own outputs). Good: identical
greedy outputs on every prompt; the no-offload server repeats itself; and,
where the benchmark hooks are installed (``scripts/apply_patch.py
--with-bench-hooks``), the negative control (one wrong KV row read at every
decode step) changes >= 90% of the outputs, i.e. the comparison can fail.
Then capacity (``server/e2e_server.py``, dummy weights: no outputs compared):
more peak running requests at the same GPU memory, no leak after idle; then
(not with ``--quick``) PD decode servers at 128K, no offload vs ours vs
HiSparse.

Usage (repository root)::

    bash scripts/demo.sh [--quick] [--out-dir DIR] [--mode cpu|gpu]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
# The replay tools (numpy, torch) are imported when needed: --help and bad
# arguments answer at once, before any venv is built.
TRACES_DIR = HERE / "traces"
SERVER_DIR = HERE / "server"
DEFAULT_TRACE = TRACES_DIR / "dsv32_synth_default.npz"
DEFAULT_OUT_DIR = Path("/tmp/nsa_offload_demo")
QUICK_BUDGETS = "2560,4160,8192"
QUICK_WINDOWS = "1,64,256"
# The trace the H200 benchmark fed the 3-layer model for the prefetch
# (results/prefetch_live/): three adjacent DeepSeek-V3.2 layers.
ADJACENT_TRACE_ARGS = (
    "--requests 2 --prompt-lens 16384,16384 --steps 128 --layers 29,30,31 --seed 0"
)
ENGINE_BUDGET, ENGINE_WINDOW = 4160, 64


@dataclass
class GpuStack:
    available: bool
    reason: str


def detect_gpu_stack() -> GpuStack:
    """Whether this machine could run the GPU server comparison."""
    try:
        import torch
    except ImportError:
        return GpuStack(False, "torch is not installed")
    if not torch.cuda.is_available():
        return GpuStack(False, "no CUDA device visible")
    missing = [
        m for m in ("sgl_kernel", "sglang") if importlib.util.find_spec(m) is None
    ]
    if missing:
        return GpuStack(False, f"CUDA device found but {', '.join(missing)} missing")
    return GpuStack(True, f"CUDA device {torch.cuda.get_device_name(0)}")


# Exactness on the tiny checkpoint, batch 1, deterministic top-k: the run of
# results/exactness/tiny_run6/ with its base_fp8 and ours_fp8 servers (no
# offload vs the default offload server, the negative control in persistent
# mode on the no-offload server; exactness.py's default gains are that run's).
GPU_EXACTNESS_ARGS = [
    "--model", "tiny", "--servers", "base_fp8,ours_fp8",
    "--nc-modes", "persistent", "--nc-requests", "16",
]  # fmt: skip
# --quick: no second pass on the no-offload server, fewer aborted streams and
# control requests (later flags win).
GPU_EXACTNESS_QUICK_ARGS = [
    "--skip-repeat", "--abort-requests", "2", "--nc-requests", "8",
]  # fmt: skip
# The offload and the server it is compared with (exactness.SERVERS).
EXACTNESS_OFFLOAD, EXACTNESS_BASE = "ours_fp8", "base_fp8"
NC_MODE = "persistent"
NC_MIN_FLIP_FRACTION = 0.9
# Colocated servers (dummy weights, so no output comparison): capacity at 32K
# on a ~2 GB KV budget, as in the first colocated H200 run (git history:
# 5a9b9c1:benchmark/nsa_offload/results/h200_e2e/; at 16K-128K on a 4 GiB
# budget: results/capacity_colocated/).
GPU_E2E_ARGS = [
    "--num-requests", "0",
    "--mem-fraction-static", "0.018", "--context-length", "36000",
    "--max-running-baseline", "256", "--max-running-offload", "88",
    "--host-pool-gb", "8", "--capacity-length", "32768",
    "--capacity-new-tokens", "512",
]  # fmt: skip
# PD decode servers (fake transfer): capacity at 128K, as in
# results/capacity_pd_decode/run_128k.
GPU_PD_CAPACITY_ARGS = [
    "--pd-decode", "--servers", "baseline,offload,hisparse", "--num-requests", "0",
    "--mem-fraction-static", "0.0324", "--context-length", "135680",
    "--host-pool-gb", "24", "--max-running-baseline", "256",
    "--capacity-lengths", "131072", "--capacity-new-tokens", "4096",
    "--capacity-oversubscribe", "1.1",
]  # fmt: skip


def _import_server_tools():
    if str(SERVER_DIR) not in sys.path:
        sys.path.insert(0, str(SERVER_DIR))
    import exactness
    import server_utils

    return exactness, server_utils


def exactness_verdict(
    result: dict, nc_skip_reason: Optional[str] = None
) -> Tuple[bool, List[str]]:
    """Judge an ``exactness.py`` run (its ``exactness.json``): every batch-1
    output of the offload server identical to the no-offload one's, the
    no-offload server's second pass (if run) identical to its first, both
    servers alive after idle with no error in their logs, and the negative
    control (unless ``nc_skip_reason``) flipping enough outputs."""
    exactness, _ = _import_server_tools()
    lines: List[str] = []
    ok = True

    def check(good: bool, text: str) -> None:
        nonlocal ok
        ok = ok and good
        lines.append(f"{text} -> {'good' if good else 'BAD'}")

    servers = result["servers"]
    summary = exactness.summarize(result, "tiny")
    for name, res in servers.items():
        log = summary["logs"].get(name, {})
        check(
            "error" not in res and res.get("alive", False) and not log.get("errors"),
            f"{name}: ran every phase, alive after idle, {log.get('errors', '?')} "
            f"errors logged{': ' + res['error'] if 'error' in res else ''}",
        )
    n = len(result["prompt_lens"])
    rows = summary["comparisons"].get(EXACTNESS_OFFLOAD, {})
    seq = rows.get("seq", {"identical": 0, "total": 0})
    diffs = seq.get("first_diff")
    check(
        seq["total"] == n and seq["identical"] == n,
        f"offload vs no offload, one request at a time: {seq['identical']}/{n} "
        "prompts identical" + (f" (first differing tokens {diffs})" if diffs else ""),
    )
    abort = rows.get("abort")
    if abort is not None:
        check(
            abort["identical"] == abort["total"]
            and abort["partial_prefixes"] == abort["total"],
            f"aborted streams: {abort['identical']}/{abort['total']} identical "
            f"afterwards, {abort['partial_prefixes']} partial outputs prefixes",
        )
    base, ours = servers.get(EXACTNESS_BASE, {}), servers.get(EXACTNESS_OFFLOAD, {})
    if "after_idle" in base or "after_idle" in ours:
        check(
            base.get("after_idle") == ours.get("after_idle"),
            "after idle: the same output",
        )
    again = summary["self_agreement"].get(EXACTNESS_BASE)
    if again is not None:
        check(
            again["identical"] == again["total"],
            f"no-offload server, the same prompts again: {again['identical']}/"
            f"{again['total']} identical",
        )
    if "concurrent" in rows:
        c = rows["concurrent"]
        lines.append(
            f"concurrent (reported only: with fp8 KV the batch composition changes "
            f"sglang's own outputs): {c['identical']}/{c['total']} identical"
        )
    if nc_skip_reason is not None:
        lines.append(f"negative control skipped: {nc_skip_reason}")
    else:
        nc = summary["negative_control"].get(EXACTNESS_BASE, {}).get(NC_MODE)
        if nc is None or not nc["requests"]:
            check(False, "negative control: not run")
        else:
            need = math.ceil(NC_MIN_FLIP_FRACTION * nc["requests"])
            check(
                nc["flipped"] >= need
                and nc["changed_before_corruption"] == 0
                and bool(nc["rows_corrupted"]),
                f"negative control (one wrong KV row read at every decode step): "
                f"{nc['flipped']}/{nc['requests']} outputs changed (need {need}: "
                f"the comparison can fail), {nc['changed_before_corruption']} "
                f"before the first corrupted step, {nc['rows_corrupted']} rows "
                "corrupted",
            )
    return ok, lines


def report_exactness(out_dir: Path, nc_skip_reason: Optional[str]) -> int:
    """Print the verdict of the exactness run in ``out_dir``; 0 if good."""
    import json

    try:
        with open(out_dir / "exactness.json") as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        print(f"exactness: no results ({e}) -> BAD")
        return 1
    ok, lines = exactness_verdict(result, nc_skip_reason)
    print("\n== Exactness on the tiny checkpoint (batch 1, deterministic top-k)\n")
    for line in lines:
        print(line)
    print(f"details: {out_dir / 'summary.md'}")
    return 0 if ok else 1


def exactness_args(quick: bool, nc_skip_reason: Optional[str]) -> List[str]:
    args = list(GPU_EXACTNESS_ARGS)
    if quick:
        args += GPU_EXACTNESS_QUICK_ARGS
    if nc_skip_reason is not None:
        args += ["--nc-requests", "0"]  # the control would change nothing
    return args


def run_gpu_comparison(args: argparse.Namespace) -> int:
    """Real servers without and with the offload: exactness on the tiny
    checkpoint (exactness.py), then capacity and the idle check (e2e_server.py)."""
    import subprocess

    _, server_utils = _import_server_tools()
    out = Path(args.out_dir or DEFAULT_OUT_DIR)
    nc_skip_reason = server_utils.bench_hooks_missing()
    runs = [
        ("exactness", "exactness.py", exactness_args(args.quick, nc_skip_reason)),
        ("colocated", "e2e_server.py", GPU_E2E_ARGS),
    ]
    if not args.quick:
        runs.append(("pd_decode_128k", "e2e_server.py", GPU_PD_CAPACITY_ARGS))
    rc = 0
    for name, script, run_args in runs:
        cmd = [
            sys.executable,
            str(SERVER_DIR / script),
            "--out",
            str(out / name),
        ]
        print(f"\n== {name}\n$", " ".join(cmd + run_args), flush=True)
        code = subprocess.call(cmd + run_args, cwd=str(SERVER_DIR))
        if name == "exactness" and code == 0:
            code = report_exactness(out / name, nc_skip_reason)
        rc = code or rc
    return rc


def _import_replay_tools():
    if str(TRACES_DIR) not in sys.path:
        sys.path.insert(0, str(TRACES_DIR))
    import prefetch_study
    import replay
    import trace_gen

    return prefetch_study, replay, trace_gen


def _step(msg: str) -> float:
    print(f"[demo] {msg}", flush=True)
    return time.time()


def _print_headline(res, trace) -> None:
    """The default server's result, in plain words."""
    head = next(r for r in res["p6"] if r["budget"] == res["headline_budget"])
    window = res["window"]
    ratio = head["ratio"]
    good = "good" if ratio <= 1.0 else "worse than HiSparse"
    print(
        f"\n== Result for the default server (C = {head['budget'] - window} LRU rows "
        f"+ W = {window} window rows per request and layer)\n"
    )
    print(
        f"Misses per (request, layer, decode step), top-k {trace.top_k}: ours "
        f"{head['ours_misses_per_row']:.1f}, HiSparse {head['hisparse_misses_per_row']:.1f} "
        f"with the same GPU rows -> ratio {ratio:.3f} ({good}: <= 1.00 means no "
        "more host->GPU copies than HiSparse)."
    )
    print(
        "This synthetic trace is the pessimistic stress case (about half the "
        "top-k misses); real DeepSeek-V3.2 traces miss far less (DESIGN notes)."
    )


def run_cpu_replay(args: argparse.Namespace) -> int:
    prefetch_study, replay, trace_gen = _import_replay_tools()
    out_dir = Path(args.out_dir or DEFAULT_OUT_DIR)
    print(f"Writing the report and PNGs to {out_dir}/", flush=True)
    t = _step(f"loading the trace {replay._display_path(str(args.trace))}")
    trace = replay.load_trace(str(args.trace))
    calib = trace.metadata.get("calibration")
    budgets = (
        QUICK_BUDGETS if args.quick else ",".join(map(str, replay.DEFAULT_BUDGETS))
    )
    windows = (
        QUICK_WINDOWS if args.quick else ",".join(map(str, replay.DEFAULT_WINDOWS))
    )
    rargs = replay.parse_args(
        [
            "--trace",
            str(args.trace),
            "--budgets",
            budgets,
            "--windows",
            windows,
            "--init",
            args.init,
            "--out-dir",
            str(out_dir),
        ]
        + (["--no-plots"] if args.no_plots else [])
        + (["--engine-path", str(args.engine_path)] if args.engine_path else [])
    )
    t = _step(
        f"replaying {trace.num_steps} steps x {trace.num_layers} layers x "
        f"{trace.num_requests} requests through ours and HiSparse at "
        f"{len(budgets.split(','))} buffer sizes, then the reference engine "
        "(imports sglang; 10-40 s)"
    )
    res = replay.run(rargs)
    print(f"[demo] replay done in {time.time() - t:.0f} s", flush=True)
    _print_headline(res, trace)
    md = res["markdown"]
    cmd = trace.metadata.get("command")
    print(f"\n== Trace: {replay._display_path(str(args.trace))}")
    if cmd:
        print(f"   generated by: {cmd}")
    if calib:
        print("\n== Calibration (measured on the trace)\n")
        print(trace_gen.format_calibration_table(calib))
    # The P6 section and the exactness line (the full report is in out_dir).
    p6 = md.split("## P6", 1)[1].split("## Ours:", 1)[0]
    print("\n== P6" + p6.rstrip())
    t = _step("replaying the cross-layer prefetch (about 10 s)")
    print_prefetch_replay(trace, prefetch_study, trace_gen)
    print("\n== Exactness of the reference engine\n")
    print(replay.engine_line(res["engine_check"]))
    print(f"\nfull report: {out_dir / 'summary.md'}")
    if not args.no_plots:
        print(f"plots: {out_dir}/*.png")
    print(f"\n(replay took {res['seconds']:.1f}s)")
    engine = res["engine_check"]
    if engine is not None and engine["status"] == "mismatch":
        return 1
    return 0


def print_prefetch_replay(embedded, prefetch_study, trace_gen) -> None:
    """P6 with the experimental cross-layer prefetch: it loads layer l's top-k
    into layer l+1 ahead of time, so it needs adjacent layers; the embedded
    trace has one adjacent pair (20, 21), the generated one three layers."""
    cmd = (
        "python benchmark/nsa_offload/traces/trace_gen.py --out X "
        + ADJACENT_TRACE_ARGS
    )
    gen = trace_gen.parse_args(["--out", "unused"] + ADJACENT_TRACE_ARGS.split())
    adjacent, _ = trace_gen.build_trace(
        trace_gen.config_from_args(gen), cmd, verbose=False
    )
    layers = ",".join(str(x) for x in embedded.layer_ids)
    results = {
        f"embedded (layers {layers})": [
            prefetch_study.study(embedded, ENGINE_BUDGET, ENGINE_WINDOW)
        ],
        "adjacent layers 29,30,31": [
            prefetch_study.study(adjacent, ENGINE_BUDGET, ENGINE_WINDOW)
        ],
    }
    print(
        "\n== P6 with the cross-layer prefetch "
        "(SGLANG_NSA_KV_OFFLOAD_CROSS_LAYER_PREFETCH=1, experimental)\n"
    )
    print(f"Adjacent-layer trace: {cmd}")
    print("Misses per (request, layer, step) at B = 4160; demand = what the attention")
    print(
        "waits for, prefetch loads move on a side stream while the layer before computes.\n"
    )
    print(prefetch_study.render(results).rstrip())
    ratio = results["adjacent layers 29,30,31"][0]["demand_vs_hisparse"]
    verdict = "met" if ratio <= 0.8 else "NOT MET"
    print(
        f"\n**P6 with the prefetch on adjacent layers: demand misses / HiSparse = "
        f"{ratio:.3f} -> {verdict}** (target <= 0.8; the H200 run of this trace: "
        "benchmark/nsa_offload/results/prefetch_live/)."
    )


class _OneLineErrors(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = _OneLineErrors(
        prog="demo",
        description=__doc__.split("Usage", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help="top-k trace to replay (default: the embedded DeepSeek-V3.2 trace)",
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help=f"folder for the report, JSON and PNGs (default: {DEFAULT_OUT_DIR})",
    )
    p.add_argument(
        "--mode",
        choices=["auto", "cpu", "gpu"],
        default="auto",
        help="cpu: trace replay; gpu: real servers; auto: gpu when a CUDA GPU and the patched sglang are there",
    )
    p.add_argument("--quick", action="store_true", help="fewer budgets and windows")
    p.add_argument(
        "--init",
        choices=["cold", "prefix"],
        default="cold",
        help="LRU state at the first decode step: cold (empty) or prefix (warmed with the prompt's newest tokens)",
    )
    p.add_argument("--no-plots", action="store_true", help="do not write PNGs")
    p.add_argument(
        "--engine-path",
        type=Path,
        default=None,
        help="lru_cache_state.py to check (default: the installed sglang's)",
    )
    p.add_argument(
        "--check-args",
        action="store_true",
        help="only check the arguments and exit (scripts/demo.sh does this before "
        "it builds the venv)",
    )
    args = p.parse_args(argv)
    if not args.trace.is_file():
        p.error(f"--trace {args.trace}: no such file")
    if args.engine_path is not None and not args.engine_path.is_file():
        p.error(f"--engine-path {args.engine_path}: no such file")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.check_args:
        return 0
    if args.mode in ("auto", "gpu"):
        stack = detect_gpu_stack()
        if stack.available:
            print(f"GPU detected ({stack.reason}).")
            return run_gpu_comparison(args)
        elif args.mode == "gpu":
            print(f"GPU mode requested but unavailable: {stack.reason}.")
            return 2
        else:
            print(f"No GPU stack ({stack.reason}): offline CPU replay.\n")
    return run_cpu_replay(args)


if __name__ == "__main__":
    sys.exit(main())
