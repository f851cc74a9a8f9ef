"""The engine's replacement policy on a top-k trace (CPU, torch reference).

Replays a trace through ``LRUCacheState(use_triton=False)`` (the LRU order;
the CLOCK replacement it was once compared with was removed from the
offload), cold admissions, and counts the misses per (step, layer, request).
Next to it the policy study's own model of the same rule (``policy_study.py``:
``lru-hitsmru``, ours' tie rule), written independently: the engine's LRU
must miss exactly what the study's model misses, swap for swap, and the
summary gives the misses against HiSparse's LRU at equal GPU rows.

    python benchmark/nsa_offload/traces/policy_engine_replay.py \\
        --trace benchmark/nsa_offload/traces/dsv32_synth_default.npz \\
        --out-dir /tmp/engine_lru
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import policy_study  # noqa: E402
import replay  # noqa: E402
from trace_format import NSATopkTrace, load_trace  # noqa: E402


def engine_misses(trace: NSATopkTrace, slots: int, window: int):
    """(S, L, B) misses of ``LRUCacheState``, cold admissions."""
    import torch
    from sglang.srt.mem_cache.lru_cache_state import LRUCacheState

    S, L, B, K = trace.topk.shape
    max_len = trace.seq_lens.max(axis=0).astype(np.int64)
    base = np.concatenate([[0], np.cumsum(max_len)[:-1]])
    r2t = np.zeros((B, int(max_len.max())), dtype=np.int32)
    for b in range(B):
        r2t[b, : max_len[b]] = base[b] + np.arange(max_len[b])
    state = LRUCacheState(
        num_layers=L,
        max_num_reqs=B,
        num_locs=int(max_len.sum()),
        buffer_size=slots,
        recent_window=window,
        top_k=K,
        device="cpu",
        use_triton=False,
    )
    r2t_t = torch.from_numpy(r2t)
    out = np.zeros((S, L, B), dtype=np.int64)
    admitted = np.zeros(B, dtype=bool)
    for s in range(S):
        cols = np.nonzero(trace.seq_lens[s] > 0)[0]
        for b in cols[~admitted[cols]]:
            state.admit_request(int(b), int(b) * (slots + window))
            admitted[b] = True
        if cols.size == 0:
            continue
        idx = torch.from_numpy(cols.astype(np.int64))
        seq = torch.from_numpy(trace.seq_lens[s, cols].astype(np.int64))
        for li in range(L):
            topk = torch.from_numpy(trace.topk[s, li, cols].copy())
            plan = state.swap_layer(li, topk, idx, seq, r2t_t)
            out[s, li, cols] = plan.miss_count.numpy()
    return out


def summary_of(trace, misses, warmup) -> Dict:
    s = replay.summarize(replay.result_from_misses(trace, misses, warmup), trace)
    return {"misses_per_row": s["misses_per_row"]}


def compare_at(trace, budget: int, window: int, warmup: int) -> Dict:
    """The engine's LRU and the study's models at ``budget`` rows."""
    slots = budget - window
    runs = {"engine_lru": engine_misses(trace, slots, window)}
    factories = policy_study.policy_factories(budget, window)
    for name in ("hisparse", "lru-hitsmru"):
        runs[f"study_{name}"] = policy_study.replay_misses(trace, factories[name][0])
    rows = {k: summary_of(trace, v, warmup) for k, v in runs.items()}
    hs = rows["study_hisparse"]["misses_per_row"]
    for row in rows.values():
        row["ratio_to_hisparse"] = row["misses_per_row"] / hs if hs else None
    checks = {
        # The same rule written twice: swap for swap.
        "engine_lru_equals_study_lru_hitsmru": bool(
            (runs["engine_lru"] == runs["study_lru-hitsmru"]).all()
        ),
    }
    return {"lru_slots": slots, "policies": rows, "checks": checks}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="a .npz top-k trace")
    p.add_argument(
        "--budgets",
        default="2560,4160,8256",
        help="comma-separated GPU rows per (request, layer): LRU slots + window "
        "(HiSparse: as many LRU rows, the newest token among them)",
    )
    p.add_argument("--window", type=int, default=64, help="recent-window rows W")
    p.add_argument(
        "--warmup",
        type=int,
        default=replay.DEFAULT_WARMUP,
        help="each request's first steps left out of the steady-state rate",
    )
    p.add_argument("--out-dir", required=True, help="where summary.json/.md go")
    args = p.parse_args(argv)
    trace = load_trace(args.trace)
    t0 = time.time()
    budgets = [int(b) for b in args.budgets.split(",")]
    results = {str(b): compare_at(trace, b, args.window, args.warmup) for b in budgets}
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    command = "python benchmark/nsa_offload/traces/policy_engine_replay.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    summary = {
        "trace": os.path.basename(args.trace),
        "shape_steps_layers_requests_topk": list(trace.topk.shape),
        "window": args.window,
        "warmup": args.warmup,
        "budgets": results,
        "code_commit": commit,
        "command": command,
        "seconds": round(time.time() - t0, 1),
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    lines = [
        f"# The engine's replacement policy on `{summary['trace']}` (CPU replay)",
        "",
        f"`{command}` at `{commit}`: per (request, layer) B GPU rows = LRU slots + a "
        f"{args.window}-row window (HiSparse: B LRU rows, the newest token among them), "
        f"cold admissions, steady state (each request's first {args.warmup} steps left "
        "out). Misses per (request, layer, step), and the ratio to HiSparse.",
        "",
        "| policy | " + " | ".join(f"B = {b}" for b in budgets) + " |",
        "|---|" + "---:|" * len(budgets),
    ]
    for name in results[str(budgets[0])]["policies"]:
        cells = []
        for b in budgets:
            row = results[str(b)]["policies"][name]
            cells.append(
                f"{row['misses_per_row']:.2f} ({row['ratio_to_hisparse']:.4f})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    ok = True
    for b in budgets:
        checks = results[str(b)]["checks"]
        ok = ok and all(checks.values())
        lines.append(
            f"Checks at B = {b}: " + ", ".join(f"{k}: {v}" for k, v in checks.items())
        )
    with open(os.path.join(args.out_dir, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
