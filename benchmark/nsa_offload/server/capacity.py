"""Capacity: concurrently running long requests per GPU, offload vs no offload.

Two parts:

* ``model`` (CPU): for a GPU KV budget and a request length, the number of
  requests each server fits, from the offload's own pool sizing code
  (``compute_offload_pool_sizes``) and the bytes the no-offload NSA pool
  allocates per token; with the analytic bound of the issue
  ``L (656 + 132) / (L 132 + R 656)`` and where the offload's memory goes.
* the measured side: ``e2e_server.py --capacity-lengths L1,L2,..`` gives
  real servers the same budget and reads their peak ``#running-req`` with the
  log parsing below; ``report`` builds the table (JSON, Markdown, PNG) from
  one or more of its runs, also from a run cut before it wrote its JSON.

    python benchmark/nsa_offload/server/capacity.py model --out results/capacity
    python benchmark/nsa_offload/server/capacity.py report --out DIR --context-length 131584 \
        --capacity-new-tokens 128 RUN_A RUN_B
"""

import argparse
import atexit
import functools
import gzip
import json
import math
import os
import re
import shutil
import statistics
import tempfile
from typing import Optional

from server_utils import num_model_layers, offload_max_units

ROW_BYTES_FP8 = 656  # FlashMLA fp8 row: 512 nope + 4 fp32 scales + 64 bf16 rope
INDEXER_BYTES = 132  # 128 fp8 + fp32 scale
PAGE = 64


def capacity_bound(tokens: int, region_rows: int) -> float:
    """The issue's bound ``L (656 + 132) / (L 132 + R 656)``: requests of
    ``tokens`` the offload holds per no-offload request in the same bytes,
    with ``region_rows`` GPU rows per request and layer."""
    return (
        tokens
        * (ROW_BYTES_FP8 + INDEXER_BYTES)
        / (tokens * INDEXER_BYTES + region_rows * ROW_BYTES_FP8)
    )


