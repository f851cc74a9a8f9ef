"""End-to-end exactness on a real sglang server (GPU host).

Starts the tiny DeepSeek-V3.2-shaped model twice, one server after the other,
without and with --enable-decode-nsa-kv-offload, both on the same top-k path
(positional top-k + page-table transform: SGLANG_NSA_FUSE_TOPK=0), sends the
same greedy requests and compares ``output_ids`` token for token.

    python benchmark/nsa_offload/e2e_exactness.py --out results/e2e
"""

import argparse
import json
import os
import re
import time

from server_utils import Server, random_prompts

OFFLOAD_LOG_RE = re.compile(
    r"#running-req: (\d+).*nsa-offload hit rate: ([0-9.]+), misses: (\d+), "
    r"H2D: ([0-9.]+) GB/s"
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
                    }
                )
    return rows


def run_server(name, extra_args, args, prompts):
    env = {"SGLANG_NSA_FUSE_TOPK": "0"}
    with Server(name, extra_args, args.port, args.out, env=env) as server:
        tic = time.time()
        outs = server.generate_many(prompts, args.max_new_tokens, args.concurrency)
        elapsed = time.time() - tic
        # Let the scheduler go idle: its own memory-leak check runs then.
        time.sleep(args.idle_wait)
        alive = server.proc.poll() is None
        tail = server.tail(200)
    leak = "leak" in tail.lower() and "memory" in tail.lower()
    return {
        "output_ids": [o["output_ids"] for o in outs],
        "elapsed_s": elapsed,
        "alive_after_idle": alive,
        "leak_reported": leak,
    }


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
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--idle-wait", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra", default="", help="extra server args for both runs")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    step = (args.max_len - args.min_len) / max(args.num_requests - 1, 1)
    lengths = [int(args.min_len + i * step) for i in range(args.num_requests)]
    prompts = random_prompts(lengths, args.seed)
    common = [
        "--max-running-requests",
        str(args.max_running_requests),
        *args.extra.split(),
    ]
    offload_args = [
        "--enable-decode-nsa-kv-offload",
        "--nsa-kv-offload-recent-window",
        str(args.recent_window),
        "--nsa-kv-offload-host-pool-gb",
        str(args.host_pool_gb),
    ]
    if args.buffer_size is not None:
        offload_args += ["--nsa-kv-offload-gpu-buffer-size", str(args.buffer_size)]

    base = run_server("baseline", common, args, prompts)
    ours = run_server("offload", common + offload_args, args, prompts)

    mismatched = []
    for i, (a, b) in enumerate(zip(base["output_ids"], ours["output_ids"])):
        if a != b:
            first = next(
                (j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
            )
            mismatched.append({"request": i, "prompt_len": lengths[i], "first_diff": first})
    log_rows = parse_offload_log(os.path.join(args.out, "server_offload.log"))
    steps = [r for r in log_rows if r["running"] > 0]
    result = {
        "num_requests": args.num_requests,
        "prompt_lens": lengths,
        "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency,
        "identical_requests": args.num_requests - len(mismatched),
        "mismatched": mismatched,
        "baseline_elapsed_s": base["elapsed_s"],
        "offload_elapsed_s": ours["elapsed_s"],
        "baseline_alive_after_idle": base["alive_after_idle"],
        "offload_alive_after_idle": ours["alive_after_idle"],
        "offload_leak_reported": ours["leak_reported"],
        "offload_decode_log": log_rows,
    }
    with open(os.path.join(args.out, "e2e_exactness.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"identical: {result['identical_requests']}/{args.num_requests}, "
        f"baseline {base['elapsed_s']:.1f} s, offload {ours['elapsed_s']:.1f} s, "
        f"offload alive after idle: {ours['alive_after_idle']}, "
        f"log lines with misses: {len(steps)}"
    )
    for r in steps[:20]:
        print("  ", r)
    raise SystemExit(0 if not mismatched and ours["alive_after_idle"] else 1)


if __name__ == "__main__":
    main()
