"""Sensitivity of the ours-vs-HiSparse comparison to the trace model's assumptions.

The published statistics fix the consecutive-step overlap, the adjacent-layer
overlap, sinks and "recency"; they do not fix how fast reuse decays with the lag
(``--long-memory``) nor the exact shape of the recency profile. This script
regenerates the deep-layer part of the default trace under variations of those
free parameters (and two what-if overlap levels), replays each variant, and
tabulates ours / HiSparse, the alternative tie rule (misses most recent) and Belady's OPT at equal
GPU rows.

    python benchmark/nsa_offload/traces/sensitivity.py \\
        --out-dir benchmark/nsa_offload/results/sensitivity
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import replay  # noqa: E402
import trace_gen  # noqa: E402

# name -> (description, GeneratorConfig overrides, replay init)
VARIANTS = {
    "default": (
        "default trace model (long-memory 0.5, recency amp 4, tau 64)",
        {},
        "cold",
    ),
    "prefix-init": (
        "default trace, both policies start with positions 0..B-2 resident",
        {},
        "prefix",
    ),
    "short-memory": (
        "long-memory 0: pure AR(1) reuse decay",
        {"long_memory": 0.0},
        "cold",
    ),
    "long-memory": (
        "long-memory 0.9: mostly static importance",
        {"long_memory": 0.9},
        "cold",
    ),
    "weak-recency": (
        "recency amp 2 (half the default boost)",
        {"recency_amp": "0-60:2.0"},
        "cold",
    ),
    "wide-recency": (
        "recency tau 256 (recency spread over ~1K tokens)",
        {"recency_tau": 256.0},
        "cold",
    ),
    "no-recency": ("no recency boost (sinks only)", {"recency_amp": "0-60:0"}, "cold"),
    "overlap-30": ("what-if: step overlap 30%", {"step_overlap": "0-60:0.30"}, "cold"),
    "overlap-60": ("what-if: step overlap 60%", {"step_overlap": "0-60:0.60"}, "cold"),
}


def run_variant(
    name: str,
    base: trace_gen.GeneratorConfig,
    budgets: Sequence[int],
    windows: Sequence[int],
    window: int,
) -> Dict:
    desc, overrides, init = VARIANTS[name]
    cfg = dataclasses.replace(base, **overrides)
    trace, report = trace_gen.build_trace(cfg, f"sensitivity.py variant {name}", False)
    sweep = replay.run_sweep(
        trace, budgets, windows, init, window=window, verbose=False
    )
    rows = replay.p6_rows(sweep, window)
    deep = [e for e in report["per_layer"] if e["layer"] >= 20]
    return {
        "variant": name,
        "description": desc,
        "init": init,
        "overrides": overrides,
        "step_overlap": sum(e["step_overlap"] for e in deep) / len(deep),
        "lag8_overlap": sum(e["lag_overlap"]["8"] for e in deep) / len(deep),
        "p6": rows,
    }


def render(results: List[Dict], base: trace_gen.GeneratorConfig, window: int) -> str:
    lines = ["# Sensitivity of ours vs HiSparse to the trace model\n"]
    lines.append(
        f"Layers {base.layers}, {base.num_requests} requests, prompts "
        f"{base.prompt_lens[0]}-{base.prompt_lens[-1]}, {base.num_steps} steps, "
        f"K={base.top_k}, seed {base.seed}. Misses per (request, layer, step), "
        "steady state; ratios against HiSparse at the same GPU rows B "
        f"(ours: C = B - {window}, W = {window}; HiSparse: H = B - 1).\n"
    )
    budgets = [r["budget"] for r in results[0]["p6"]]
    head = "| variant | step ovl | lag-8 ovl |"
    sep = "|:--|---:|---:|"
    for b in budgets:
        head += f" B={b}: HiSparse | ours | alt. tie | OPT |"
        sep += "---:|---:|---:|---:|"
    lines += [head, sep]
    for res in results:
        cells = f"| {res['variant']} | {100 * res['step_overlap']:.1f}% | {100 * res['lag8_overlap']:.1f}% |"
        for r in res["p6"]:
            cells += (
                f" {r['hisparse_misses_per_row']:.0f} | {r['ratio']:.3f} "
                f"| {r['ours_hits_mru_ratio']:.3f} | {r['opt_ratio']:.3f} |"
            )
        lines.append(cells)
    lines.append("\nVariants:\n")
    for res in results:
        lines.append(f"- `{res['variant']}`: {res['description']}")
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out-dir", default=None, help="folder for the results (default: print only)"
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated trace-generator variants",
    )
    p.add_argument(
        "--layers",
        default="20,21,40",
        help="comma-separated model layers of the generated traces",
    )
    p.add_argument("--requests", type=int, default=4, help="requests per trace")
    p.add_argument(
        "--prompt-lens",
        default="16384,32768",
        help="comma-separated prompt lengths (tokens)",
    )
    p.add_argument("--steps", type=int, default=64, help="decode steps per trace")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument(
        "--budgets",
        default="2560,4160,8192",
        help="comma-separated LRU rows per request and layer",
    )
    p.add_argument(
        "--windows",
        default="1,16,64,128,256",
        help="comma-separated recent-window sizes to sweep",
    )
    p.add_argument(
        "--window",
        type=int,
        default=replay.DEFAULT_WINDOW,
        help="recent-window rows of the budget sweep",
    )
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    base = trace_gen.GeneratorConfig(
        layers=[int(x) for x in args.layers.split(",")],
        num_requests=args.requests,
        prompt_lens=[int(x) for x in args.prompt_lens.split(",")],
        num_steps=args.steps,
        seed=args.seed,
    )
    budgets = [int(x) for x in args.budgets.split(",")]
    windows = sorted({int(x) for x in args.windows.split(",")} | {args.window})
    results = []
    for name in args.variants.split(","):
        t0 = time.time()
        results.append(run_variant(name, base, budgets, windows, args.window))
        print(f"  {name}: {time.time() - t0:.1f}s", file=sys.stderr)
    md = render(results, base, args.window)
    print(md)
    if args.out_dir:
        replay.write_summary(
            args.out_dir, md, {"base": dataclasses.asdict(base), "results": results}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
