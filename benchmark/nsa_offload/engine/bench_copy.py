"""P1: host -> GPU copy of scattered KV rows (656 B fp8 FlashMLA rows).

Side by side, for 256 ... 256K rows picked at random from a pinned host pool
and written to random GPU rows:

* ours: ``nsa_kv_offload_copy.gather_rows`` (Triton, UVA reads of pinned memory,
  count-bounded ``(bs, K)`` plan as the swap produces it), default tile and a
  sweep of tiles (word size, rows per program, warps);
* contiguous pinned H2D of the same number of bytes (``tensor.copy_``): the
  PCIe ceiling;
* ``sgl_kernel.kvcacheio.transfer_kv_per_layer_mla`` (HiCache's kernel) at its
  default ``block_quota=2`` and tuned quotas 16..132.

Every method's result is checked against the host rows. GPU time per copy is
the median over ``--repeats`` calls (CUDA events, host launch cost hidden).
Writes bench_copy.json, bench_copy.md and bench_copy.png to ``--out``.

    python benchmark/nsa_offload/engine/bench_copy.py --out /tmp/out/copy
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from typing import Dict, List

import torch

from offload_bench_utils import (
    SMOKE,
    bench_device,
    env_info,
    gbps,
    get_pyplot,
    import_offload_modules,
    markdown_table,
    require_cuda,
    sync,
    time_gpu,
    try_call,
    write_json,
    write_text,
)

TOP_K = 2048  # plan row width: the copy list of one request's layer swap


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--row-bytes",
        type=int,
        default=656,
        help="bytes of one KV row (656: fp8 FlashMLA layout)",
    )
    p.add_argument(
        "--sizes",
        type=str,
        default=",".join(str(256 << i) for i in range(11)),
        help="comma-separated row counts (default 256..262144)",
    )
    p.add_argument(
        "--sweep-sizes",
        type=str,
        default="2048,16384,131072",
        help="comma-separated rows per copy to measure",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=30,
        help="timed repetitions per point (median reported)",
    )
    p.add_argument(
        "--host-rows",
        type=int,
        default=1 << 20,
        help="rows of the pinned host buffer copied from",
    )
    p.add_argument(
        "--quotas",
        type=str,
        default="2,16,32,64,132",
        help="comma-separated block_quota values for sgl_kernel's transfer_kv_per_layer_mla",
    )
    p.add_argument("--quick", action="store_true", help="fewer sizes and configs")
    return p.parse_args()


def main():
    args = parse_args()
    require_cuda()
    _, skc, host_pool_mod, _ = import_offload_modules()
    torch.manual_seed(0)
    rb = args.row_bytes
    sizes = [int(x) for x in args.sizes.split(",")]
    sweep_sizes = [int(x) for x in args.sweep_sizes.split(",")]
    quotas = [int(x) for x in args.quotas.split(",")]
    if args.quick:
        sizes = [s for s in sizes if s in (256, 2048, 8192, 65536, 262144)]
        sweep_sizes = sweep_sizes[:2]
    max_rows = max(sizes + sweep_sizes)
    host_rows = max(args.host_rows, max_rows)
    dev = bench_device()
    errors: Dict[str, str] = {}

    # Pinned host pool (one layer) through our pool class: exercises its pinning.
    pool = host_pool_mod.NSAKVOnlyTokenToKVPoolHost(
        size=host_rows, page_size=64, layer_num=1, row_bytes=rb
    )
    assert pool.pin_memory or SMOKE, "host pool is not pinned"
    host = pool.get_kv_buffer(0)
    host_gpu = torch.randint(0, 256, host.shape, dtype=torch.uint8, device=dev)
    host.copy_(host_gpu)  # reference copy stays on the GPU for checks
    dev_rows = max(2 * max_rows, 1 << 19)
    dst_buf = torch.zeros((dev_rows, rb), dtype=torch.uint8, device=dev)
    print(f"host pool: {pool}; device buffer {dev_rows} rows", flush=True)

    def make_plan(n: int):
        src = torch.randperm(host.shape[0], device=dev)[:n]
        dst = torch.randperm(dev_rows, device=dev)[:n]
        bs = max(1, math.ceil(n / TOP_K))
        src2 = torch.zeros((bs, TOP_K), dtype=torch.int64, device=dev)
        dst2 = torch.zeros((bs, TOP_K), dtype=torch.int32, device=dev)
        src2.view(-1)[:n] = src
        dst2.view(-1)[:n] = dst.to(torch.int32)
        count = torch.clamp(n - torch.arange(bs, device=dev) * TOP_K, 0, TOP_K).to(
            torch.int32
        )
        return {"src": src, "dst": dst, "src2": src2, "dst2": dst2, "count": count}

    def check(plan, what):
        got = dst_buf[plan["dst"]]
        want = host_gpu[plan["src"]]
        if not torch.equal(got, want):
            bad = (got != want).any(-1).sum().item()
            raise AssertionError(f"{what}: {bad} of {len(got)} rows wrong")

    def run_checked(what, plan, fn):
        dst_buf[plan["dst"]] = 0
        fn(0)
        sync()
        check(plan, what)
        return True

    def ours_fn(plan, cfg):
        def fn(_i):
            skc.gather_rows(
                host,
                dst_buf,
                plan["src2"],
                plan["dst2"],
                plan["count"],
                rb,
                **cfg,
            )

        return fn

    # ---- tile sweep -----------------------------------------------------
    configs = [
        dict(word_bytes=w, block_rows=br, num_warps=nw, split_tail=True)
        for w, br, nw in itertools.product((4, 8), (4, 8, 16, 32), (2, 4, 8))
    ]
    configs += [
        dict(word_bytes=4, block_rows=16, num_warps=4, split_tail=False),
        dict(word_bytes=8, block_rows=16, num_warps=4, split_tail=False),
    ]
    if args.quick:
        configs = [c for c in configs if c["num_warps"] == 4 and c["block_rows"] >= 8]
    default_cfg = dict(
        word_bytes=skc.pick_word_bytes(rb),
        block_rows=skc.DEFAULT_BLOCK_ROWS,
        num_warps=skc.DEFAULT_NUM_WARPS,
        split_tail=True,
    )
    sweep: List[dict] = []
    for n in sweep_sizes:
        plan = make_plan(n)
        for cfg in configs:
            name = "ours " + cfg_name(cfg)
            ok = try_call(
                f"{name} n={n} check",
                lambda: run_checked(name, plan, ours_fn(plan, cfg)),
                errors,
            )
            if not ok:
                continue
            t = time_gpu(ours_fn(plan, cfg), args.repeats)
            sweep.append(
                {"rows": n, "config": cfg, **t, "GBps": gbps(n * rb, t["median_us"])}
            )
            print(
                f"sweep n={n:7d} {cfg_name(cfg):28s} {t['median_us']:9.2f} us "
                f"{gbps(n * rb, t['median_us']):6.2f} GB/s",
                flush=True,
            )
    best_cfg = pick_best(sweep, configs, sweep_sizes) or default_cfg
    print(f"best tile over the sweep: {cfg_name(best_cfg)}", flush=True)

    # ---- peers ------------------------------------------------------------
    transfer = try_call(
        "import sgl_kernel.kvcacheio.transfer_kv_per_layer_mla",
        lambda: __import__(
            "sgl_kernel.kvcacheio", fromlist=["x"]
        ).transfer_kv_per_layer_mla,
        errors,
    )

    results: List[dict] = []
    for n in sizes:
        plan = make_plan(n)
        nbytes = n * rb
        row = {"rows": n, "bytes": nbytes}

        def contiguous(_i):
            dst_buf.view(-1)[:nbytes].copy_(host.view(-1)[:nbytes], non_blocking=True)

        row["contiguous"] = time_gpu(contiguous, args.repeats)
        for label, cfg in (("ours_default", default_cfg), ("ours_best", best_cfg)):
            ok = try_call(
                f"{label} n={n}",
                lambda: run_checked(label, plan, ours_fn(plan, cfg)),
                errors,
            )
            if ok:
                row[label] = time_gpu(ours_fn(plan, cfg), args.repeats)
        if transfer is not None:
            src_i64 = plan["src"].to(torch.int64)
            dst_i64 = plan["dst"].to(torch.int64)
            for q in quotas:

                def tkv(_i, q=q):
                    transfer(
                        src=host,
                        dst=dst_buf,
                        src_indices=src_i64,
                        dst_indices=dst_i64,
                        item_size=rb,
                        block_quota=q,
                        num_warps_per_block=32,
                    )

                key = f"transfer_kv_q{q}"
                ok = try_call(
                    f"{key} n={n}", lambda: run_checked(key, plan, tkv), errors
                )
                if ok:
                    row[key] = time_gpu(tkv, args.repeats)
            tk = {k: v for k, v in row.items() if k.startswith("transfer_kv_q")}
            if tk:
                best_q = min(tk, key=lambda k: tk[k]["median_us"])
                row["transfer_kv_best"] = dict(tk[best_q], quota=int(best_q[13:]))
        for k, v in list(row.items()):
            if isinstance(v, dict) and "median_us" in v:
                v["GBps"] = gbps(nbytes, v["median_us"])
        results.append(row)
        line = " ".join(
            f"{k}={v['median_us']:.1f}us/{v['GBps']:.1f}GB/s"
            for k, v in row.items()
            if isinstance(v, dict)
            and k
            in (
                "contiguous",
                "ours_default",
                "ours_best",
                "transfer_kv_q2",
                "transfer_kv_best",
            )
        )
        print(f"n={n:7d} {line}", flush=True)

    # ---- verdicts ---------------------------------------------------------
    verdict = {}
    big = [r for r in results if r["rows"] >= 8192 and "ours_best" in r]
    if big:
        ratios = [r["ours_best"]["GBps"] / r["contiguous"]["GBps"] for r in big]
        verdict["min_ratio_vs_contiguous_ge_8K_rows"] = min(ratios)
        verdict["target_ratio_0.90_met"] = min(ratios) >= 0.90
    r2k = [r for r in results if r["rows"] == 2048 and "ours_best" in r]
    if r2k:
        r = r2k[0]
        verdict["us_at_2K_rows"] = r["ours_best"]["median_us"]
        verdict["target_15us_at_2K_met"] = r["ours_best"]["median_us"] <= 15.0
        verdict["contiguous_us_at_2K_rows"] = r["contiguous"]["median_us"]
        verdict["note_2K"] = (
            "2048 x 656 B = 1.34 MB; at the contiguous PCIe rate this alone takes "
            f"{r['contiguous']['median_us']:.1f} us, so <= 15 us is below the "
            "physical floor of a PCIe Gen5 x16 link"
        )

    out = {
        "env": env_info(),
        "row_bytes": rb,
        "host_pool": {
            "tokens": pool.size,
            "layers": pool.layer_num,
            "row_bytes": pool.row_bytes,
            "pinned": pool.pin_memory,
        },
        "default_config": default_cfg,
        "best_config": best_cfg,
        "sweep": sweep,
        "results": results,
        "verdict": verdict,
        "errors": errors,
    }
    write_json(args.out, "bench_copy.json", out)
    write_text(args.out, "bench_copy.md", render_md(out))
    plot(args.out, results, rb)
    print(render_md(out), flush=True)
    pool.close()
    return 0


def cfg_name(cfg) -> str:
    return (
        f"w{cfg['word_bytes']}_br{cfg['block_rows']}_nw{cfg['num_warps']}"
        f"{'' if cfg.get('split_tail', True) else '_nosplit'}"
    )


def pick_best(sweep, configs, sweep_sizes):
    """The config with the smallest sum over sizes of time / best time at that size."""
    best_at = {}
    for s in sweep:
        best_at[s["rows"]] = min(best_at.get(s["rows"], 1e30), s["median_us"])
    score = {}
    for s in sweep:
        key = cfg_name(s["config"])
        score.setdefault(key, [0.0, 0, s["config"]])
        score[key][0] += s["median_us"] / best_at[s["rows"]]
        score[key][1] += 1
    full = [v for v in score.values() if v[1] == len(sweep_sizes)]
    if not full:
        return None
    return min(full, key=lambda v: v[0])[2]


def render_md(out) -> str:
    rb = out["row_bytes"]
    cols = [
        "contiguous",
        "ours_default",
        "ours_best",
        "transfer_kv_q2",
        "transfer_kv_best",
    ]
    header = ["rows", "MB"]
    for c in cols:
        header += [f"{c} us", f"{c} GB/s"]
    header += ["ours_best / contiguous", "best quota"]
    rows = []
    for r in out["results"]:
        line = [r["rows"], r["bytes"] / 1e6]
        for c in cols:
            v = r.get(c)
            line += [v["median_us"], v["GBps"]] if v else [None, None]
        ratio = (
            r["ours_best"]["GBps"] / r["contiguous"]["GBps"]
            if "ours_best" in r
            else None
        )
        line += [ratio, r.get("transfer_kv_best", {}).get("quota")]
        rows.append(line)
    text = f"# P1: scattered {rb} B row copy, host (pinned) -> GPU\n\n"
    text += f"GPU: {out['env'].get('gpu')}; medians of GPU time (CUDA events).\n\n"
    text += f"ours_default = {cfg_name(out['default_config'])}, "
    text += f"ours_best = {cfg_name(out['best_config'])} (picked by the sweep).\n\n"
    text += markdown_table(header, rows)
    text += "\n## Tile sweep (ours)\n\n"
    text += markdown_table(
        ["rows", "config", "median us", "GB/s"],
        [
            [s["rows"], cfg_name(s["config"]), s["median_us"], s["GBps"]]
            for s in out["sweep"]
        ],
    )
    text += "\n## Verdict\n\n"
    for k, v in out["verdict"].items():
        text += f"- {k}: {v}\n"
    if out["errors"]:
        text += "\n## Skipped / failed\n\n"
        for k, v in out["errors"].items():
            text += f"- {k}: {v}\n"
    return text


def plot(out_dir, results, row_bytes):
    plt = get_pyplot()
    if plt is None:
        return
    import os

    fig, ax = plt.subplots(figsize=(8, 5))
    for key, style in (
        ("contiguous", "k--"),
        ("ours_default", "b-o"),
        ("ours_best", "g-o"),
        ("transfer_kv_q2", "r:s"),
        ("transfer_kv_best", "r-s"),
    ):
        xs = [r["rows"] for r in results if key in r]
        ys = [r[key]["GBps"] for r in results if key in r]
        if xs:
            ax.plot(xs, ys, style, label=key)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"rows copied ({row_bytes} B each)")
    ax.set_ylabel("GB/s (GPU time)")
    ax.set_title("host -> GPU scattered row copy")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = os.path.join(out_dir, "bench_copy.png")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
