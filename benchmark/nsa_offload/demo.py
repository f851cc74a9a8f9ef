"""Demo of the decode-side NSA KV offload: what it gains and what it costs.

1. Capacity, computed by the product's own pool sizing
   (``sglang.srt.mem_cache.nsa_kv_offload_sizing``, what a server logs at
   startup): requests of 16K-128K tokens one DeepSeek-V3.2 rank holds at once
   in the same GPU KV budget, without the offload (every token's KV on the
   GPU) and with it (a region per request, the rest in pinned host memory),
   at the best ``--max-running-requests`` for each length (a PD decode
   server; ``--colocated``: one that also prefills).
2. Cost, read from the committed GPU measurements
   (``results/rank_speed/summary.json``): decode ITL over no offload on the
   61-layer rank model, ours and HiSparse's, per trace and point.

Writes ``demo.png``, ``demo.json`` and ``demo.md`` to ``--out-dir`` (default
``demo_out/`` in the working directory) and prints the table. Under a minute
once the venv exists (``bash scripts/demo.sh`` builds it).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
RANK_SPEED = HERE / "results" / "rank_speed" / "summary.json"
# The benchmarks' helpers (stdlib only): the release order of the summaries.
sys.path.insert(0, str(HERE / "server"))
from server_utils import release_key  # noqa: E402

GIB = 1 << 30
CONTEXTS = (16384, 32768, 65536, 131072)
# DeepSeek-V3.2 per rank: 61 MLA layers; an fp8 FlashMLA KV row of 656 B
# (sglang counts 576 B of it when sizing its pool), an indexer key of 132 B.
LAYERS, ROW_BYTES, NOMINAL_ROW_BYTES, INDEXER_BYTES = 61, 656, 576, 132
TOP_K, PAGE, WINDOW, MAX_REGIONS = 2048, 64, 64, 256


def no_offload_requests(budget_bytes: int, context: int) -> int:
    """sglang's own pool: budget // nominal cell tokens, whole pages each."""
    tokens = budget_bytes // (LAYERS * (NOMINAL_ROW_BYTES + INDEXER_BYTES))
    return tokens // (-(-context // PAGE) * PAGE)


def offload_requests(
    budget_bytes: int, host_bytes: int, context: int, colocated: bool
) -> Dict:
    """The offload's pools for the same budget, at the best region count (a
    PD decode server has no prefill staging; a colocated one stages a whole
    prompt being chunked)."""
    warnings.filterwarnings("ignore")  # sglang's CPU import warnings
    from sglang.srt.mem_cache.nsa_kv_offload_sizing import (
        compute_offload_pool_sizes,
        prefill_staging_rows,
    )
    from sglang.srt.mem_cache.nsa_kv_offload_units import units_for_context

    buffer_size = 2 * TOP_K
    max_units = units_for_context(context, buffer_size, WINDOW)
    best = None
    for regions in range(1, MAX_REGIONS + 1):
        try:
            sizes = compute_offload_pool_sizes(
                available_bytes=budget_bytes,
                num_layers=LAYERS,
                row_bytes=ROW_BYTES,
                indexer_bytes=INDEXER_BYTES,
                page_size=PAGE,
                buffer_size=buffer_size,
                recent_window=WINDOW,
                num_regions=regions,
                staging_rows=(
                    prefill_staging_rows(context, 16384, regions, PAGE)
                    if colocated
                    else 0
                ),
                host_pool_bytes=host_bytes,
                max_units=max_units,
            )
        except RuntimeError:  # the regions alone exceed the budget
            break
        held = sizes.requests_that_fit(context)
        if best is None or held > best["requests"]:
            best = dict(requests=held, regions=regions, locs=sizes.num_locs)
    return best


def itl_overheads(path: Path = RANK_SPEED) -> List[Dict]:
    """Points measured for both ours and HiSparse (fractions over no offload)."""
    with open(path) as f:
        summary = json.load(f)
    ours, hisparse = summary["p4_itl_overhead"], summary["hisparse_itl_overhead"]
    by_release = summary.get("by_sglang_version", {})

    def release(name, key, value):
        # The release whose own runs gave this figure; one release: the summary's.
        found = [
            v for v, part in by_release.items()
            if part.get(name, {}).get(key) == value
        ]  # fmt: skip
        if not found:
            return str(summary.get("sglang_version"))
        # The newest of them (the whole file's figure is the latest run's).
        return max(found, key=release_key)

    rows = []
    for key in sorted(set(ours) & set(hisparse), key=lambda k: (k.split(":")[0], k)):
        trace, point = key.split(":")
        rows.append(
            dict(trace=trace, point=point, ours=ours[key], hisparse=hisparse[key],
                 sglang=release("p4_itl_overhead", key, ours[key]),
                 sglang_hisparse=release("hisparse_itl_overhead", key, hisparse[key]))
        )  # fmt: skip
    return rows


