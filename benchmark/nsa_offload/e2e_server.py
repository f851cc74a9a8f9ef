"""End-to-end checks on real sglang servers (GPU host): exactness, capacity,
no leaks.

Starts the tiny DeepSeek-V3.2-shaped model twice, one server after the other,
with the same GPU memory budget (same ``--mem-fraction-static``), without and
with --enable-decode-nsa-kv-offload, both on the same top-k path (positional
top-k + page-table transform: SGLANG_NSA_FUSE_TOPK=0). On each server:

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
second GPU).

    python benchmark/nsa_offload/e2e_server.py --out DIR [--capacity-lengths 16384,131072]
"""

import argparse
import gzip
import json
import os
import re
import shutil
import tempfile
import time

from capacity import INDEXER_BYTES, PAGE
from capacity import ROW_BYTES_FP8 as ROW_BYTES
from capacity import model_rows, scan_log
from server_utils import TINY_CONFIG, Server, random_prompts

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


# Memory lines of sglang's startup log (GB = GiB there).
MEM_RES = {
    "before_weights": re.compile(r"Load weight begin\. avail mem=([0-9.]+) GB"),
    "after_weights": re.compile(r"Load weight end\..*?avail mem=([0-9.]+) GB"),
    "graph_begin": re.compile(r"Capture cuda graph begin\..*?avail mem=([0-9.]+) GB"),
}


def memory_from_log(path: str, mem_fraction: float) -> dict:
    """GPU memory the server's pools took (after weights -> before CUDA graph
    capture: KV/indexer pools, and with the offload its regions, staging and
    LRU state) and the budget sglang handed the pool sizing
    (``_profile_available_bytes``: after weights - before x (1 - f))."""
    with open(path) as f:
        text = f.read()
    found = {
        k: float(r.search(text).group(1)) for k, r in MEM_RES.items() if r.search(text)
    }
    out = dict(found)
    if {"after_weights", "graph_begin"} <= found.keys():
        out["pools_gib"] = round(found["after_weights"] - found["graph_begin"], 3)
    if {"before_weights", "after_weights"} <= found.keys():
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
            context_len=args.context_length,
            prefill_budget=16384,  # max(chunked_prefill_size, max_prefill_tokens)
        )
    )
    return rows[0]


def capacity_phase(server, name, args, length):
    """More requests of ``length`` tokens than the server holds, all at once;
    the peak #running-req logged meanwhile is the measured capacity."""
    tokens = length + args.capacity_new_tokens
    _, total_tokens, regions = scan_log(server.log_path)
    per_req = (tokens + PAGE - 1) // PAGE * PAGE
    predicted = total_tokens // per_req
    if regions is not None:
        predicted = min(regions, predicted)
    n = int(predicted * args.capacity_oversubscribe) + 2
    print(f"[{name}] capacity {length}: predicted {predicted}, sending {n}", flush=True)
    prompts = random_prompts([length] * n, seed=length)
    start = os.path.getsize(server.log_path)
    tic = time.time()
    outs = server.generate_many(prompts, args.capacity_new_tokens, n)
    elapsed = time.time() - tic
    peak = scan_log(server.log_path, start)[0]
    print(
        f"[{name}] capacity {length}: peak running {peak} ({elapsed:.0f} s)", flush=True
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
        "elapsed_s": elapsed,
    }


def run_server(name, extra_args, args, prompts, lengths):
    """One server: the exactness requests (if ``prompts``), the capacity
    phases, then idle (sglang's own leak check runs when it goes idle)."""
    env = {"SGLANG_NSA_FUSE_TOPK": "0"}
    result = {"name": name, "args": extra_args, "capacity": {}}
    with Server(name, extra_args, args.port, args.out, env=env) as server:
        if prompts:
            tic = time.time()
            outs = server.generate_many(prompts, args.max_new_tokens, args.concurrency)
            result["exactness_elapsed_s"] = time.time() - tic
            result["output_ids"] = [o["output_ids"] for o in outs]
        for length in lengths:
            result["capacity"][str(length)] = capacity_phase(server, name, args, length)
        time.sleep(args.idle_wait)
        result["alive_after_idle"] = server.proc.poll() is None
    with open(server.log_path) as f:
        result["leak_reported"] = "memory leak" in f.read().lower()
    result["memory"] = memory_from_log(server.log_path, args.mem_fraction_static)
    return result


