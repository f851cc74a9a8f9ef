"""The miss copy in the decode step's shape: why 1,000 rows take ~45 us.

The rank model's step profile at 30K x 64 (warm units, reported trace) shows
``gather_rows`` at ~45 us per layer for ~1,030 rows (16 per request), where
``bench_copy.py`` copies 1,024 rows of one request in ~20 us. This separates
the candidate causes, side by side on one GPU:

* the launch shape: a ``(64, K / block_rows)`` grid with ~16 rows per request
  (most programs find no tile and exit) against the same rows as one request;
  ``programs_per_row`` / ``block_rows`` variants;
* the host pool: rows drawn at random from pools of 0.17 GB to the size of a
  rank layer's region (1.5 GB) and beyond, pinned by ``cudaHostRegister`` with
  transparent huge pages asked for (``MADV_HUGEPAGE``) or refused
  (``MADV_NOHUGEPAGE``), or by ``cudaHostAlloc`` (torch);
* locality: the same rows sorted by host address.

Every configuration is checked against the host rows once. GPU time: median
of ``--repeats`` calls, each on a fresh random plan (CUDA events, host launch
hidden). Writes bench_gather_shape.json / .md to ``--out``.

    python benchmark/nsa_offload/engine/bench_gather_shape.py --out /tmp/out/gather
"""

from __future__ import annotations

import argparse
import ctypes
import time
from typing import Dict, List

import torch
from offload_bench_utils import (
    SMOKE,
    bench_device,
    env_info,
    gbps,
    import_offload_modules,
    markdown_table,
    require_cuda,
    sync,
    time_gpu,
    write_json,
    write_text,
)

TOP_K = 2048
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
PAGE = 4096


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--row-bytes", type=int, default=656, help="bytes of one KV row (656: fp8)"
    )
    p.add_argument(
        "--pool-rows",
        default="262144,2259968,16777216",
        help="comma-separated host pool sizes in rows (2259968: a rank layer)",
    )
    p.add_argument(
        "--pin",
        default="register_default,register_thp,register_nothp,torch",
        help="comma-separated pin methods (torch only at the middle size)",
    )
    p.add_argument(
        "--batch", type=int, default=64, help="requests per copy (the plan's rows)"
    )
    p.add_argument(
        "--mean-rows",
        default="4,16,64",
        help="comma-separated mean rows per request (uniform 0..2x mean)",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated launch variants to time (default: all)",
    )
    p.add_argument(
        "--repeats", type=int, default=40, help="timed copies per point (median)"
    )
    p.add_argument("--plans", type=int, default=16, help="random plans cycled")
    return p.parse_args()


def thp_state() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError as e:
        return f"unreadable: {e}"


def madvise(buf: torch.Tensor, advice: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    start = buf.data_ptr() // PAGE * PAGE
    length = buf.data_ptr() + buf.nbytes - start
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)


def alloc_pool(rows: int, row_bytes: int, pin: str):
    """A pinned one-layer host buffer ``(rows, row_bytes)`` and its unpin."""
    if SMOKE or pin == "torch":  # CPU smoke: a plain buffer
        pinned = not SMOKE
        buf = torch.empty((rows, row_bytes), dtype=torch.uint8, pin_memory=pinned)
        fill_rows(buf)
        return buf, lambda: None
    buf = torch.empty((rows, row_bytes), dtype=torch.uint8)
    rc = 0
    if pin != "register_default":  # as the product's host pool: no advice
        rc = madvise(buf, MADV_HUGEPAGE if pin == "register_thp" else MADV_NOHUGEPAGE)
    fill_rows(buf)  # touch every page after the advice
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(buf.data_ptr(), buf.nbytes, 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err} (madvise rc {rc})")
    return buf, lambda: cudart.cudaHostUnregister(buf.data_ptr())


def fill_rows(buf: torch.Tensor) -> None:
    # Distinct 8-byte words everywhere (the check can tell rows apart), fast.
    words = buf.view(-1).view(torch.int64)
    torch.arange(words.numel(), dtype=torch.int64, out=words)


def anon_huge_kb() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def make_plans(n_plans, host_rows, dev_rows, bs, mean, sort_src, dev, gen):
    plans = []
    for _ in range(n_plans):
        if bs == 1:
            count = torch.tensor([mean], dtype=torch.int32)
        else:
            count = torch.randint(0, 2 * mean + 1, (bs,), generator=gen).int()
        total = int(count.sum())
        src = torch.randint(0, host_rows, (total,), generator=gen)
        dst = torch.randperm(dev_rows, generator=gen)[:total]
        src2 = torch.zeros((bs, TOP_K), dtype=torch.int64)
        dst2 = torch.zeros((bs, TOP_K), dtype=torch.int32)
        at = 0
        for b, c in enumerate(count.tolist()):
            s = src[at : at + c]
            if sort_src:
                s = s.sort().values
            src2[b, :c] = s
            dst2[b, :c] = dst[at : at + c].int()
            at += c
        plans.append(
            {
                "src2": src2.to(dev),
                "dst2": dst2.to(dev),
                "count": count.to(dev),
                "rows": total,
            }
        )
    return plans