def model_rows(args):
    # On a CPU machine: the venv of scripts/setup_cpu_env.sh (its torchvision
    # fix-up lets sglang import there).
    from sglang.srt.mem_cache.nsa_kv_offload_sizing import (
        compute_offload_pool_sizes,
        offload_bytes_per_loc,
        offload_bytes_per_region,
        prefill_staging_rows,
    )

    budget = int(args.budget_gb * (1 << 30))
    C, W, L = args.buffer_size, args.recent_window, args.layers
    U = offload_max_units(args.max_units, C, args.context_len, W)
    R = C + W
    per_loc = offload_bytes_per_loc(L, INDEXER_BYTES)
    per_region = offload_bytes_per_region(L, ROW_BYTES_FP8, C, W, U)
    rows = []
    for length in args.lengths:
        tokens = length + args.new_tokens
        baseline = budget // (L * (ROW_BYTES_FP8 + INDEXER_BYTES)) // tokens
        out = {"length": length, "baseline": int(baseline)}
        for mode in ("colocated", "decode_only"):
            # Colocated: staging rows for prefills (they grow with the region
            # count: a partly used page per request of a prefill batch).
            colocated = mode == "colocated"
            staging_for = functools.partial(
                prefill_staging_rows, args.context_len, args.prefill_budget
            )
            # Largest region count whose tokens still fit: M (L per_loc + region)
            # plus the fixed staging must stay within the budget.
            staging = staging_for(0, PAGE) if colocated else 0
            fixed = L * (PAGE + staging) * ROW_BYTES_FP8
            m = max((budget - fixed) // (tokens * per_loc + per_region), 0)
            while m > 0:
                staging = staging_for(m, PAGE) if colocated else 0
                sizes = compute_offload_pool_sizes(
                    available_bytes=budget,
                    num_layers=L,
                    row_bytes=ROW_BYTES_FP8,
                    indexer_bytes=INDEXER_BYTES,
                    page_size=PAGE,
                    buffer_size=C,
                    recent_window=W,
                    num_regions=m,
                    staging_rows=staging,
                    host_pool_bytes=1 << 62,
                    max_units=U,
                )
                if sizes.num_locs // PAGE >= m * ((tokens + PAGE - 1) // PAGE):
                    break
                m -= 1
            staging = staging_for(m, PAGE) if colocated else 0
            used = {
                "indexer_and_maps_gb": m * tokens * per_loc / (1 << 30),
                "regions_kv_gb": m * L * R * ROW_BYTES_FP8 / (1 << 30),
                "lru_state_gb": m * L * C * U * 6 / (1 << 30),
                "staging_gb": L * staging * ROW_BYTES_FP8 / (1 << 30),
            }
            out[mode] = int(m)
            out[f"{mode}_ratio"] = m / baseline if baseline else float("inf")
            out[f"{mode}_memory"] = used
        bound = capacity_bound(length, R)
        out["bound"] = bound
        out["decode_only_vs_bound"] = out["decode_only_ratio"] / bound
        out["colocated_vs_bound"] = out["colocated_ratio"] / bound
        rows.append(out)
    return rows


def write_model(args):
    rows = model_rows(args)
    os.makedirs(args.out, exist_ok=True)
    meta = {
        "layers": args.layers,
        "budget_gb": args.budget_gb,
        "buffer_size": args.buffer_size,
        "recent_window": args.recent_window,
        "max_units": offload_max_units(
            args.max_units, args.buffer_size, args.context_len, args.recent_window
        ),
        "new_tokens": args.new_tokens,
        "context_len": args.context_len,
        "prefill_budget": args.prefill_budget,
    }
    with open(os.path.join(args.out, "capacity_model.json"), "w") as f:
        json.dump({"config": meta, "rows": rows}, f, indent=1)
    lines = [
        f"# Capacity at a {args.budget_gb:g} GB KV budget, {args.layers} layers "
        f"(fp8 656 B rows, R = {args.buffer_size} + {args.recent_window}, "
        f"slot ids for up to {meta['max_units']} unit(s) per request)",
        "",
        "Requests of `length` prompt + "
        f"{args.new_tokens} new tokens. `decode-only`: no prefill staging (what a "
        "PD decode server needs); `colocated`: staging for one max-length prompt "
        f"plus two prefill batches ({args.context_len} + 2 x {args.prefill_budget} rows).",
        "",
        "| length | no offload | offload colocated | x | offload decode-only | x | bound | decode-only / bound | staging GB | regions+LRU GB | indexer+maps GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = r["colocated_memory"]
        lines.append(
            f"| {r['length']} | {r['baseline']} | {r['colocated']} | "
            f"{r['colocated_ratio']:.2f} | {r['decode_only']} | "
            f"{r['decode_only_ratio']:.2f} | {r['bound']:.2f} | "
            f"{r['decode_only_vs_bound']:.3f} | {mem['staging_gb']:.2f} | "
            f"{mem['regions_kv_gb'] + mem['lru_state_gb']:.2f} | "
            f"{mem['indexer_and_maps_gb']:.2f} |"
        )
    with open(os.path.join(args.out, "capacity_model.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


# ------------------------------------------------------------ server logs

RUNNING_RE = re.compile(r"Decode batch.*?#running-req: (\d+)")
BASE_TOKENS_RE = re.compile(r"max_total_num_tokens=(\d+)")
OFFLOAD_RE = re.compile(
    r"NSA KV offload: (\d+) logical token locs .*?, (\d+) decode regions"
)


def scan_log(path, start: int = 0):
    """(peak #running-req, token locs, decode regions) of a server log, the
    peak counted from byte offset ``start`` on (one capacity phase)."""
    with open(path, "rb") as f:
        data = f.read().decode(errors="replace")
        f.seek(start)
        phase = f.read().decode(errors="replace")
    peak = max((int(m.group(1)) for m in RUNNING_RE.finditer(phase)), default=0)
    total_tokens, regions = None, None
    for m in BASE_TOKENS_RE.finditer(data):
        total_tokens = int(m.group(1))
    for m in OFFLOAD_RE.finditer(data):
        total_tokens, regions = int(m.group(1)), int(m.group(2))
    return peak, total_tokens, regions


# ------------------------------------------------------- measured capacity
#
# What e2e_server.py measures on real servers, and the table built from its
# runs: ``python capacity.py report --out DIR RUN_DIR...``.

MEM_RES = {
    "before_weights": re.compile(r"Load weight begin\. avail mem=([0-9.]+) GB"),
    "after_weights": re.compile(r"Load weight end\..*?avail mem=([0-9.]+) GB"),
    "graph_begin": re.compile(r"Capture cuda graph begin\..*?avail mem=([0-9.]+) GB"),
}


MEM_FRACTION_RE = re.compile(r"mem_fraction_static=([0-9.]+)")


def memory_from_log(path: str, mem_fraction: Optional[float] = None) -> dict:
    """GPU memory the server's pools took (after weights -> before CUDA graph
    capture: KV/indexer pools, and with the offload its regions, staging and
    LRU state) and the budget sglang handed the pool sizing
    (``_profile_available_bytes``: after weights - before x (1 - f)), with the
    ``--mem-fraction-static`` the server logged (a server may get its own,
    e.g. HiSparse at equal pool bytes), else ``mem_fraction``."""
    with open(path, errors="replace") as f:
        text = f.read()
    found = {
        k: float(r.search(text).group(1)) for k, r in MEM_RES.items() if r.search(text)
    }
    out = dict(found)
    if {"after_weights", "graph_begin"} <= found.keys():
        out["pools_gib"] = round(found["after_weights"] - found["graph_begin"], 3)
    logged = MEM_FRACTION_RE.search(text)
    if logged is not None:
        mem_fraction = float(logged.group(1))
    if mem_fraction is not None and {"before_weights", "after_weights"} <= found.keys():
        out["budget_gib"] = round(
            found["after_weights"] - found["before_weights"] * (1 - mem_fraction), 3
        )
    return out


def offload_regions_for(length: int, budget_gib: float, args) -> dict:
    """Decode regions (``--max-running-requests``) for requests of ``length``
    tokens: the largest count whose token locs still fit the budget, from the
    offload's own sizing code (``capacity.py model``, colocated staging)."""
    rows = model_rows(
        argparse.Namespace(
            budget_gb=budget_gib - args.budget_margin_gib,
            layers=num_model_layers(),
            lengths=[length],
            new_tokens=args.capacity_new_tokens,
            buffer_size=args.buffer_size or 4096,
            recent_window=args.recent_window,
            max_units=offload_max_units(
                args.max_units,
                args.buffer_size,
                args.context_length,
                args.recent_window,
            ),
            context_len=args.context_length,
            prefill_budget=16384,  # max(chunked_prefill_size, max_prefill_tokens)
        )
    )
    return rows[0]


def capacity_rows(
    base: dict, offload: dict, region_rows: int, hisparse: Optional[dict] = None
) -> list:
    """Measured capacity per length: raw (same --mem-fraction-static) and at
    equal GPU bytes. Upstream's fp8 NSA pool sizing counts 576 B per KV row
    but allocates 656 B, so the no-offload server takes ~11% more GPU memory
    than the budget it was given; its capacity scales linearly with its pool
    bytes, so it is rescaled to the offload server's pool bytes. HiSparse
    (if run) is compared the same way: requests per GiB of pools."""
    rows = []
    for key, ours in offload.items():
        b = base.get("capacity", {}).get(key)
        if b is None:
            continue
        o = ours["capacity"][key]
        tokens = o["length"] + o["new_tokens"]
        bound = capacity_bound(tokens, region_rows)
        row = {
            "length": o["length"],
            "baseline_peak": b["peak_running"],
            "offload_peak": o["peak_running"],
            "offload_regions": o["regions"],
            "baseline_saturated": b.get("saturated"),
            "offload_saturated": o.get("saturated"),
            "ratio_same_fraction": o["peak_running"] / max(b["peak_running"], 1),
            "bound": bound,
            "baseline_pools_gib": base["memory"].get("pools_gib"),
            "offload_pools_gib": ours["memory"].get("pools_gib"),
            "model": ours.get("model"),
            "all_completed": (
                None
                if None in (b["completed"], o["completed"])
                else b["completed"] == b["sent"] and o["completed"] == o["sent"]
            ),
        }
        if row["baseline_pools_gib"] and row["offload_pools_gib"]:
            scale = row["offload_pools_gib"] / row["baseline_pools_gib"]
            row["baseline_at_equal_bytes"] = b["peak_running"] * scale
            row["ratio_equal_bytes"] = o["peak_running"] / (b["peak_running"] * scale)
            row["equal_bytes_vs_bound"] = row["ratio_equal_bytes"] / bound
        h = (hisparse or {}).get("capacity", {}).get(key)
        if h is not None:
            row["hisparse_peak"] = h["peak_running"]
            row["hisparse_saturated"] = h.get("saturated")
            row["hisparse_pools_gib"] = hisparse["memory"].get("pools_gib")
            row["vs_hisparse_same_fraction"] = o["peak_running"] / max(
                h["peak_running"], 1
            )
            if row["hisparse_pools_gib"] and row["offload_pools_gib"]:
                scale = row["offload_pools_gib"] / row["hisparse_pools_gib"]
                row["vs_hisparse_equal_bytes"] = o["peak_running"] / max(
                    h["peak_running"] * scale, 1e-9
                )
        rows.append(row)
    return sorted(rows, key=lambda r: r["length"])


DRIVER_PREDICTED_RE = re.compile(
    r"^\[(\S+)\] capacity (\d+): predicted (\d+), sending (\d+)", re.M
)
DRIVER_PEAK_RE = re.compile(r"^\[(\S+)\] capacity (\d+): peak running (\d+)", re.M)


def _unzipped(run_dir: str) -> str:
    """``run_dir``, or a temporary copy with its ``*.gz`` files unpacked
    (committed results keep server logs gzipped)."""
    gz = [f for f in os.listdir(run_dir) if f.endswith(".gz")]
    if not gz:
        return run_dir
    tmp = tempfile.mkdtemp(prefix="e2e_run_")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    for f in os.listdir(run_dir):
        src = os.path.join(run_dir, f)
        if f.endswith(".gz"):
            with gzip.open(src) as fin, open(os.path.join(tmp, f[:-3]), "wb") as fout:
                shutil.copyfileobj(fin, fout)
        elif os.path.isfile(src):
            shutil.copy(src, tmp)
    return tmp


def load_run(run_dir: str, new_tokens: int) -> tuple:
    """(no-offload result, {length: offload result}, HiSparse result or None)
    of an earlier run: its ``e2e_server.json``, or, for a run cut before
    writing it, this script's own output (``RUN_DIR/driver.log``: predicted /
    sent / peak per phase) and the server logs (memory). Requests completed
    are then unknown."""
    run_dir = _unzipped(run_dir)
    path = os.path.join(run_dir, "e2e_server.json")
    if os.path.exists(path):
        with open(path) as f:
            r = json.load(f)
        # A --baseline-from run carries another run's no-offload result,
        # whose log is in that run: the report takes it from there.
        base = None if r.get("baseline_from") else r.get("baseline")
        return base, r.get("offload", {}), r.get("hisparse")
    with open(os.path.join(run_dir, "driver.log")) as f:
        text = f.read()
    servers: dict = {}
    for name, length, predicted, sent in DRIVER_PREDICTED_RE.findall(text):
        servers.setdefault(name, {"name": name, "capacity": {}})["capacity"][length] = {
            "length": int(length),
            "new_tokens": new_tokens,
            "predicted": int(predicted),
            "sent": int(sent),
            "completed": None,
        }
    for name, length, peak in DRIVER_PEAK_RE.findall(text):
        servers[name]["capacity"][length]["peak_running"] = int(peak)
    for name, res in servers.items():
        log_path = os.path.join(run_dir, f"server_{name}.log")
        res["memory"] = memory_from_log(log_path)
        regions = scan_log(log_path)[2]
        for c in res["capacity"].values():
            c["regions"] = regions
        # a phase the run was cut in has no peak
        res["capacity"] = {
            k: c for k, c in res["capacity"].items() if "peak_running" in c
        }
    base = servers.pop("baseline", None)
    hisparse = servers.pop("hisparse", None)
    offload = {}
    for res in servers.values():
        for length in res["capacity"]:
            offload[length] = res
    return base, offload, hisparse


def report_from_runs(args) -> None:
    """One capacity table from several runs (each offload length with the
    no-offload and HiSparse results of its own run if it has them, else of
    another run), plus the decode throughput each server reached at its
    capacity (``throughput.md``)."""
    rows = []
    region_rows = (args.buffer_size or 4096) + args.recent_window
    sizing = "decode_only" if args.pd_decode else "colocated"
    loaded = [(d, *load_run(d, args.capacity_new_tokens)) for d in args.runs]

    def first_with(length, own_dir, own, kind):
        """(run dir, result) of ``kind`` with a phase at ``length``."""
        pos = 1 if kind == "baseline" else 3
        ordered = [(own_dir, own)] + [(run[0], run[pos]) for run in loaded]
        return next(
            ((d, r) for d, r in ordered if r and length in r.get("capacity", {})),
            (None, None),
        )

    for run_dir, base, offload, hisparse in loaded:
        for length, ours in offload.items():
            base_dir, b = first_with(length, run_dir, base, "baseline")
            if b is None:
                continue
            his_dir, h = first_with(length, run_dir, hisparse, "hisparse")
            if ours.get("model") is None:
                ours["model"] = offload_regions_for(
                    int(length), b["memory"]["budget_gib"], args
                )
            for row in capacity_rows(b, {length: ours}, region_rows, h):
                row.update(offload_run=run_dir, baseline_run=base_dir)
                if his_dir:
                    row["hisparse_run"] = his_dir
                row["throughput"] = {
                    kind: throughput_at_capacity(_log_of(d, name), res, length)
                    for kind, d, name, res in (
                        ("baseline", base_dir, "baseline", b),
                        ("offload", run_dir, ours.get("name"), ours),
                        ("hisparse", his_dir, "hisparse", h),
                    )
                    if d and name
                }
                rows.append(row)
    rows.sort(key=lambda r: r["length"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "capacity.json"), "w") as f:
        json.dump({"config": vars(args), "rows": rows}, f, indent=1)
    write_capacity_report(rows, args.out, sizing)
    write_throughput_report(rows, args.out)


def _log_of(run_dir: str, name: str) -> Optional[str]:
    path = os.path.join(_unzipped(run_dir), f"server_{name}.log")
    return path if os.path.exists(path) else None


DECODE_LINE_RE = re.compile(
    r"#running-req: (\d+), .*?#(?:cpu )?token: (\d+), .*?cuda graph: (\w+), "
    r"gen throughput \(token/s\): ([0-9.]+)(?:.*?nsa-offload hit rate: ([0-9.]+))?"
)


def throughput_at_capacity(
    log_path: Optional[str], result: dict, length: str
) -> Optional[dict]:
    """Decode throughput of one capacity phase while the server held (nearly)
    its peak: median over the decode log lines of that phase with
    ``#running-req >= 0.95 x peak``. A server that ran several lengths logs
    them one after another; a line belongs to the phase whose request length
    (prompt + half the output) is nearest to its tokens per running request."""
    if log_path is None:
        return None
    phases = result["capacity"]
    mids = {k: c["length"] + c["new_tokens"] / 2 for k, c in phases.items()}
    peak = phases[length]["peak_running"]
    lines = []
    with open(log_path, errors="replace") as f:
        for m in DECODE_LINE_RE.finditer(f.read()):
            running, tokens = int(m.group(1)), int(m.group(2))
            if running < max(0.95 * peak, 1):
                continue
            if len(mids) > 1:
                if tokens == 0:
                    continue
                per_req = tokens / running
                if min(mids, key=lambda k: abs(math.log(per_req / mids[k]))) != length:
                    continue
            lines.append((running, float(m.group(4)), m.group(5), m.group(3)))
    if not lines:
        return None
    tok_s = statistics.median(x[1] for x in lines)
    running = statistics.median(x[0] for x in lines)
    hits = [float(x[2]) for x in lines if x[2] is not None]
    return {
        "log_lines": len(lines),
        "running": running,
        "tokens_per_s": tok_s,
        "step_ms": 1000.0 * running / tok_s if tok_s else None,
        "offload_hit_rate": statistics.median(hits) if hits else None,
        # batches above --cuda-graph-max-bs-decode run eagerly (much slower)
        "cuda_graph_share": sum(x[3] == "True" for x in lines) / len(lines),
    }


def write_throughput_report(rows: list, out: str) -> None:
    """Throughput at fixed GPU memory: each server at its own capacity."""

    def tput(row, kind, key="tokens_per_s", fmt="{:.0f}"):
        t = (row.get("throughput") or {}).get(kind)
        return "-" if not t or t.get(key) is None else fmt.format(t[key])

    def ratio(row, a, b):
        ta, tb = ((row.get("throughput") or {}).get(k) for k in (a, b))
        if not ta or not tb:
            return "-"
        return f"{ta['tokens_per_s'] / tb['tokens_per_s']:.2f}"

    lines = [
        "| length (+new) | no offload tok/s (running, step ms, CUDA graph) | ours "
        "tok/s (running, step ms, CUDA graph, hit rate) | HiSparse tok/s (running, "
        "step ms, CUDA graph) | "
        "ours / no offload | ours / HiSparse |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for kind in ("baseline", "offload", "hisparse"):
            extra = [
                tput(r, kind, "running"),
                tput(r, kind, "step_ms", "{:.1f}"),
                tput(r, kind, "cuda_graph_share", "{:.0%}"),
            ]
            if kind == "offload":
                extra.append(tput(r, kind, "offload_hit_rate", "{:.3f}"))
            cells.append(f"{tput(r, kind)} ({', '.join(extra)})")
        lines.append(
            f"| {r['length']} | {' | '.join(cells)} | {ratio(r, 'offload', 'baseline')} "
            f"| {ratio(r, 'offload', 'hisparse')} |"
        )
    _write_table(lines, os.path.join(out, "throughput.md"))
    plot = _length_plot(rows)
    if plot is None:
        return
    fig, ax, x = plot
    for kind, label in (
        ("baseline", "no offload"),
        ("offload", "ours"),
        ("hisparse", "HiSparse"),
    ):
        y = [((r.get("throughput") or {}).get(kind) or {}) for r in rows]
        ax.plot(x, [t.get("tokens_per_s") for t in y], "o-", label=label)
    _save_length_plot(
        fig,
        ax,
        x,
        "decode tokens/s, each server at its capacity",
        os.path.join(out, "throughput.png"),
    )


def _write_table(lines: list, path: str) -> None:
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def _length_plot(rows: list):
    """(figure, axes, x in K tokens) for a curve over request lengths; None
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    return fig, ax, [r["length"] // 1024 for r in rows]


def _save_length_plot(fig, ax, x: list, ylabel: str, path: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(x)
    ax.set_xticklabels([f"{v}K" for v in x])
    ax.set_xlabel("request length (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _peak(row: dict, server: str) -> str:
    """Peak running requests; marked when the phase never filled the server
    (requests finished before the last ones were admitted)."""
    peak = row.get(f"{server}_peak", "-")
    return (
        f"{peak} (not saturated)"
        if row.get(f"{server}_saturated") is False
        else str(peak)
    )


def write_capacity_report(rows: list, out: str, sizing: str = "colocated") -> None:
    """``sizing``: the offload's sizing model, ``colocated`` (prefill staging)
    or ``decode_only`` (PD decode server)."""
    nan = float("nan")
    his = any("hisparse_peak" in r for r in rows)
    head = (
        "| length (+new) | no offload: peak running | pools GiB | offload: regions | "
        "peak running | pools GiB | ratio (same fraction) | ratio (equal bytes) | "
        f"bound | equal bytes / bound | model ({sizing}) | all completed |"
    )
    if his:
        head += " HiSparse: peak running | pools GiB | ours / HiSparse (equal bytes) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        m = r.get("model") or {}
        line = (
            f"| {r['length']} | {_peak(r, 'baseline')} | {r['baseline_pools_gib']} | "
            f"{r['offload_regions']} | {_peak(r, 'offload')} | {r['offload_pools_gib']} | "
            f"{r['ratio_same_fraction']:.2f} | {r.get('ratio_equal_bytes', nan):.2f} | "
            f"{r['bound']:.2f} | {r.get('equal_bytes_vs_bound', nan):.2f} | "
            f"{m.get(sizing + '_ratio', nan):.2f} | "
            f"{'not recorded' if r['all_completed'] is None else r['all_completed']} |"
        )
        if his:
            line += (
                f" {_peak(r, 'hisparse')} | {r.get('hisparse_pools_gib', '-')} | "
                f"{r.get('vs_hisparse_equal_bytes', nan):.2f} |"
            )
        lines.append(line)
    _write_table(lines, os.path.join(out, "capacity.md"))
    plot = _length_plot(rows)
    if plot is None:
        return
    fig, ax, x = plot
    ax.plot(
        x, [r["bound"] for r in rows], "k--", label="bound L(656+132)/(L 132 + R 656)"
    )
    ax.plot(
        x,
        [r.get("ratio_equal_bytes") for r in rows],
        "o-",
        label="measured, equal GPU bytes",
    )
    ax.plot(
        x,
        [r["ratio_same_fraction"] for r in rows],
        "s:",
        label="measured, same --mem-fraction-static",
    )
    ax.plot(
        x,
        [(r.get("model") or {}).get(sizing + "_ratio") for r in rows],
        "^-.",
        label=f"sizing model ({sizing})",
    )
    _save_length_plot(
        fig,
        ax,
        x,
        "running requests: offload / no offload",
        os.path.join(out, "capacity.png"),
    )


def _pool_servers(run_dir: str) -> dict:
    """{kind: {length or None: pool sizes and GiB}} of one run's server logs."""
    import bench_server

    servers = {}
    run_dir = _unzipped(run_dir)
    for f in sorted(os.listdir(run_dir)):
        m = re.fullmatch(r"server_(baseline|hisparse|offload_(\d+)k)\.log", f)
        if not m:
            continue
        path = os.path.join(run_dir, f)
        kind = "ours" if m.group(2) else m.group(1)
        length = int(m.group(2)) * 1024 if m.group(2) else None
        servers.setdefault(kind, {})[length] = {
            "pool": bench_server.parse_startup(path),
            "pools_gib": memory_from_log(path).get("pools_gib"),
        }
    return servers


def pool_report(args) -> list:
    """Capacity of every server of each run (the lengths of its offload
    servers) from the pool sizes it logged at startup (``bench_server.capacity``:
    what its allocator admits at most), compared at equal GPU bytes. In the
    colocated runs the measured peaks equal these counts whenever a phase
    filled the server. No offload and HiSparse are counted by their pools
    alone (their request slots are only a flag; marked where the run had
    fewer); ours also by its decode regions, which are GPU memory."""
    import bench_server

    region_rows = args.buffer_size + args.recent_window
    rows = []
    for run in args.runs:
        servers = _pool_servers(run)
        for length in sorted(servers.get("ours", {})):
            tokens = length + args.new_tokens
            row = {"run": os.path.basename(os.path.normpath(run)), "length": length}
            for kind in ("baseline", "ours", "hisparse"):
                per_length = servers.get(kind, {})
                entry = per_length.get(length) or per_length.get(None)
                if entry is None:
                    continue
                pool = dict(entry["pool"])
                slots = pool.get("max_running_requests")
                if kind != "ours":
                    # Request slots are a flag there, not memory: count the pools.
                    pool["max_running_requests"] = 1 << 30
                n = bench_server.capacity(
                    kind, pool, length, args.new_tokens, pd_decode=args.pd_decode
                )
                row[kind] = n
                if kind != "ours" and n is not None and slots is not None and n > slots:
                    row[f"{kind}_slots"] = slots
                row[f"{kind}_pools_gib"] = entry["pools_gib"]
            row["bound"] = capacity_bound(tokens, region_rows)

            def per_gib(kind):
                n, gib = row.get(kind), row.get(f"{kind}_pools_gib")
                return n / gib if n is not None and gib else None

            for other in ("baseline", "hisparse"):
                if per_gib("ours") is not None and per_gib(other):
                    row[f"ours_vs_{other}_equal_bytes"] = per_gib("ours") / per_gib(
                        other
                    )
            if "ours_vs_baseline_equal_bytes" in row:
                row["vs_bound"] = row["ours_vs_baseline_equal_bytes"] / row["bound"]
            rows.append(row)
    rows.sort(key=lambda r: r["length"])

    def cell(row, key, fmt="{}"):
        v = row.get(key)
        if v is None:
            return "-"
        slots = row.get(f"{key}_slots")
        return fmt.format(v) + (f" (ran with {slots} slots)" if slots else "")

    lines = [
        "| length (+new) | no offload | GiB | ours | GiB | HiSparse | GiB | "
        "ours / no offload (equal bytes) | bound | of bound | "
        "ours / HiSparse (equal bytes) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['length']} | {cell(r, 'baseline')} | {cell(r, 'baseline_pools_gib')} "
            f"| {cell(r, 'ours')} | {cell(r, 'ours_pools_gib')} | {cell(r, 'hisparse')} "
            f"| {cell(r, 'hisparse_pools_gib')} "
            f"| {cell(r, 'ours_vs_baseline_equal_bytes', '{:.2f}')} "
            f"| {r['bound']:.2f} | {cell(r, 'vs_bound', '{:.2f}')} "
            f"| {cell(r, 'ours_vs_hisparse_equal_bytes', '{:.2f}')} |"
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pool_capacity.json"), "w") as f:
        json.dump({"config": vars(args), "rows": rows}, f, indent=1)
    _write_table(lines, os.path.join(args.out, "pool_capacity.md"))
    return rows


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("model")
    m.add_argument(
        "--out",
        required=True,
        help="output directory (created) for the JSON/markdown results",
    )
    m.add_argument("--layers", type=int, default=61, help="model layers")
    m.add_argument("--budget-gb", type=float, default=80.0, help="GPU KV budget, GB")
    m.add_argument(
        "--lengths",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[16384, 32768, 65536, 131072],
        help="comma-separated request lengths (prompt + output, tokens)",
    )
    m.add_argument(
        "--new-tokens", type=int, default=0, help="output tokens per request"
    )
    m.add_argument(
        "--buffer-size",
        type=int,
        default=4096,
        help="LRU rows per request and layer (C)",
    )
    m.add_argument(
        "--recent-window",
        type=int,
        default=64,
        help="recent-window rows per request (W)",
    )
    m.add_argument(
        "--max-units",
        type=int,
        help="LRU units a request may hold (--nsa-kv-offload-max-units; default: "
        "the server's)",
    )
    m.add_argument(
        "--context-len",
        type=int,
        default=131072 + 4096,
        help="server context length (sizes prefill staging)",
    )
    m.add_argument(
        "--prefill-budget",
        type=int,
        default=16384,
        help="tokens of one prefill batch (sizes staging)",
    )
    r = sub.add_parser("report", help="capacity table from e2e_server.py runs")
    r.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="run directories written by e2e_server.py",
    )
    r.add_argument(
        "--out",
        required=True,
        help="output directory (created) for the JSON/markdown results",
    )
    r.add_argument(
        "--context-length",
        type=int,
        required=True,
        help="server context length of the runs",
    )
    r.add_argument(
        "--capacity-new-tokens",
        type=int,
        required=True,
        help="output tokens per request in the runs",
    )
    r.add_argument(
        "--buffer-size",
        type=int,
        default=None,
        help="LRU rows per request and layer (C)",
    )
    r.add_argument(
        "--recent-window",
        type=int,
        default=64,
        help="recent-window rows per request (W)",
    )
    r.add_argument(
        "--budget-margin-gib",
        type=float,
        default=0.02,
        help="GiB the runs' budget was lowered by",
    )
    r.add_argument(
        "--max-units",
        type=int,
        default=1,
        help="the runs' --nsa-kv-offload-max-units (runs before units: 1)",
    )
    r.add_argument(
        "--pd-decode",
        action="store_true",
        help="PD decode servers (decode-only sizing)",
    )
    q = sub.add_parser(
        "pool-report",
        help="capacity per server from the pool sizes its log shows (e2e_server.py runs)",
    )
    q.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="run directories written by e2e_server.py",
    )
    q.add_argument(
        "--out",
        required=True,
        help="output directory (created) for the JSON/markdown results",
    )
    q.add_argument(
        "--new-tokens", type=int, required=True, help="output tokens per request"
    )
    q.add_argument("--pd-decode", action="store_true", help="PD decode servers")
    q.add_argument(
        "--buffer-size",
        type=int,
        default=4096,
        help="LRU rows per request and layer (C)",
    )
    q.add_argument(
        "--recent-window",
        type=int,
        default=64,
        help="recent-window rows per request (W)",
    )
    args = p.parse_args()
    if args.mode == "report":
        report_from_runs(args)
    elif args.mode == "pool-report":
        pool_report(args)
    else:
        write_model(args)


if __name__ == "__main__":
    main()
