"""End-to-end checks on real sglang servers (GPU host): exactness, capacity,
no leaks.

Starts the tiny DeepSeek-V3.2-shaped model twice, one server after the other,
with the same GPU memory budget (same ``--mem-fraction-static``), without and
with --enable-decode-nsa-kv-offload, both on the same top-k path (positional
top-k + page-table transform: SGLANG_DSA_FUSE_TOPK=0). On each server:

1. exactness: the same greedy requests; ``output_ids`` must match token for
   token between the two servers;
2. capacity (optional, ``--capacity-lengths L1,L2,..``): per length, more
   requests of L tokens than the server can hold, all at once; the peak
   ``#running-req`` of its decode log meanwhile is the measured capacity, and
   every request must complete. The no-offload server runs every length; the
   offload runs one server per length with the decode regions
   (``--max-running-requests``) its sizing model gives for that length and
   the budget sglang handed the no-offload server (read from its log). The
   ratio is reported at the same ``--mem-fraction-static`` and at equal GPU
   bytes (``capacity.md``, ``capacity.png``);
3. idle: the server must survive going idle (its own memory-leak check runs
   then, a leak aborts it) and answer nothing wrong afterwards.

``--servers offload --budget-gib B`` runs the offload side alone (e.g. on a
second GPU); ``hisparse`` in ``--servers`` adds upstream HiSparse's capacity.

``--pd-decode``: every server is a PD decode server (``--disaggregation-mode
decode``) fed by sglang's fake transfer backend (no prefill server: requests
are admitted with their KV unwritten), so capacity is measured without
prefill staging; the offload gets the region count of the decode-only sizing
model. No exactness requests there (the KV is not real). Requests arrive
without prefill and finish fast: give them enough new tokens to still be
decoding when the last one is admitted (``--capacity-new-tokens 4096`` at
128K); every server reserves that whole output at admission
(``--num-reserved-decode-tokens``), so none over-admits and retracts; a phase
whose peak stays below the prediction is reported as not saturated.

    python benchmark/nsa_offload/server/e2e_server.py --out DIR [--capacity-lengths 16384,131072]
"""

import argparse
import json
import os
import re
import time
from typing import Optional

from capacity import (
    PAGE,
    capacity_rows,
    memory_from_log,
    offload_regions_for,
    scan_log,
    write_capacity_report,
)
from server_utils import (
    HISPARSE_ARGS,
    KV_DTYPE_ARGS,
    PD_DECODE_FAKE_ARGS,
    Server,
    random_prompts,
)