def num_model_layers() -> int:
    with open(TINY_CONFIG) as f:
        return json.load(f)["num_hidden_layers"]


def capacity_rows(base: dict, offload: dict, region_rows: int) -> list:
    """Measured capacity per length: raw (same --mem-fraction-static) and at
    equal GPU bytes. Upstream's fp8 NSA pool sizing counts 576 B per KV row
    but allocates 656 B, so the no-offload server takes ~11% more GPU memory
    than the budget it was given; its capacity scales linearly with its pool
    bytes, so it is rescaled to the offload server's pool bytes."""
    rows = []
    for key, ours in offload.items():
        b = base.get("capacity", {}).get(key)
        if b is None:
            continue
        o = ours["capacity"][key]
        tokens = o["length"] + o["new_tokens"]
        bound = (
            tokens
            * (ROW_BYTES + INDEXER_BYTES)
            / (tokens * INDEXER_BYTES + region_rows * ROW_BYTES)
        )
        row = {
            "length": o["length"],
            "baseline_peak": b["peak_running"],
            "offload_peak": o["peak_running"],
            "offload_regions": o["regions"],
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
        rows.append(row)
    return sorted(rows, key=lambda r: r["length"])


DRIVER_PREDICTED_RE = re.compile(
    r"^\[(\S+)\] capacity (\d+): predicted (\d+), sending (\d+)", re.M
)
DRIVER_PEAK_RE = re.compile(r"^\[(\S+)\] capacity (\d+): peak running (\d+)", re.M)
MEM_FRACTION_RE = re.compile(r"mem_fraction_static=([0-9.]+)")


def _unzipped(run_dir: str) -> str:
    """``run_dir``, or a temporary copy with its ``*.gz`` files unpacked
    (committed results keep server logs gzipped)."""
    gz = [f for f in os.listdir(run_dir) if f.endswith(".gz")]
    if not gz:
        return run_dir
    tmp = tempfile.mkdtemp(prefix="e2e_run_")
    for f in os.listdir(run_dir):
        src = os.path.join(run_dir, f)
        if f.endswith(".gz"):
            with gzip.open(src) as fin, open(os.path.join(tmp, f[:-3]), "wb") as fout:
                shutil.copyfileobj(fin, fout)
        elif os.path.isfile(src):
            shutil.copy(src, tmp)
    return tmp


def load_run(run_dir: str, new_tokens: int) -> tuple:
    """(no-offload result, {length: offload result}) of an earlier run: its
    ``e2e_server.json``, or, for a run cut before writing it, this script's
    own output (``RUN_DIR/driver.log``: predicted / sent / peak per phase)
    and the server logs (memory). Requests completed are then unknown."""
    run_dir = _unzipped(run_dir)
    path = os.path.join(run_dir, "e2e_server.json")
    if os.path.exists(path):
        with open(path) as f:
            r = json.load(f)
        return r.get("baseline"), r.get("offload", {})
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
        with open(log_path) as f:
            fraction = float(MEM_FRACTION_RE.search(f.read()).group(1))
        res["memory"] = memory_from_log(log_path, fraction)
        regions = scan_log(log_path)[2]
        for c in res["capacity"].values():
            c["regions"] = regions
        # a phase the run was cut in has no peak
        res["capacity"] = {
            k: c for k, c in res["capacity"].items() if "peak_running" in c
        }
    base = servers.pop("baseline", None)
    offload = {}
    for res in servers.values():
        for length in res["capacity"]:
            offload[length] = res
    return base, offload


def report_from_runs(args) -> None:
    """One capacity table from several runs (each offload length with the
    no-offload result of its own run if it has one, else of another run)."""
    bases, rows = [], []
    region_rows = (args.buffer_size or 4096) + args.recent_window
    loaded = [(d, *load_run(d, args.capacity_new_tokens)) for d in args.report_from]
    for run_dir, base, _ in loaded:
        if base is not None:
            bases.append((run_dir, base))
    for run_dir, base, offload in loaded:
        for length, ours in offload.items():
            for base_dir, b in [(run_dir, base)] * (base is not None) + bases:
                if length in b.get("capacity", {}):
                    break
            else:
                continue
            if ours.get("model") is None:
                ours["model"] = offload_regions_for(
                    int(length), b["memory"]["budget_gib"], args
                )
            for row in capacity_rows(b, {length: ours}, region_rows):
                row.update(offload_run=run_dir, baseline_run=base_dir)
                rows.append(row)
    rows.sort(key=lambda r: r["length"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "capacity.json"), "w") as f:
        json.dump({"config": vars(args), "rows": rows}, f, indent=1)
    write_capacity_report(rows, args.out)


def write_capacity_report(rows: list, out: str) -> None:
    lines = [
        "| length (+new) | no offload: peak running | pools GiB | offload: regions | "
        "peak running | pools GiB | ratio (same fraction) | ratio (equal bytes) | "
        "bound | equal bytes / bound | model (colocated) | all completed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r.get("model") or {}
        lines.append(
            f"| {r['length']} | {r['baseline_peak']} | {r['baseline_pools_gib']} | "
            f"{r['offload_regions']} | {r['offload_peak']} | {r['offload_pools_gib']} | "
            f"{r['ratio_same_fraction']:.2f} | {r.get('ratio_equal_bytes', float('nan')):.2f} | "
            f"{r['bound']:.2f} | {r.get('equal_bytes_vs_bound', float('nan')):.2f} | "
            f"{m.get('colocated_ratio', float('nan')):.2f} | "
            f"{'not recorded' if r['all_completed'] is None else r['all_completed']} |"
        )
    with open(os.path.join(out, "capacity.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    x = [r["length"] // 1024 for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
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
        [(r.get("model") or {}).get("colocated_ratio") for r in rows],
        "^-.",
        label="sizing model (colocated)",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(x)
    ax.set_xticklabels([f"{v}K" for v in x])
    ax.set_xlabel("request length (tokens)")
    ax.set_ylabel("running requests: offload / no offload")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "capacity.png"), dpi=110)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--servers", default="baseline,offload")
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
    p.add_argument("--capacity-new-tokens", type=int, default=512)
    p.add_argument("--capacity-oversubscribe", type=float, default=1.25)
    p.add_argument(
        "--budget-gib",
        type=float,
        help="pool budget for the offload's region counts (default: read "
        "from the no-offload server's log)",
    )
    p.add_argument("--budget-margin-gib", type=float, default=0.02)
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--idle-wait", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--report-from",
        nargs="+",
        metavar="RUN_DIR",
        help="no servers: one capacity table (capacity.json/md/png in --out) "
        "from earlier runs' directories",
    )
    args = p.parse_args()
    if args.report_from:
        report_from_runs(args)
        return
    os.makedirs(args.out, exist_ok=True)
    servers = args.servers.split(",")

    step = (args.max_len - args.min_len) / max(args.num_requests - 1, 1)
    lengths = [int(args.min_len + i * step) for i in range(args.num_requests)]
    prompts = random_prompts(lengths, args.seed) if args.num_requests else []
    common = [
        "--mem-fraction-static",
        str(args.mem_fraction_static),
        "--decode-log-interval",
        "10",
    ]
    if args.context_length:
        common += ["--context-length", str(args.context_length)]

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
        return extra

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
        result["budget_gib"] = budget
        if offload_lengths and budget is None:
            raise SystemExit("--budget-gib is needed without the no-offload server")
        # One server per capacity length (its own region count); the first
        # also runs the exactness requests. Without lengths: one server.
        plan = [(L, offload_regions_for(L, budget, args)) for L in offload_lengths]
        plan = plan or [(None, None)]
        for i, (length, model) in enumerate(plan):
            regions = model["colocated"] if model else args.max_running_offload
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
    for r in [base, *offload.values()]:
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
        result["capacity"] = capacity_rows(base, offload, region_rows)
        write_capacity_report(result["capacity"], args.out)
    result["complete"] = True
    save()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
