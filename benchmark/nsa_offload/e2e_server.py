"""End-to-end checks on real sglang servers (GPU host): exactness, capacity,
no leaks.

Starts the tiny DeepSeek-V3.2-shaped model twice, one server after the other,
with the same GPU memory budget (same ``--mem-fraction-static``), without and
with --enable-decode-nsa-kv-offload, both on the same top-k path (positional
top-k + page-table transform: SGLANG_NSA_FUSE_TOPK=0). On each server:

1. exactness: the same greedy requests; ``output_ids`` must match token for
   token between the two servers;
2. capacity (optional, ``--capacity-length L``): more requests of L tokens
   than the server can hold, all at once; the peak ``#running-req`` of its
   decode log is the measured capacity, and every request must complete;
3. idle: the server must survive going idle (its own memory-leak check runs
   then) and the offload's pools must be back to their initial state.

    python benchmark/nsa_offload/e2e_server.py --out DIR [--capacity-length 32768]
"""

import argparse
import json
import os
import re
import time

from capacity import PAGE, scan_log
from server_utils import Server, random_prompts

OFFLOAD_LOG_RE = re.compile(
    r"#running-req: (\d+).*nsa-offload hit rate: ([0-9.]+), misses: (\d+), "
    r"H2D: ([0-9.]+) GB/s, regions: (\d+)/(\d+)"
)


def parse_offload_log(path: str):
    rows = []
    with open(path) as f:
        for line in f:
            m = OFFLOAD_LOG_RE.search(line)
            if m:
                rows.append(
                    {
                        "running": int(m.group(1)),
                        "hit_rate": float(m.group(2)),
                        "misses": int(m.group(3)),
                        "h2d_gbps": float(m.group(4)),
                        "regions_used": int(m.group(5)),
                    }
                )
    return rows


def capacity_phase(server, name, args):
    tokens = args.capacity_length + args.capacity_new_tokens
    _, total_tokens, regions = scan_log(server.log_path)
    if regions is None:
        predicted = total_tokens // tokens
    else:
        per_req = (tokens + PAGE - 1) // PAGE * PAGE
        predicted = min(regions, total_tokens // per_req)
    n = int(predicted * 1.25) + 2
    print(f"[{name}] capacity: predicted {predicted}, sending {n}", flush=True)
    prompts = random_prompts([args.capacity_length] * n, seed=1)
    tic = time.time()
    outs = server.generate_many(prompts, args.capacity_new_tokens, n)
    return {
        "length": args.capacity_length,
        "new_tokens": args.capacity_new_tokens,
        "total_token_locs": total_tokens,
        "regions": regions,
        "predicted": predicted,
        "sent": n,
        "completed": sum(
            len(o["output_ids"]) == args.capacity_new_tokens for o in outs
        ),
        "elapsed_s": time.time() - tic,
    }


def run_server(name, extra_args, args, prompts):
    env = {"SGLANG_NSA_FUSE_TOPK": "0"}
    result = {}
    with Server(name, extra_args, args.port, args.out, env=env) as server:
        tic = time.time()
        outs = server.generate_many(prompts, args.max_new_tokens, args.concurrency)
        result["exactness_elapsed_s"] = time.time() - tic
        result["output_ids"] = [o["output_ids"] for o in outs]
        peak_before = scan_log(server.log_path)[0]
        if args.capacity_length:
            result["capacity"] = capacity_phase(server, name, args)
        # Let the scheduler go idle: its own memory-leak check runs then.
        time.sleep(args.idle_wait)
        result["alive_after_idle"] = server.proc.poll() is None
    log = open(server.log_path).read()
    result["leak_reported"] = "memory leak" in log.lower()
    if args.capacity_length:
        result["capacity"]["peak_running"] = scan_log(server.log_path)[0]
        result["capacity"]["peak_running_exactness_phase"] = peak_before
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-len", type=int, default=3000)
    p.add_argument("--max-len", type=int, default=30000)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--buffer-size", type=int, default=None)
    p.add_argument("--recent-window", type=int, default=64)
    p.add_argument("--host-pool-gb", type=float, default=16.0)
    p.add_argument("--mem-fraction-static", type=float, default=0.7)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-baseline", type=int, default=32)
    p.add_argument("--max-running-offload", type=int, default=32)
    p.add_argument("--capacity-length", type=int, default=0)
    p.add_argument("--capacity-new-tokens", type=int, default=512)
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--idle-wait", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    step = (args.max_len - args.min_len) / max(args.num_requests - 1, 1)
    lengths = [int(args.min_len + i * step) for i in range(args.num_requests)]
    prompts = random_prompts(lengths, args.seed)
    common = [
        "--mem-fraction-static",
        str(args.mem_fraction_static),
        "--decode-log-interval",
        "10",
    ]
    if args.context_length:
        common += ["--context-length", str(args.context_length)]
    offload_args = [
        "--max-running-requests",
        str(args.max_running_offload),
        "--enable-decode-nsa-kv-offload",
        "--nsa-kv-offload-recent-window",
        str(args.recent_window),
        "--nsa-kv-offload-host-pool-gb",
        str(args.host_pool_gb),
    ]
    if args.buffer_size is not None:
        offload_args += ["--nsa-kv-offload-gpu-buffer-size", str(args.buffer_size)]

    base = run_server(
        "baseline",
        common + ["--max-running-requests", str(args.max_running_baseline)],
        args,
        prompts,
    )
    ours = run_server("offload", common + offload_args, args, prompts)

    mismatched = []
    for i, (a, b) in enumerate(zip(base["output_ids"], ours["output_ids"])):
        if a != b:
            first = next(
                (j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                min(len(a), len(b)),
            )
            mismatched.append(
                {"request": i, "prompt_len": lengths[i], "first_diff": first}
            )
    log_rows = parse_offload_log(os.path.join(args.out, "server_offload.log"))
    result = {
        "config": vars(args),
        "prompt_lens": lengths,
        "identical_requests": args.num_requests - len(mismatched),
        "mismatched": mismatched,
        "baseline": {k: v for k, v in base.items() if k != "output_ids"},
        "offload": {k: v for k, v in ours.items() if k != "output_ids"},
        "offload_decode_log": log_rows,
    }
    if args.capacity_length:
        result["capacity_ratio"] = ours["capacity"]["peak_running"] / max(
            base["capacity"]["peak_running"], 1
        )
    with open(os.path.join(args.out, "e2e_server.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"identical: {result['identical_requests']}/{args.num_requests}; "
        f"alive after idle: baseline {base['alive_after_idle']}, "
        f"offload {ours['alive_after_idle']}; leak reported: "
        f"{base['leak_reported']}/{ours['leak_reported']}"
    )
    if args.capacity_length:
        print("capacity baseline:", base["capacity"])
        print("capacity offload:", ours["capacity"])
        print(f"capacity ratio (peak running): {result['capacity_ratio']:.2f}")
    for r in log_rows[:: max(len(log_rows) // 12, 1)]:
        print("  ", r)
    ok = not mismatched and ours["alive_after_idle"] and base["alive_after_idle"]
    if args.capacity_length:
        ok = ok and all(
            r["capacity"]["completed"] == r["capacity"]["sent"] for r in (base, ours)
        )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
