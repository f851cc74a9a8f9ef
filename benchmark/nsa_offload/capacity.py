"""Capacity: concurrently running long requests per GPU, offload vs no offload.

Two parts:

* ``model`` (CPU): for a GPU KV budget and a request length, the number of
  requests each server fits, from the offload's own pool sizing code
  (``compute_offload_pool_sizes``) and the bytes the no-offload NSA pool
  allocates per token; with the analytic bound of the issue
  ``L (656 + 132) / (L 132 + R 656)`` and where the offload's memory goes.
* the measured side: ``e2e_server.py --capacity-length L`` gives two real
  servers the same budget and reads their peak ``#running-req`` (it uses
  ``scan_log`` below).

    python benchmark/nsa_offload/capacity.py model --out results/capacity
"""

import argparse
import json
import os
import re

ROW_BYTES_FP8 = 656  # FlashMLA fp8 row: 512 nope + 4 fp32 scales + 64 bf16 rope
INDEXER_BYTES = 132  # 128 fp8 + fp32 scale
PAGE = 64


def _import_sizing():
    """The offload's own sizing code. On a CPU-only machine sglang's imports
    need the test shims (torchvision ops, sgl_kernel stubs)."""
    try:
        import torch

        if not torch.cuda.is_available():
            import sys

            sys.path.insert(
                0, os.path.join(os.path.dirname(__file__), "../../test/srt")
            )
            import cpu_shims

            cpu_shims.install_all()
    except ImportError:
        pass


def model_rows(args):
    _import_sizing()
    from sglang.srt.mem_cache.nsa_kv_offload_pool import (
        compute_offload_pool_sizes,
        offload_bytes_per_loc,
        offload_bytes_per_region,
    )

    budget = int(args.budget_gb * (1 << 30))
    C, W, L = args.buffer_size, args.recent_window, args.layers
    R = C + W
    per_loc = offload_bytes_per_loc(L, INDEXER_BYTES)
    per_region = offload_bytes_per_region(L, ROW_BYTES_FP8, C, W)
    rows = []
    for length in args.lengths:
        tokens = length + args.new_tokens
        baseline = budget // (L * (ROW_BYTES_FP8 + INDEXER_BYTES)) // tokens
        out = {"length": length, "baseline": int(baseline)}
        for mode, staging in (
            ("colocated", args.context_len + 2 * args.prefill_budget + 64 * PAGE),
            ("decode_only", 0),
        ):
            # Largest region count whose tokens still fit: M (L per_loc + region)
            # plus the fixed staging must stay within the budget.
            fixed = L * (PAGE + staging) * ROW_BYTES_FP8
            m = max((budget - fixed) // (tokens * per_loc + per_region), 0)
            while m > 0:
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
                )
                if sizes.num_locs // PAGE >= m * ((tokens + PAGE - 1) // PAGE):
                    break
                m -= 1
            used = {
                "indexer_and_maps_gb": m * tokens * per_loc / (1 << 30),
                "regions_kv_gb": m * L * R * ROW_BYTES_FP8 / (1 << 30),
                "lru_state_gb": m * L * C * 6 / (1 << 30),
                "staging_gb": L * staging * ROW_BYTES_FP8 / (1 << 30),
            }
            out[mode] = int(m)
            out[f"{mode}_ratio"] = m / baseline if baseline else float("inf")
            out[f"{mode}_memory"] = used
        bound = (
            length
            * (ROW_BYTES_FP8 + INDEXER_BYTES)
            / (length * INDEXER_BYTES + R * ROW_BYTES_FP8)
        )
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
        "new_tokens": args.new_tokens,
        "context_len": args.context_len,
        "prefill_budget": args.prefill_budget,
    }
    with open(os.path.join(args.out, "capacity_model.json"), "w") as f:
        json.dump({"config": meta, "rows": rows}, f, indent=1)
    lines = [
        f"# Capacity at a {args.budget_gb:g} GB KV budget, {args.layers} layers "
        f"(fp8 656 B rows, R = {args.buffer_size} + {args.recent_window})",
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


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("model")
    m.add_argument("--out", required=True)
    m.add_argument("--layers", type=int, default=61)
    m.add_argument("--budget-gb", type=float, default=80.0)
    m.add_argument(
        "--lengths",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[16384, 32768, 65536, 131072],
    )
    m.add_argument("--new-tokens", type=int, default=0)
    m.add_argument("--buffer-size", type=int, default=4096)
    m.add_argument("--recent-window", type=int, default=64)
    m.add_argument("--context-len", type=int, default=131072 + 4096)
    m.add_argument("--prefill-budget", type=int, default=16384)
    args = p.parse_args()
    write_model(args)


if __name__ == "__main__":
    main()