VARIANTS = {
    "default": {},
    # One program per tile of the (bs, K) plan: the default before the cap
    # (gather_rows clamps programs_per_row to the tile count).
    "tile_grid": {"programs_per_row": 1 << 30},
    "ppr8": {"programs_per_row": 8},
    "ppr16_br8": {"programs_per_row": 16, "block_rows": 8},
    "br8": {"block_rows": 8},
    "br4": {"block_rows": 4},
    "nw8": {"num_warps": 8},
}


def main():
    args = parse_args()
    require_cuda()
    _, skc, _, _ = import_offload_modules()
    dev = bench_device()
    rb = args.row_bytes
    gen = torch.Generator().manual_seed(0)
    pool_sizes = [int(x) for x in args.pool_rows.split(",")]
    pins = args.pin.split(",")
    means = [int(x) for x in args.mean_rows.split(",")]
    dev_rows = args.batch * 28672
    dst_buf = torch.zeros((dev_rows, rb), dtype=torch.uint8, device=dev)
    result: Dict = {"env": env_info(), "thp": thp_state(), "rows": []}
    print(f"THP: {result['thp']}", flush=True)
    mid = pool_sizes[len(pool_sizes) // 2]
    for rows in pool_sizes:
        for pin in pins:
            if pin == "torch" and rows != mid:
                continue
            t0 = time.perf_counter()
            try:
                host, unpin = alloc_pool(rows, rb, pin)
            except Exception as e:  # noqa: BLE001 - reported, next pool
                result["rows"].append({"pool_rows": rows, "pin": pin, "error": str(e)})
                print(f"pool {rows} {pin}: {e}", flush=True)
                continue
            pool = {
                "pool_rows": rows,
                "pool_gb": rows * rb / 1e9,
                "pin": pin,
                "alloc_s": round(time.perf_counter() - t0, 1),
                "anon_huge_kb": anon_huge_kb(),
            }
            print(f"pool {pool}", flush=True)
            shapes = [(args.batch, m, False) for m in means]
            shapes += [(args.batch, 16, True), (1, 1024, False)]
            for bs, mean, sort_src in shapes:
                plans = make_plans(
                    args.plans, rows, dev_rows, bs, mean, sort_src, dev, gen
                )
                for vname, kw in VARIANTS.items():
                    if vname not in args.variants.split(","):
                        continue
                    if bs == 1 and vname not in ("default", "tile_grid", "ppr8"):
                        continue
                    if sort_src and vname != "default":
                        continue

                    def fn(i, kw=kw):
                        p = plans[i % len(plans)]
                        skc.gather_rows(
                            host, dst_buf, p["src2"], p["dst2"], p["count"], rb, **kw
                        )

                    p = plans[0]
                    fn(0)
                    sync()
                    n = p["rows"]
                    s = p["src2"].cpu()
                    d = p["dst2"].cpu()
                    c = p["count"].cpu().tolist()
                    srcs = torch.cat([s[b, : c[b]] for b in range(len(c))])
                    dsts = torch.cat([d[b, : c[b]] for b in range(len(c))]).long()
                    ok = torch.equal(dst_buf[dsts.to(dev)].cpu(), host[srcs])
                    t = time_gpu(fn, args.repeats)
                    mean_rows = sum(q["rows"] for q in plans) / len(plans)
                    row = {
                        **pool,
                        "batch": bs,
                        "mean_rows_per_request": mean,
                        "sorted_src": sort_src,
                        "variant": vname,
                        "rows_per_copy": mean_rows,
                        "ok": ok,
                        **t,
                        "GBps": gbps(mean_rows * rb, t["median_us"]),
                    }
                    result["rows"].append(row)
                    print(
                        f"  bs {bs:3d} mean {mean:5d} sorted {int(sort_src)} "
                        f"{vname:10s} rows {mean_rows:7.0f} {t['median_us']:7.1f} us "
                        f"{row['GBps']:5.1f} GB/s ok={ok}",
                        flush=True,
                    )
            # The contiguous copy of ~1,000 rows' bytes from this pool.
            n = args.batch * 16
            src_view = host[:n]
            tmp = torch.empty((n, rb), dtype=torch.uint8, device=dev)
            t = time_gpu(lambda i: tmp.copy_(src_view, non_blocking=True), args.repeats)
            result["rows"].append(
                {**pool, "variant": "contiguous", "rows_per_copy": n, **t}
            )
            print(f"  contiguous {n} rows {t['median_us']:.1f} us", flush=True)
            del host
            unpin()
    write_json(args.out, "bench_gather_shape.json", result)
    table = [
        [
            r["pool_gb"],
            r["pin"],
            r.get("batch", "-"),
            r.get("mean_rows_per_request", "-"),
            "yes" if r.get("sorted_src") else "no",
            r["variant"],
            round(r["rows_per_copy"]),
            round(r["median_us"], 1),
            round(r.get("GBps", gbps(r["rows_per_copy"] * rb, r["median_us"])), 1),
            r.get("ok", "-"),
        ]
        for r in result["rows"]
        if "error" not in r
    ]
    header = [
        "pool GB",
        "pin",
        "batch",
        "mean rows/req",
        "sorted",
        "variant",
        "rows",
        "us",
        "GB/s",
        "ok",
    ]
    write_text(
        args.out,
        "bench_gather_shape.md",
        f"THP: {result['thp']}\n\n" + markdown_table(header, table) + "\n",
    )
    bad = [r for r in result["rows"] if r.get("ok") is False]
    print(f"{'FAILED' if bad else 'OK'}: {len(result['rows'])} rows", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