def plot(capacity: List[Dict], cost: List[Dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(capacity))
    a.bar(
        [i - 0.2 for i in x],
        [c["no_offload"] for c in capacity],
        0.4,
        label="no offload",
    )
    a.bar([i + 0.2 for i in x], [c["offload"] for c in capacity], 0.4, label="offload")
    a.set_xticks(list(x), [f"{c['context'] // 1024}K" for c in capacity])
    a.set_xlabel("tokens per request (prompt + output)")
    a.set_ylabel("requests held at once")
    a.set_title("Capacity: one DeepSeek-V3.2 rank, same GPU KV budget")
    for i, c in enumerate(capacity):
        a.annotate(
            f"{c['gain']:.1f}x", (i + 0.2, c["offload"]), ha="center", va="bottom"
        )
    a.legend()
    y = range(len(cost))
    b.barh([i + 0.2 for i in y], [100 * c["ours"] for c in cost], 0.4, label="offload")
    b.barh(
        [i - 0.2 for i in y], [100 * c["hisparse"] for c in cost], 0.4, label="HiSparse"
    )
    b.set_yticks(list(y), [f"{c['trace']} {c['point']} ({c['sglang']})" for c in cost])
    b.set_xlabel("decode ITL over no offload (%), measured")
    b.set_title("Cost: 61-layer rank model on one GPU")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out-dir", default="demo_out", help="where to write (default demo_out/)"
    )
    p.add_argument(
        "--kv-budget-gib", type=float, default=14.0,
        help="GPU KV budget of the rank (default 14: the measured rank point's)",
    )  # fmt: skip
    p.add_argument(
        "--host-pool-gb", type=float, default=64.0,
        help="pinned host pool of the rank (default 64: the measured point's)",
    )  # fmt: skip
    p.add_argument(
        "--colocated",
        action="store_true",
        help="a colocated server (prefill staging rows) instead of a PD decode one",
    )
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    args = p.parse_args(argv)
    if args.kv_budget_gib <= 0 or args.host_pool_gb <= 0:
        p.error("--kv-budget-gib and --host-pool-gb must be positive")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    budget, host = int(args.kv_budget_gib * GIB), int(args.host_pool_gb * GIB)
    capacity = []
    for context in CONTEXTS:
        ours = offload_requests(budget, host, context, args.colocated)
        base = no_offload_requests(budget, context)
        gain = ours["requests"] / base if base else float("inf")
        capacity.append(dict(context=context, no_offload=base, offload=ours["requests"],
                             gain=gain, regions=ours["regions"]))  # fmt: skip
    cost = itl_overheads()
    lines = [
        f"# Demo: {'colocated' if args.colocated else 'PD decode'} server, "
        f"{args.kv_budget_gib:g} GiB GPU KV budget, {args.host_pool_gb:g} GB host pool",
        "",
        "| tokens per request | no offload | offload | gain | --max-running-requests |",
        "|---|---|---|---|---|",
    ]
    for c in capacity:
        lines.append(f"| {c['context']} | {c['no_offload']} | {c['offload']} | "
                     f"{c['gain']:.1f}x | {c['regions']} |")  # fmt: skip
    lines += ["", "| trace | point | offload ITL | HiSparse ITL | sglang (offload / HiSparse) |",
              "|---|---|---|---|---|"]  # fmt: skip
    for c in cost:
        lines.append(f"| {c['trace']} | {c['point']} | {100 * c['ours']:+.1f}% | "
                     f"{100 * c['hisparse']:+.1f}% | {c['sglang']} / {c['sglang_hisparse']} |")  # fmt: skip
    lines += [
        "",
        f"Cost rows: measured, `{RANK_SPEED.relative_to(HERE.parent.parent)}`.",
    ]
    text = "\n".join(lines) + "\n"
    (out / "demo.md").write_text(text)
    with open(out / "demo.json", "w") as f:
        json.dump(dict(args=vars(args), capacity=capacity, cost=cost), f, indent=1)
    if not args.no_plot:
        plot(capacity, cost, out / "demo.png")
    print(text + f"\nwritten: {out}/demo.{{md,json{'' if args.no_plot else ',png'}}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