OFFLOAD_LOG_RE = re.compile(
    r"#running-req: (\d+).*nsa-offload hit rate: ([0-9.]+), misses: (\d+), "
    r"(?:prefetched: \d+, )?H2D: ([0-9.]+) GB/s, regions: (\d+)/(\d+)"
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


SLOTS_RE = re.compile(r"max_total_num_tokens=\d+.*?max_running_requests=(\d+)")


def predict_capacity(name, total_tokens, regions, per_req, slots=None):
    """Requests of ``per_req`` token locs the server should hold at once
    (``slots``: its --max-running-requests as it logged them), by
    ``bench_server.capacity``; HiSparse's device rows are counted as on a PD
    decode server (no prefill staging): at most what a colocated one holds."""
    import bench_server

    caps = [c for c in (regions, slots) if c is not None]
    pool = {
        "max_total_num_tokens": total_tokens,
        "max_running_requests": min(caps) if caps else 1 << 30,
    }
    kind = "hisparse" if name == "hisparse" else "ours"
    return bench_server.capacity(kind, pool, per_req, 0, pd_decode=True)


def capacity_phase(server, name, args, length):
    """More requests of ``length`` tokens than the server holds, all at once;
    the peak #running-req logged meanwhile is the measured capacity."""
    tokens = length + args.capacity_new_tokens
    _, total_tokens, regions = scan_log(server.log_path)
    per_req = (tokens + PAGE - 1) // PAGE * PAGE
    with open(server.log_path, errors="replace") as f:
        slots = [int(x) for x in SLOTS_RE.findall(f.read())]
    predicted = predict_capacity(
        name, total_tokens, regions, per_req, slots[-1] if slots else None
    )
    n = int(predicted * args.capacity_oversubscribe) + 2
    print(f"[{name}] capacity {length}: predicted {predicted}, sending {n}", flush=True)
    prompts = random_prompts([length] * n, seed=length)
    start = os.path.getsize(server.log_path)
    tic = time.time()
    error = None
    try:
        outs = server.generate_many(prompts, args.capacity_new_tokens, n)
    except OSError as e:  # the server died: keep what its log shows
        error, outs = f"{type(e).__name__}: {e}", []
        print(f"[{name}] capacity {length}: FAILED: {error}", flush=True)
    elapsed = time.time() - tic
    peak = scan_log(server.log_path, start)[0]
    print(
        f"[{name}] capacity {length}: peak running {peak} ({elapsed:.0f} s)", flush=True
    )
    # The peak only measures capacity if requests were still decoding when the
    # last ones were admitted (a PD decode server admits them without any
    # prefill, so short outputs finish before the rest arrive).
    saturated = peak >= predicted - 1
    if not saturated:
        print(
            f"[{name}] capacity {length}: NOT SATURATED (peak {peak} < predicted "
            f"{predicted}): requests finished before the rest were admitted; "
            "raise --capacity-new-tokens",
            flush=True,
        )
    return {
        "length": length,
        "new_tokens": args.capacity_new_tokens,
        "total_token_locs": total_tokens,
        "regions": regions,
        "predicted": predicted,
        "sent": n,
        "completed": sum(
            len(o["output_ids"]) == args.capacity_new_tokens for o in outs
        ),
        "peak_running": peak,
        "saturated": saturated,
        "elapsed_s": elapsed,
        "error": error,
    }


def run_server(name, extra_args, args, prompts, lengths):
    """One server: the exactness requests (if ``prompts``), the capacity
    phases, then idle (sglang's own leak check runs when it goes idle)."""
    env = {"SGLANG_DSA_FUSE_TOPK": "0"}
    offload = "--enable-decode-nsa-kv-offload" in extra_args
    if args.max_units is not None and offload:
        extra_args = list(extra_args) + [
            "--nsa-kv-offload-max-units",
            str(args.max_units),
        ]
    result = {"name": name, "args": extra_args, "capacity": {}}
    with Server(name, extra_args, args.port, args.out, env=env) as server:
        if prompts:
            tic = time.time()
            outs = server.generate_many(prompts, args.max_new_tokens, args.concurrency)
            result["exactness_elapsed_s"] = time.time() - tic
            result["output_ids"] = [o["output_ids"] for o in outs]
        for length in lengths:
            phase = capacity_phase(server, name, args, length)
            result["capacity"][str(length)] = phase
            if phase["error"]:
                break
        time.sleep(args.idle_wait)
        result["alive_after_idle"] = server.proc.poll() is None
    with open(server.log_path) as f:
        result["leak_reported"] = "memory leak" in f.read().lower()
    result["memory"] = memory_from_log(server.log_path, args.mem_fraction_static)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--out",
        required=True,
        help="output directory (created) for the JSON/markdown results",
    )
    p.add_argument(
        "--servers",
        default="baseline,offload",
        help="comma-separated servers to run: baseline, offload, hisparse",
    )
    p.add_argument(
        "--num-requests", type=int, default=32, help="requests compared token for token"
    )
    p.add_argument("--min-len", type=int, default=3000, help="shortest prompt (tokens)")
    p.add_argument("--max-len", type=int, default=30000, help="longest prompt (tokens)")
    p.add_argument(
        "--max-new-tokens", type=int, default=256, help="output tokens per request"
    )
    p.add_argument(
        "--concurrency", type=int, default=16, help="requests in flight at once"
    )
    p.add_argument(
        "--buffer-size",
        type=int,
        default=None,
        help="--nsa-kv-offload-gpu-buffer-size of the offload server (default: the server's)",
    )
    p.add_argument(
        "--recent-window",
        type=int,
        default=64,
        help="recent-window rows per request (W)",
    )
    p.add_argument(
        "--host-pool-gb",
        type=float,
        default=16.0,
        help="--nsa-kv-offload-host-pool-gb of the offload server",
    )
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.7,
        help="--mem-fraction-static of every server",
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="--context-length of every server (default: the model's)",
    )
    p.add_argument(
        "--max-running-baseline",
        type=int,
        default=32,
        help="--max-running-requests of the no-offload server",
    )
    p.add_argument(
        "--max-running-offload",
        type=int,
        default=32,
        help="--max-running-requests of the offload server",
    )
    p.add_argument(
        "--max-running-hisparse",
        type=int,
        default=256,
        help="--max-running-requests of the HiSparse server",
    )
    p.add_argument(
        "--mem-fraction-static-hisparse",
        type=float,
        help="HiSparse's --mem-fraction-static (default: --mem-fraction-static). "
        "HiSparse does not count its indexer buffer (host_to_device_ratio x its "
        "KV rows) against the budget and takes ~1.8x the pool bytes of the "
        "others at the same fraction; a lower fraction gives it equal bytes",
    )
    p.add_argument(
        "--mem-fraction-static-offload",
        type=float,
        help="the offload servers' --mem-fraction-static (default: "
        "--mem-fraction-static); their region counts then come from the budget "
        "sglang gives at that fraction (from the no-offload server's logged "
        "memory). Upstream sizes the no-offload fp8 pool at 576 B per KV row but "
        "allocates 656 B, so at one fraction it takes ~10%% more GPU memory than "
        "ours: a higher fraction gives ours equal bytes",
    )
    p.add_argument(
        "--max-units",
        type=int,
        help="offload servers with --nsa-kv-offload-max-units N (default: the "
        "server's, 4; 1: every request keeps exactly its own LRU buffer)",
    )
    p.add_argument(
        "--pd-decode",
        action="store_true",
        help="PD decode servers with the fake transfer backend (capacity only)",
    )
    p.add_argument(
        "--capacity-lengths",
        "--capacity-length",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[],
        help="request lengths of the capacity phases; the offload runs one "
        "server per length with the decode regions the sizing model gives",
    )
    p.add_argument(
        "--offload-capacity-lengths",
        type=lambda s: [int(x) for x in s.split(",") if x],
        help="the offload's capacity lengths (default: --capacity-lengths)",
    )
    p.add_argument(
        "--baseline-from",
        help="e2e_server.json of an earlier run whose no-offload results the "
        "capacity report compares with (with --servers offload)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=sorted(KV_DTYPE_ARGS),
        default="fp8_e4m3",
        help="KV dtype of every server (bfloat16: FlashMLA sparse decode)",
    )
    p.add_argument(
        "--capacity-new-tokens",
        type=int,
        default=512,
        help="output tokens per request in the capacity phase",
    )
    p.add_argument(
        "--capacity-oversubscribe",
        type=float,
        default=1.25,
        help="requests sent in the capacity phase, times the predicted capacity",
    )
    p.add_argument(
        "--budget-gib",
        type=float,
        help="pool budget for the offload's region counts (default: read "
        "from the no-offload server's log)",
    )
    p.add_argument(
        "--budget-margin-gib",
        type=float,
        default=0.02,
        help="GiB taken off the measured KV budget",
    )
    p.add_argument("--port", type=int, default=31000, help="first server port")
    p.add_argument(
        "--idle-wait",
        type=float,
        default=8.0,
        help="seconds of idle before the idle/leak checks",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")
    return p.parse_args(argv)


def common_server_args(args) -> list:
    """Flags every server of the run gets (after server_utils.BASE_ARGS)."""
    common = [
        "--mem-fraction-static",
        str(args.mem_fraction_static),
        "--decode-log-interval",
        "10",
    ]
    common += KV_DTYPE_ARGS[args.kv_cache_dtype]
    if args.context_length:
        common += ["--context-length", str(args.context_length)]
    if args.pd_decode:
        # Reserve every request's whole output at admission: sglang's default
        # (512) over-admits long outputs and then retracts, and retracting on
        # a no-offload NSA decode server crashes in sglang 0.5.12.post1
        # (NSATokenToKVPool.get_cpu_copy has no mamba_indices argument).
        reserved = max(512, args.capacity_new_tokens)
        common += PD_DECODE_FAKE_ARGS + ["--num-reserved-decode-tokens", str(reserved)]
    return common


def hisparse_fraction_args(args) -> list:
    """HiSparse's own --mem-fraction-static (later flag wins), if given."""
    if args.mem_fraction_static_hisparse is None:
        return []
    return ["--mem-fraction-static", str(args.mem_fraction_static_hisparse)]


def offload_budget_at(base: Optional[dict], fraction: float) -> float:
    """The pool budget sglang gives a server at ``fraction`` on this GPU,
    from the no-offload server's logged memory (after weights - before x
    (1 - f), the same weights)."""
    memory = (base or {}).get("memory", {})
    if not {"before_weights", "after_weights"} <= memory.keys():
        raise SystemExit(
            "--mem-fraction-static-offload needs the no-offload server's memory "
            "(run it, or --baseline-from) or --budget-gib"
        )
    before = memory["before_weights"]
    return round(memory["after_weights"] - before * (1 - fraction), 3)


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    servers = args.servers.split(",")
    if args.pd_decode and args.num_requests:
        raise SystemExit(
            "--pd-decode takes --num-requests 0: the fake transfer backend "
            "leaves the KV unwritten, so outputs cannot be compared"
        )

    if args.kv_cache_dtype != "fp8_e4m3" and "hisparse" in servers:
        raise SystemExit(
            "hisparse runs with fp8 KV only here (HISPARSE_ARGS pins FlashMLA "
            "fp8 prefill and decode); drop it from --servers for "
            f"--kv-cache-dtype {args.kv_cache_dtype}"
        )

    step = (args.max_len - args.min_len) / max(args.num_requests - 1, 1)
    lengths = [int(args.min_len + i * step) for i in range(args.num_requests)]
    prompts = random_prompts(lengths, args.seed) if args.num_requests else []
    common = common_server_args(args)

    def offload_args(regions):
        extra = [
            "--max-running-requests",
            str(regions),
            "--enable-decode-nsa-kv-offload",
            "--nsa-kv-offload-recent-window",
            str(args.recent_window),
            "--nsa-kv-offload-host-pool-gb",
            str(args.host_pool_gb),
        ]
        if args.buffer_size is not None:
            extra += ["--nsa-kv-offload-gpu-buffer-size", str(args.buffer_size)]
        if args.mem_fraction_static_offload is not None:
            extra += ["--mem-fraction-static", str(args.mem_fraction_static_offload)]
        return extra

    budget_given = args.budget_gib is not None
    result = {"config": vars(args), "prompt_lens": lengths, "complete": False}
    json_path = os.path.join(args.out, "e2e_server.json")

    def save():
        # after every server: a run cut by a time limit keeps what it measured
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)

    base = None
    if "baseline" in servers:
        base = run_server(
            "baseline",
            common + ["--max-running-requests", str(args.max_running_baseline)],
            args,
            prompts,
            args.capacity_lengths,
        )
        result["baseline"] = {k: v for k, v in base.items() if k != "output_ids"}
        save()
    elif args.baseline_from:
        with open(args.baseline_from) as f:
            earlier = json.load(f)
        base = earlier["baseline"]
        result["baseline"] = base
        result["baseline_from"] = args.baseline_from
        if args.budget_gib is None:
            args.budget_gib = earlier.get("budget_gib")
    offload_lengths = args.offload_capacity_lengths
    if offload_lengths is None:
        offload_lengths = args.capacity_lengths
    offload = {}
    if "offload" in servers:
        budget = args.budget_gib
        if budget is None and base is not None:
            budget = base["memory"].get("budget_gib")
        if not budget_given and args.mem_fraction_static_offload is not None:
            budget = offload_budget_at(base, args.mem_fraction_static_offload)
        result["budget_gib"] = budget
        if offload_lengths and budget is None:
            raise SystemExit("--budget-gib is needed without the no-offload server")
        # One server per capacity length (its own region count); the first
        # also runs the exactness requests. Without lengths: one server.
        plan = [(L, offload_regions_for(L, budget, args)) for L in offload_lengths]
        plan = plan or [(None, None)]
        sizing = "decode_only" if args.pd_decode else "colocated"
        for i, (length, model) in enumerate(plan):
            regions = model[sizing] if model else args.max_running_offload
            name = "offload" if length is None else f"offload_{length // 1024}k"
            res = run_server(
                name,
                common + offload_args(regions),
                args,
                prompts if i == 0 else [],
                [length] if length else [],
            )
            res["model"] = model
            offload[str(length)] = res
            result["offload"] = {
                k: {kk: vv for kk, vv in v.items() if kk != "output_ids"}
                for k, v in offload.items()
            }
            save()
    hisparse = None
    if "hisparse" in servers:
        hisparse = run_server(
            "hisparse",
            common
            + ["--max-running-requests", str(args.max_running_hisparse)]
            + HISPARSE_ARGS
            + hisparse_fraction_args(args),
            args,
            [],
            args.capacity_lengths,
        )
        result["hisparse"] = hisparse
        save()
    ok = True
    first = next(iter(offload.values()), None)
    if base is not None and first is not None and "output_ids" in base and prompts:
        mismatched = []
        for i, (a, b) in enumerate(zip(base["output_ids"], first["output_ids"])):
            if a != b:
                diff = next(
                    (j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                    min(len(a), len(b)),
                )
                mismatched.append(
                    {"request": i, "prompt_len": lengths[i], "first_diff": diff}
                )
        result["identical_requests"] = args.num_requests - len(mismatched)
        result["mismatched"] = mismatched
        log_rows = parse_offload_log(
            os.path.join(args.out, f"server_{first['name']}.log")
        )
        result["offload_decode_log"] = log_rows
        print(f"identical: {result['identical_requests']}/{args.num_requests}")
        for r in log_rows[:: max(len(log_rows) // 12, 1)]:
            print("  ", r)
        ok = not mismatched
    for r in [base, *offload.values(), hisparse]:
        if r is None:
            continue
        print(
            f"[{r['name']}] alive after idle {r['alive_after_idle']}, leak reported "
            f"{r['leak_reported']}, memory {r['memory']}"
        )
        ok = ok and r["alive_after_idle"] and not r["leak_reported"]
        ok = ok and all(c["completed"] == c["sent"] for c in r["capacity"].values())
    if base is not None and offload and args.capacity_lengths:
        region_rows = (args.buffer_size or 4096) + args.recent_window
        result["capacity"] = capacity_rows(base, offload, region_rows, hisparse)
        sizing = "decode_only" if args.pd_decode else "colocated"
        write_capacity_report(result["capacity"], args.out, sizing)
    result["complete"] = True
    save()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
