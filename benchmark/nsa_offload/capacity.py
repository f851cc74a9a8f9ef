"""Capacity: concurrently running long requests per GPU, offload vs no offload.

Two parts:

* ``model`` (CPU): for a GPU KV budget and a request length, the number of
  requests each server fits, from the offload's own pool sizing code
  (``compute_offload_pool_sizes``) and the bytes the no-offload NSA pool
  allocates per token; with the analytic bound of the issue
  ``L (656 + 132) / (L 132 + R 656)`` and where the offload's memory goes.
* ``server`` (GPU): the same budget given to two real servers (same
  ``--mem-fraction-static``), each sent more requests of one length than it
  can hold; the peak ``#running-req`` of its decode log is the measured
  capacity, and every request must complete (admission makes the rest wait).

    python benchmark/nsa_offload/capacity.py model --out results/capacity
    python benchmark/nsa_offload/capacity.py server --length 32768 --out DIR
"""

import argparse
import json
import os
import re
import time

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

            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../test/srt"))
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
        bound = length * (ROW_BYTES_FP8 + INDEXER_BYTES) / (
            length * INDEXER_BYTES + R * ROW_BYTES_FP8
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


# ---------------------------------------------------------------- server mode

RUNNING_RE = re.compile(r"Decode batch.*?#running-req: (\d+)")
BASE_TOKENS_RE = re.compile(r"max_total_num_tokens=(\d+)")
OFFLOAD_RE = re.compile(
    r"NSA KV offload: (\d+) logical token locs .*?, (\d+) decode regions"
)


def scan_log(path):
    peak, total_tokens, regions = 0, None, None
    with open(path) as f:
        for line in f:
            m = RUNNING_RE.search(line)
            if m:
                peak = max(peak, int(m.group(1)))
            m = BASE_TOKENS_RE.search(line)
            if m:
                total_tokens = int(m.group(1))
            m = OFFLOAD_RE.search(line)
            if m:
                total_tokens, regions = int(m.group(1)), int(m.group(2))
    return peak, total_tokens, regions


def run_server_mode(args):
    from server_utils import Server, random_prompts

    os.makedirs(args.out, exist_ok=True)
    tokens = args.length + args.new_tokens
    common = [
        "--mem-fraction-static",
        str(args.mem_fraction_static),
        "--context-length",
        str(args.context_len),
        "--decode-log-interval",
        "5",
        "--cuda-graph-max-bs",
        "64",
    ]
    results = {}
    for name, extra in (
        ("baseline", ["--max-running-requests", str(args.max_running_baseline)]),
        (
            "offload",
            [
                "--enable-decode-nsa-kv-offload",
                "--nsa-kv-offload-host-pool-gb",
                str(args.host_pool_gb),
                "--max-running-requests",
                str(args.max_running_offload),
            ],
        ),
    ):
        env = {"SGLANG_NSA_FUSE_TOPK": "0"}
        with Server(name, common + extra, args.port, args.out, env=env) as server:
            _, total_tokens, regions = scan_log(server.log_path)
            if name == "baseline":
                predicted = total_tokens // tokens
            else:
                predicted = min(regions, total_tokens // (
                    (tokens + PAGE - 1) // PAGE * PAGE))
            n = int(predicted * 1.25) + 2
            prompts = random_prompts([args.length] * n, seed=1)
            print(f"[{name}] predicted {predicted}, sending {n}", flush=True)
            tic = time.time()
            outs = server.generate_many(prompts, args.new_tokens, n)
            elapsed = time.time() - tic
            time.sleep(5)
            alive = server.proc.poll() is None
        peak, _, _ = scan_log(server.log_path)
        results[name] = {
            "total_token_locs": total_tokens,
            "regions": regions,
            "predicted_capacity": predicted,
            "sent": n,
            "completed": sum(len(o["output_ids"]) == args.new_tokens for o in outs),
            "peak_running": peak,
            "elapsed_s": elapsed,
            "alive_after_idle": alive,
        }
        print(f"[{name}] {results[name]}", flush=True)
    results["ratio_peak_running"] = results["offload"]["peak_running"] / max(
        results["baseline"]["peak_running"], 1
    )
    results["config"] = vars(args)
    with open(os.path.join(args.out, f"capacity_server_{args.length}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in results.items() if k != "config"}, indent=1))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("model")
    m.add_argument("--out", required=True)
    m.add_argument("--layers", type=int, default=61)
    m.add_argument("--budget-gb", type=float, default=80.0)
    m.add_argument(
        "--lengths", type=lambda s: [int(x) for x in s.split(",")],
        default=[16384, 32768, 65536, 131072],
    )
    m.add_argument("--new-tokens", type=int, default=0)
    m.add_argument("--buffer-size", type=int, default=4096)
    m.add_argument("--recent-window", type=int, default=64)
    m.add_argument("--context-len", type=int, default=131072 + 4096)
    m.add_argument("--prefill-budget", type=int, default=16384)
    s = sub.add_parser("server")
    s.add_argument("--out", required=True)
    s.add_argument("--length", type=int, default=32768)
    s.add_argument("--new-tokens", type=int, default=32)
    s.add_argument("--context-len", type=int, default=36000)
    s.add_argument("--mem-fraction-static", type=float, default=0.012)
    s.add_argument("--host-pool-gb", type=float, default=8.0)
    s.add_argument("--max-running-baseline", type=int, default=256)
    s.add_argument("--max-running-offload", type=int, default=32)
    s.add_argument("--port", type=int, default=31100)
    args = p.parse_args()
    if args.mode == "model":
        write_model(args)
    else:
        run_server_mode(args)


if __name__ == "__main__":
    main()
