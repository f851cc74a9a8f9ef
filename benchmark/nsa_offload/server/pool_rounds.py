"""Pool the paired rounds of several interleaved server benchmark runs.

One ``bench_server.py --interleave`` run of a few rounds says little on this
host-bound model (one round's ratio swings by +-20%); several runs of the same
configuration pooled say more. For every offload server of every run (ours,
ours + prefetch, HiSparse) and every equal-batch point, this takes the
per-round ITL ratios against the same run's no-offload server and pools them
over the runs that share a configuration (server, GPU buffer rows, top-k
source), then prints the median overhead, its interquartile range (how far
one round swings) and a bootstrap 95% interval of the median (where the
pooled figure itself lies):

    python benchmark/nsa_offload/server/pool_rounds.py RUN/bench_server_override.json ... \\
        [--out pooled.md] [--json pooled.json] [--png tradeoff.png] \\
        [--png-servers servers.png]

``--png`` plots ours' pooled overhead against its GPU buffer rows next to the
capacity bound at 128K that those rows leave (``capacity_bound_128k``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_server  # noqa: E402
import capacity  # noqa: E402

OFFLOAD_KINDS = bench_server.OFFLOAD_KINDS + ("hisparse",)
DEFAULT_BUFFER_SIZE = 4096  # the server's default: 2 x index_topk

Config = Tuple[str, int, str]  # (server kind, LRU rows, top-k source)


def ours_units(cfg: dict, kind: str) -> int:
    """LRU units one request of this server could hold."""
    if kind == "ours_units":  # session 9: units by environment variable
        return cfg.get("max_units") or 1
    if kind in ("ours", "ours_prefetch"):  # runs before units: one
        return cfg.get("ours_max_units", 1)
    return 1


def run_config(result: dict, kind: str) -> Config:
    cfg = result["config"]
    if kind == "hisparse":
        rows = bench_server.HISPARSE_CONFIG["device_buffer_size"]
    else:
        rows = cfg.get("buffer_size") or DEFAULT_BUFFER_SIZE
        # At most this many rows (units are lent while GPU rows are idle).
        rows *= ours_units(cfg, kind)
    return kind, rows, cfg["topk"]


def pool_runs(results: List[dict], names: List[str]) -> List[dict]:
    """One row per (configuration, context, batch): the pooled paired
    overhead over every run that measured it, and each run's own median."""
    pooled: Dict[Tuple[Config, int, int], dict] = {}
    for name, result in zip(names, results):
        base = result["servers"].get("baseline")
        if base is None:
            continue
        for kind in OFFLOAD_KINDS:
            srv = result["servers"].get(kind)
            if srv is None:
                continue
            for p in srv.get("points", []):
                if "skipped" in p or p.get("at_capacity"):
                    continue
                b = bench_server._point(base, p["ctx"], p["conc"])
                ratios = bench_server._paired_ratios(p, b) if b else []
                if not ratios:
                    continue
                key = (run_config(result, kind), p["ctx"], p["conc"])
                row = pooled.setdefault(key, {"ratios": [], "runs": []})
                row["ratios"] += ratios
                row["runs"].append(
                    {
                        "run": name,
                        "rounds": len(ratios),
                        "overhead": bench_server.paired_overhead(ratios)[0],
                        "misses_per_step": p["server"].get("misses_per_step"),
                    }
                )
    rows = []
    for ((kind, buf, topk), ctx, conc), row in sorted(pooled.items()):
        ratios = row.pop("ratios")
        overhead, iqr = bench_server.paired_overhead(ratios)
        rows.append(
            {
                "server": kind,
                "buffer_rows": buf,
                "topk": topk,
                "ctx": ctx,
                "conc": conc,
                "rounds": len(ratios),
                "overhead": overhead,
                "overhead_iqr": iqr,
                "overhead_ci95": bench_server.median_ci95(ratios),
                **row,
            }
        )
    return rows


def capacity_bound_128k(buffer_rows: int, window: int = 64) -> float:
    """``capacity.capacity_bound`` at 128K with R = buffer + window rows."""
    return capacity.capacity_bound(131072, buffer_rows + window)


