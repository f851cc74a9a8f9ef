"""Cross-layer prefetch on calibrated traces (CPU replay).

The engine's cross-layer prefetch (an experiment, since removed from the
offload) swapped layer l's top-k into layer l+1's LRU slots right after layer
l's swap, on a second stream, so that layer l+1's own swap missed only what
the two layers do not share (adjacent DSA layers share 70-100% of their
top-k, IndexCache). This replays that policy (``OursLRU.step`` on the previous layer's top-k, then on
the layer's own: the engine's residency and recency rules) next to ours without
prefetch and HiSparse, per (request, layer, decode step) in the steady state:

* demand misses: loads the layer's attention waits for (the P6 metric);
* prefetch loads: loads issued one layer ahead, off the critical path when
  they finish within the previous layer's attention + MLP + this layer's
  indexer;
* total H2D rows: both, what PCIe carries.

Only traces that hold consecutive model layers tell anything (the embedded
default trace has layers 0, 20, 21, 40, 60: only 20 -> 21 are neighbours).

    python benchmark/nsa_offload/traces/trace_gen.py --out /tmp/dsv32_61l_68k.npz \\
        --requests 1 --prompt-lens 68000 --steps 32 --seed 0
    python benchmark/nsa_offload/traces/prefetch_study.py --out-dir \\
        benchmark/nsa_offload/results/prefetch_study 61l=/tmp/dsv32_61l_68k.npz
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from policy_study import prev_layer_index, request_layer_steps  # noqa: E402
from replay import DEFAULT_WARMUP, HiSparseLRU, OursLRU, steady_mask  # noqa: E402
from trace_format import NSATopkTrace, load_trace  # noqa: E402


def study(
    trace: NSATopkTrace, budget: int, window: int, warmup: int = DEFAULT_WARMUP
) -> Dict:
    """Misses per (request, layer, step) of HiSparse, ours and ours + prefetch
    at ``budget`` GPU rows per (request, layer)."""
    L = trace.topk.shape[1]
    lru_slots = budget - window
    steady = steady_mask(trace, warmup)
    prev = prev_layer_index(trace)  # the model layer before, if recorded
    states: Dict[tuple, tuple] = {}
    totals = dict.fromkeys(("hisparse", "ours", "demand", "prefetch"), 0)
    for s, b, n, li, max_pos in request_layer_steps(trace):
        key = (li, b)
        if key not in states:
            states[key] = (
                HiSparseLRU(budget - 1, max_pos),
                OursLRU(lru_slots, window, max_pos),
                OursLRU(lru_slots, window, max_pos),
            )
        his, ours, pre = states[key]
        pos = trace.topk[s, li, b]
        counts = {
            "hisparse": his.step(pos, n).misses,
            "ours": ours.step(pos, n).misses,
            "prefetch": (
                0
                if prev[li] is None
                else pre.step(trace.topk[s, prev[li], b], n).misses
            ),
        }
        counts["demand"] = pre.step(pos, n).misses
        if steady[s, b]:
            for k, v in counts.items():
                totals[k] += v
    rows = max(int(steady.sum()) * L, 1)
    per = {k: v / rows for k, v in totals.items()}
    his = per["hisparse"] or 1.0
    return {
        "budget": budget,
        "window": window,
        "consecutive_layer_pairs": sum(p is not None for p in prev),
        "per_row": per,
        "ours_vs_hisparse": per["ours"] / his,
        "demand_vs_hisparse": per["demand"] / his,
        "total_h2d_vs_hisparse": (per["demand"] + per["prefetch"]) / his,
    }


def as_served(trace: NSATopkTrace, model_layers: int) -> NSATopkTrace:
    """The trace as the benchmark's top-k override feeds it to a model with
    ``model_layers`` layers: model layer i reads the trace layer whose id is
    nearest to round(i (L_src - 1) / (model_layers - 1)), so the served layers
    are consecutive even where the trace's are not (the tiny 3-layer model
    reads DeepSeek-V3.2 layers 0, 30 and 60 as its layers 0, 1 and 2)."""
    src = int(trace.metadata.get("num_model_layers", int(trace.layer_ids.max()) + 1))
    picks = []
    for i in range(model_layers):
        target = round(i * (src - 1) / max(model_layers - 1, 1))
        picks.append(int(np.argmin(np.abs(trace.layer_ids - target))))
    metadata = dict(trace.metadata, num_model_layers=model_layers)
    return NSATopkTrace(
        trace.topk[:, picks],
        trace.seq_lens,
        np.arange(model_layers, dtype=np.int32),
        trace.request_ids,
        metadata,
    )


def render(results: Dict[str, List[Dict]]) -> str:
    lines = [
        "| trace | B | HiSparse | ours | ours + prefetch: demand | ratio | prefetch "
        "loads | total H2D rows | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rows in results.items():
        for r in rows:
            p = r["per_row"]
            lines.append(
                f"| {name} | {r['budget']} | {p['hisparse']:.1f} | {p['ours']:.1f} "
                f"| {p['demand']:.1f} | {r['demand_vs_hisparse']:.3f} "
                f"| {p['prefetch']:.1f} | {p['demand'] + p['prefetch']:.1f} "
                f"| {r['total_h2d_vs_hisparse']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: Dict[str, List[Dict]], path: str) -> None:
    """Per trace, at each trace's middle budget: misses per (request, layer,
    step) of HiSparse, ours, ours + prefetch (demand) and its total H2D rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(results)
    picks = [rows[len(rows) // 2] for rows in results.values()]
    series = [
        ("HiSparse", lambda r: r["per_row"]["hisparse"]),
        ("ours", lambda r: r["per_row"]["ours"]),
        ("ours + prefetch: demand", lambda r: r["per_row"]["demand"]),
        (
            "ours + prefetch: total H2D",
            lambda r: r["per_row"]["demand"] + r["per_row"]["prefetch"],
        ),
    ]
    x = np.arange(len(names))
    w = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (label, get) in enumerate(series):
        ax.bar(x + i * w, [get(r) for r in picks], w, label=label)
    ax.set_xticks(x + w * (len(series) - 1) / 2)
    ax.set_xticklabels(
        [f"{n}\nB={r['budget']}" for n, r in zip(names, picks)], fontsize=8
    )
    ax.set_ylabel("rows per (request, layer, step)")
    ax.set_title("cross-layer prefetch: demand misses vs rows moved")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "traces", nargs="+", metavar="NAME=PATH", help="traces to study, as NAME=PATH"
    )
    p.add_argument("--out-dir", help="folder for the results (default: print only)")
    p.add_argument(
        "--budgets",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[4160],
        help="comma-separated LRU rows per request and layer",
    )
    p.add_argument(
        "--window", type=int, default=64, help="recent-window rows per request (W)"
    )
    p.add_argument(
        "--served-to-layers",
        type=int,
        help="replay each trace as the top-k override serves it to a model with "
        "this many layers (3: the tiny model of the server benchmark)",
    )
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    results: Dict[str, List[Dict]] = {}
    for spec in args.traces:
        name, _, path = spec.partition("=")
        trace = load_trace(path)
        if args.served_to_layers:
            trace = as_served(trace, args.served_to_layers)
        results[name] = [study(trace, b, args.window) for b in args.budgets]
    md = render(results)
    print(md, end="")
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
            json.dump(
                {
                    "traces": dict(t.split("=", 1) for t in args.traces),
                    "results": results,
                },
                f,
                indent=1,
            )
        with open(os.path.join(args.out_dir, "summary.md"), "w") as f:
            f.write(md)
        plot(results, os.path.join(args.out_dir, "prefetch.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