def plot_tradeoff(rows: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in rows if r["server"] == "ours" and r["topk"] == "override"]
    fig, (ax, ax_cap) = plt.subplots(1, 2, figsize=(11, 4.2))
    points = sorted({(r["ctx"], r["conc"]) for r in ours})
    for i, (ctx, conc) in enumerate(points):
        line = sorted(
            (r for r in ours if (r["ctx"], r["conc"]) == (ctx, conc)),
            key=lambda r: r["buffer_rows"],
        )
        x = np.array([r["buffer_rows"] for r in line]) * (1 + 0.02 * (i - 1.5))
        y = np.array([r["overhead"] for r in line]) * 100
        lo = y - np.array([r["overhead_iqr"][0] for r in line]) * 100
        hi = np.array([r["overhead_iqr"][1] for r in line]) * 100 - y
        ax.errorbar(
            x, y, yerr=[lo, hi], marker="o", capsize=3, label=f"{ctx // 1024}K x {conc}"
        )
    _p4_axes(ax, "ours' GPU buffer rows per request and layer")
    buffers = np.linspace(2048, 16384, 57)
    ax_cap.plot(buffers, [capacity_bound_128k(int(b)) for b in buffers])
    for b in sorted({r["buffer_rows"] for r in ours}):
        c = capacity_bound_128k(b)
        ax_cap.plot([b], [c], "o", color="tab:blue")
        ax_cap.annotate(f"{c:.2f}x", (b, c), textcoords="offset points", xytext=(5, 5))
    ax_cap.axhline(5.0, color="gray", ls="--", lw=1, label="P3 target 5.0x")
    ax_cap.set_xlabel("ours' GPU buffer rows per request and layer")
    ax_cap.set_ylabel("128K requests per no-offload request (bound)")
    ax_cap.set_title("P3: capacity those rows leave at 128K")
    ax_cap.legend(fontsize=8)
    _save(fig, path)


def _p4_axes(ax, xlabel: str) -> None:
    """Target and zero lines, labels of a pooled-overhead plot."""
    ax.axhline(10, color="gray", ls="--", lw=1, label="P4 target +10%")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ITL vs no offload, pooled paired rounds (%)")
    ax.set_title("P4: overhead at equal batch (median, IQR)")
    ax.legend(fontsize=8)


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_servers(rows: List[dict], path: str) -> None:
    """Each configuration's pooled overhead per point, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["topk"] == "override"]
    points = sorted({(r["ctx"], r["conc"]) for r in rows})
    configs = sorted({(r["server"], r["buffer_rows"]) for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(configs)
    for j, (server, buffer_rows) in enumerate(configs):
        by_point = {
            (r["ctx"], r["conc"]): r
            for r in rows
            if (r["server"], r["buffer_rows"]) == (server, buffer_rows)
        }
        x, y, err = [], [], [[], []]
        for i, pt in enumerate(points):
            r = by_point.get(pt)
            if r is None:
                continue
            x.append(i + (j - (len(configs) - 1) / 2) * width)
            y.append(r["overhead"] * 100)
            err[0].append((r["overhead"] - r["overhead_iqr"][0]) * 100)
            err[1].append((r["overhead_iqr"][1] - r["overhead"]) * 100)
        label = f"{bench_server.LABELS[server]} (up to {buffer_rows} rows)"
        ax.bar(x, y, width, yerr=err, capsize=3, label=label)
    ax.set_xticks(range(len(points)))
    ax.set_xticklabels([f"{c // 1024}K x {b}" for c, b in points])
    _p4_axes(ax, "context x batch")
    _save(fig, path)


def render_markdown(rows: List[dict]) -> str:
    lines = [
        "| server | GPU buffer rows | top-k | context | batch | runs | rounds "
        "| ITL overhead vs no offload: pooled median (IQR) | median's 95% interval "
        "| per run | misses/step |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lo, hi = r["overhead_iqr"]
        ci_lo, ci_hi = r["overhead_ci95"]
        per_run = ", ".join(f"{x['overhead']:+.0%} ({x['rounds']})" for x in r["runs"])
        misses = [x["misses_per_step"] for x in r["runs"] if x["misses_per_step"]]
        misses_cell = f"{statistics.median(misses):.0f}" if misses else "-"
        lines.append(
            f"| {bench_server.LABELS[r['server']]} | {r['buffer_rows']} | {r['topk']} "
            f"| {r['ctx'] // 1024}K | {r['conc']} | {len(r['runs'])} | {r['rounds']} "
            f"| {r['overhead']:+.1%} ({lo:+.0%}..{hi:+.0%}) "
            f"| {ci_lo:+.1%}..{ci_hi:+.1%} | {per_run} "
            f"| {misses_cell} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="bench_server JSON files (--interleave)")
    p.add_argument("--out", help="write the Markdown table here")
    p.add_argument("--json", help="write the pooled rows here")
    p.add_argument("--png", help="plot ours' overhead vs buffer rows here")
    p.add_argument(
        "--png-servers", help="plot every configuration's overhead per point here"
    )
    args = p.parse_args(argv)
    results = [json.loads(Path(f).read_text()) for f in args.runs]
    names = [str(Path(f).parent.name or f) for f in args.runs]
    rows = pool_runs(results, names)
    if not rows:
        print("no interleaved runs with a no-offload server among the inputs")
        return 1
    md = render_markdown(rows)
    print(md, end="")
    if args.out:
        Path(args.out).write_text(md)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.png:
        plot_tradeoff(rows, args.png)
    if args.png_servers:
        plot_servers(rows, args.png_servers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
