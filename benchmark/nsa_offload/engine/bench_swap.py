"""P2: one layer's whole swap (lookup + LRU + page table + miss copy).

For batch sizes 1/16/64/128, top-k 2048, LRU buffer 4096 rows per request and
miss rates 0.1% / 5% / 20% / 100%, on identical inputs:

* ours: ``SparseCacheController.swap_one_layer`` (LRU swap kernel + the
  count-bounded Triton miss copy), eager and captured in a CUDA graph, plus
  the LRU kernel alone;
* the bare copy of the same number of rows (``nsa_kv_offload_copy.gather_rows``);
* upstream HiSparse's ``load_cache_to_device_buffer_mla`` (JIT kernel of
  sglang 0.5.12.post1, block_size 1024 as its coordinator uses), with the same
  top-k, buffer size, resident set and miss pattern.

Controlled miss rate: every request starts with positions [0, 4096) resident
in both caches (slot s holds position s). Each step's top-k is a fixed "hit"
set H of 2048 - M resident positions plus M fresh positions, shuffled. Fresh
sets rotate with a period long enough that a set has been evicted again
before it comes back (both caches evict least recently used first), so every
step has exactly M misses per request; ours asserts it from its plan. Window
and newest-token positions are never picked (both designs would hit them).
Both results are checked against the host rows.

Writes bench_swap.json, bench_swap.md and bench_swap.png to ``--out``.

    python benchmark/nsa_offload/engine/bench_swap.py --out /tmp/out/swap
"""

from __future__ import annotations

import argparse
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

PAGE = 64


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        required=True,
        help="output directory (created) for the JSON/markdown results",
    )
    p.add_argument(
        "--batch-sizes",
        type=str,
        default="1,16,64,128",
        help="comma-separated decode batch sizes",
    )
    p.add_argument(
        "--miss-rates",
        type=str,
        default="0.001,0.05,0.2,1.0",
        help="comma-separated shares of the top-k that miss per step",
    )
    p.add_argument("--top-k", type=int, default=2048, help="indexer top-k width K")
    p.add_argument(
        "--buffer-size",
        type=int,
        default=4096,
        help="LRU rows per request and layer (C)",
    )
    p.add_argument(
        "--window", type=int, default=64, help="recent-window rows per request (W)"
    )
    p.add_argument("--ctx", type=int, default=16384, help="tokens per request")
    p.add_argument(
        "--row-bytes",
        type=int,
        default=656,
        help="bytes of one KV row (656: fp8 FlashMLA layout)",
    )
    p.add_argument("--iters", type=int, default=40, help="timed iterations per point")
    p.add_argument(
        "--hisparse-block-size",
        type=int,
        default=1024,
        help="HiSparse's swap kernel block size",
    )
    p.add_argument(
        "--no-hisparse", action="store_true", help="skip HiSparse's swap (only ours)"
    )
    return p.parse_args()


class Setup:
    """Host pool, both caches and the controlled top-k stream for one batch size."""

    def __init__(self, args, bs, mods):
        lru_mod, skc, host_mod, ctrl_mod = mods
        self.args, self.bs = args, bs
        self.skc, self.lru_mod = skc, lru_mod
        K, C, W, ctx, rb = (
            args.top_k,
            args.buffer_size,
            args.window,
            args.ctx,
            args.row_bytes,
        )
        self.K, self.C, self.W, self.ctx, self.rb = K, C, W, ctx, rb
        dev = bench_device()
        self.dev = dev
        # Token loc of (request r, position p): PAGE + r * ctx + p.
        self.host = host_mod.NSAKVOnlyTokenToKVPoolHost(
            size=bs * ctx, page_size=PAGE, layer_num=1, row_bytes=rb
        )
        assert self.host.pin_memory or SMOKE
        self.host_rows = self.host.get_kv_buffer(0)
        self.host_gpu = torch.randint(
            0, 256, self.host_rows.shape, dtype=torch.uint8, device=dev
        )
        self.host_rows.copy_(self.host_gpu)
        pos = torch.arange(ctx, device=dev)
        r = torch.arange(bs, device=dev)
        self.locs64 = (PAGE + r[:, None] * ctx + pos[None, :]).to(torch.int64)
        self.req_to_token = self.locs64.to(torch.int32).contiguous()
        self.req_idx = r.to(torch.int64)
        self.seq_lens32 = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
        self.seq_lens64 = self.seq_lens32.to(torch.int64)
        self.num_real = torch.tensor([bs], dtype=torch.int32, device=dev)

        # ---- ours: controller over a one-layer device buffer of bs regions
        self.R = C + W
        self.dev_kv = torch.zeros((bs * self.R, rb), dtype=torch.uint8, device=dev)
        self.ctrl = ctrl_mod.SparseCacheController(
            [self.dev_kv],
            self.host,
            max_num_reqs=bs,
            top_k=K,
            buffer_size=C,
            recent_window=W,
            region_start_row=0,
            num_regions=bs,
            max_batch_size=bs,
            warm_tokens=0,
        )
        self.reset_ours()

    def reset_ours(self):
        """Every request: fresh region, positions [0, C) resident at slot = position."""
        bs, C, R, rb = self.bs, self.C, self.R, self.rb
        resident = self.locs64[:, :C]
        for i in range(bs):
            if self.ctrl.is_admitted(i):
                self.ctrl.release_request(i)
            base = self.ctrl.admit_request(i)
            assert base == i * R
            rows = self.ctrl.lru.warm_request(0, i, resident[i])
            expect = base + torch.arange(C, device=self.dev, dtype=torch.int32)
            assert torch.equal(rows[0], expect), "warm_request slot layout"
        self.dev_kv.view(bs, R, rb)[:, :C] = self.host_gpu[resident]
        sync()

    def make_stream(self, miss_rate):
        """Top-k generator with exactly M misses per request per step."""
        K, C, W, ctx, bs, dev = self.K, self.C, self.W, self.ctx, self.bs, self.dev
        M = max(1, round(K * miss_rate))
        H = K - M
        E = C - H  # evictable slots per step
        period = math.ceil(E / M) + 1
        top = C + period * M
        if top > ctx - W - 1:
            raise ValueError(f"ctx {ctx} too small for miss rate {miss_rate}")
        g = torch.Generator(device=dev).manual_seed(1234 + M)
        hit = torch.argsort(torch.rand((bs, C), device=dev, generator=g), dim=1)[:, :H]
        self.M, self.H, self.period = M, H, period
        self.hit = hit.to(torch.int32)
        self.stream_gen = g
        self.fresh_base = C

    def topk(self, step):
        """Top-k positions of step ``step`` (int32, (bs, K))."""
        j = step % self.period
        miss = (
            self.fresh_base
            + j * self.M
            + torch.arange(self.M, device=self.dev, dtype=torch.int32)
        )
        row = torch.cat([self.hit, miss.expand(self.bs, -1)], dim=1)
        perm = torch.argsort(
            torch.rand((self.bs, self.K), device=self.dev, generator=self.stream_gen),
            dim=1,
        )
        return row.gather(1, perm).contiguous()

    def close(self):
        self.host.close()


def run_ours(s: Setup, iters: int, errors: Dict[str, str]):
    res = {}
    step = [0]
    cur = {}

    def setup(i):
        cur["topk"] = s.topk(step[0])
        step[0] += 1

    # The swap's plan lands in these buffers (as the coordinator's does).
    eager_plan = s.lru_mod.LayerSwapPlan(
        torch.empty((s.bs, s.K), dtype=torch.int32, device=s.dev),
        torch.empty((s.bs, s.K), dtype=torch.int64, device=s.dev),
        torch.empty((s.bs, s.K), dtype=torch.int32, device=s.dev),
        torch.empty((s.bs,), dtype=torch.int32, device=s.dev),
    )

    def swap(_i):
        s.ctrl.swap_one_layer(
            0,
            cur["topk"],
            s.req_idx,
            s.seq_lens32,
            s.req_to_token,
            s.num_real,
            out=eager_plan,
        )

    # Correctness and exact miss count on a few steps.
    for _ in range(3):
        setup(0)
        swap(0)
        plan = eager_plan
        mc = plan.miss_count
        if not bool((mc == s.M).all()):
            raise AssertionError(
                f"miss count {mc.min().item()}..{mc.max().item()} != {s.M}"
            )
        check_rows(s, s.dev_kv, plan.page_table, cur["topk"], "ours")
    res["ours_eager"] = time_gpu(swap, iters, setup=setup)

    def lru_only(_i):
        s.ctrl.lru.swap_layer(
            0, cur["topk"], s.req_idx, s.seq_lens32, s.req_to_token, s.num_real
        )

    res["ours_lru_only"] = time_gpu(lru_only, iters, setup=setup)
    # LRU-only steps skipped the copies: reload the resident rows' data so the
    # graph run's check below is meaningful again.
    resync_ours(s)

    def graph_run():
        lru_mod = s.lru_mod
        K, bs = s.K, s.bs
        static_topk = torch.zeros((bs, K), dtype=torch.int32, device=s.dev)
        out = lru_mod.LayerSwapPlan(
            torch.empty((bs, K), dtype=torch.int32, device=s.dev),
            torch.empty((bs, K), dtype=torch.int64, device=s.dev),
            torch.empty((bs, K), dtype=torch.int32, device=s.dev),
            torch.empty((bs,), dtype=torch.int32, device=s.dev),
        )

        def gsetup(i):
            static_topk.copy_(s.topk(step[0]))
            step[0] += 1

        def swap():
            s.ctrl.swap_one_layer(
                0,
                static_topk,
                s.req_idx,
                s.seq_lens32,
                s.req_to_token,
                s.num_real,
                out=out,
            )

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                gsetup(0)
                swap()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            swap()
        gsetup(0)
        graph.replay()
        sync()
        if not bool((out.miss_count == s.M).all()):
            raise AssertionError("graph replay: wrong miss count")
        check_rows(s, s.dev_kv, out.page_table, static_topk, "ours graph")
        return time_gpu(lambda _i: graph.replay(), iters, setup=gsetup)

    g = try_call(f"ours CUDA graph bs={s.bs} M={s.M}", graph_run, errors)
    if g is not None:
        res["ours_graph"] = g
    return res


def resync_ours(s: Setup):
    C, rb, bs = s.C, s.rb, s.bs
    slot_loc = s.ctrl.lru.slot_loc[0]  # (bs, C) int32 locs, -1 empty
    rows = (
        torch.arange(bs, device=s.dev)[:, None] * s.R
        + torch.arange(C, device=s.dev)[None, :]
    )
    valid = slot_loc >= 0
    s.dev_kv[rows[valid]] = s.host_gpu[slot_loc[valid].long()]


def check_rows(s: Setup, dev_kv, page_table, topk, what):
    locs = s.locs64.gather(1, topk.long())
    got = dev_kv[page_table.long().clamp_min(0)]
    want = s.host_gpu[locs]
    if not bool((page_table >= 0).all()):
        raise AssertionError(f"{what}: page table has -1 entries")
    if not torch.equal(got, want):
        bad = (got != want).any(-1).sum().item()
        raise AssertionError(f"{what}: {bad} rows differ from the host rows")


def run_bare_copy(s: Setup, iters: int):
    bs, K, M = s.bs, s.K, s.M
    g = torch.Generator(device=s.dev).manual_seed(77)
    src = torch.zeros((bs, K), dtype=torch.int64, device=s.dev)
    dst = torch.zeros((bs, K), dtype=torch.int32, device=s.dev)
    src[:, :M] = s.locs64.gather(
        1, torch.randint(0, s.ctx, (bs, M), device=s.dev, generator=g)
    )
    slots = torch.argsort(torch.rand((bs, s.C), device=s.dev, generator=g), 1)[:, :M]
    dst[:, :M] = (torch.arange(bs, device=s.dev)[:, None] * s.R + slots).to(torch.int32)
    count = torch.full((bs,), M, dtype=torch.int32, device=s.dev)
    scratch = torch.zeros_like(s.dev_kv)

    def fn(_i):
        s.skc.gather_rows(s.host_rows, scratch, src, dst, count, s.rb)

    fn(0)
    sync()
    if not torch.equal(scratch[dst[:, :M].long()], s.host_gpu[src[:, :M]]):
        raise AssertionError("bare copy: wrong rows")
    t = time_gpu(fn, iters)
    del scratch
    return t


class HiSparse:
    """Upstream HiSparse state with the same resident set as ours."""

    def __init__(self, s: Setup, block_size: int):
        from sglang.jit_kernel.hisparse import load_cache_to_device_buffer_mla

        self.fn = load_cache_to_device_buffer_mla
        self.s, self.block_size = s, block_size
        bs, C, dev = s.bs, s.C, s.dev
        padded = C + 1  # + the newest-token slot
        self.padded = padded
        self.device_buffer = torch.zeros(
            (bs * padded, 1, s.rb), dtype=torch.uint8, device=dev
        )
        self.device_buffer_locs = torch.arange(
            bs * padded, dtype=torch.int32, device=dev
        ).view(bs, padded)
        self.device_buffer_tokens = torch.full(
            (bs, padded), -1, dtype=torch.int32, device=dev
        )
        self.lru_slots = torch.zeros((bs, C), dtype=torch.int16, device=dev)
        self.out = torch.full((bs, s.K), -1, dtype=torch.int32, device=dev)
        self.host_cache = s.host_rows.view(-1, 1, s.rb)
        self.reset()

    def reset(self):
        """Positions [0, C) resident at slot = position, LRU order arange."""
        s, C, bs, dev = self.s, self.s.C, self.s.bs, self.s.dev
        self.device_buffer_tokens.fill_(-1)
        self.device_buffer_tokens[:, :C] = torch.arange(
            C, dtype=torch.int32, device=dev
        )
        self.lru_slots.copy_(
            torch.arange(C, dtype=torch.int16, device=dev).expand(bs, -1)
        )
        self.device_buffer.view(bs, self.padded, s.rb)[:, :C] = s.host_gpu[
            s.locs64[:, :C]
        ]
        sync()

    def __call__(self, topk):
        s = self.s
        self.fn(
            top_k_tokens=topk,
            device_buffer_tokens=self.device_buffer_tokens,
            host_cache_locs=s.locs64,
            device_buffer_locs=self.device_buffer_locs,
            host_cache=self.host_cache,
            device_buffer=self.device_buffer,
            top_k_device_locs=self.out,
            req_pool_indices=s.req_idx,
            seq_lens=s.seq_lens32,
            lru_slots=self.lru_slots,
            item_size_bytes=s.rb,
            num_top_k=s.K,
            hot_buffer_size=s.C,
            page_size=1,
            block_size=self.block_size,
            num_real_reqs=s.num_real,
        )


def run_hisparse(s: Setup, hs: HiSparse, iters: int):
    step = [0]
    cur = {}

    def setup(i):
        cur["topk"] = s.topk(step[0])
        step[0] += 1
        hs.out.fill_(-1)

    def fn(_i):
        hs(cur["topk"])

    for _ in range(3):
        setup(0)
        fn(0)
        sync()
        check_rows(s, hs.device_buffer.view(-1, s.rb), hs.out, cur["topk"], "hisparse")
    return time_gpu(fn, iters, setup=setup)


def main():
    args = parse_args()
    require_cuda()
    mods = import_offload_modules()
    torch.manual_seed(0)
    errors: Dict[str, str] = {}
    results: List[dict] = []
    hisparse_ok = not args.no_hisparse
    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        s = Setup(args, bs, mods)
        hs = None
        if hisparse_ok:
            hs = try_call(
                f"HiSparse setup / JIT build bs={bs}",
                lambda: HiSparse(s, args.hisparse_block_size),
                errors,
            )
        for mr in [float(x) for x in args.miss_rates.split(",")]:
            s.reset_ours()
            s.make_stream(mr)
            row = {"bs": bs, "miss_rate": mr, "misses_per_req": s.M}
            row["bytes"] = bs * s.M * s.rb
            ours = try_call(
                f"ours bs={bs} miss={mr}",
                lambda: run_ours(s, args.iters, errors),
                errors,
            )
            if ours:
                row.update(ours)
            bare = try_call(
                f"bare copy bs={bs} miss={mr}",
                lambda: run_bare_copy(s, args.iters),
                errors,
            )
            if bare:
                row["bare_copy"] = bare
            if hs is not None:
                # Same resident set and top-k stream as ours, from the start.
                s.make_stream(mr)
                hs.reset()
                hres = try_call(
                    f"HiSparse bs={bs} miss={mr}",
                    lambda: run_hisparse(s, hs, args.iters),
                    errors,
                )
                if hres:
                    row["hisparse"] = hres
                else:
                    hisparse_ok, hs = False, None  # do not retry a failing peer
            for k, v in list(row.items()):
                if isinstance(v, dict) and "median_us" in v:
                    v["GBps_misses"] = gbps(row["bytes"], v["median_us"])
            results.append(row)
            print(
                f"bs={bs:4d} miss={mr:6.3f} M={s.M:5d} "
                + " ".join(
                    f"{k}={v['median_us']:.1f}us"
                    for k, v in row.items()
                    if isinstance(v, dict) and "median_us" in v
                ),
                flush=True,
            )
        del hs
        s.close()
        del s
        if not SMOKE:
            torch.cuda.empty_cache()

    out = {
        "env": env_info(),
        "config": vars(args),
        "results": results,
        "errors": errors,
    }
    write_json(args.out, "bench_swap.json", out)
    md = render_md(out)
    write_text(args.out, "bench_swap.md", md)
    plot(args.out, results)
    print(md, flush=True)
    return 0


COLS = ["ours_eager", "ours_graph", "ours_lru_only", "bare_copy", "hisparse"]


def render_md(out) -> str:
    header = ["bs", "miss %", "misses/req", "MB moved"]
    header += [f"{c} us" for c in COLS] + [
        "hisparse / ours_eager",
        "hisparse / ours_graph",
    ]
    rows = []
    for r in out["results"]:
        line = [r["bs"], 100 * r["miss_rate"], r["misses_per_req"], r["bytes"] / 1e6]
        line += [r[c]["median_us"] if c in r else None for c in COLS]
        for ours in ("ours_eager", "ours_graph"):
            if "hisparse" in r and ours in r:
                line.append(r["hisparse"]["median_us"] / r[ours]["median_us"])
            else:
                line.append(None)
        rows.append(line)
    cfg = out["config"]
    text = "# P2: one layer's swap (lookup + LRU + page table + miss copy)\n\n"
    text += (
        f"GPU: {out['env'].get('gpu')}; top-k {cfg['top_k']}, buffer {cfg['buffer_size']}, "
        f"{cfg['row_bytes']} B rows, {cfg['ctx']} tokens/request; medians of GPU time "
        "(CUDA events). hisparse = sglang 0.5.12.post1 load_cache_to_device_buffer_mla "
        f"(block_size {cfg['hisparse_block_size']}). A ratio > 1 means ours is faster.\n\n"
    )
    text += markdown_table(header, rows)
    if out["errors"]:
        text += "\n## Skipped / failed\n\n"
        for k, v in out["errors"].items():
            text += f"- {k}: {v}\n"
    return text


def plot(out_dir, results):
    plt = get_pyplot()
    if plt is None:
        return
    import os

    bss = sorted({r["bs"] for r in results})
    fig, axes = plt.subplots(1, len(bss), figsize=(5 * len(bss), 4), squeeze=False)
    styles = {
        "ours_eager": "b-o",
        "ours_graph": "g-o",
        "ours_lru_only": "c:.",
        "bare_copy": "k--",
        "hisparse": "r-s",
    }
    for ax, bs in zip(axes[0], bss):
        rs = [r for r in results if r["bs"] == bs]
        for c in COLS:
            xs = [100 * r["miss_rate"] for r in rs if c in r]
            ys = [r[c]["median_us"] for r in rs if c in r]
            if xs:
                ax.plot(xs, ys, styles[c], label=c)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("miss rate (%)")
        ax.set_ylabel("us per layer swap")
        ax.set_title(f"bs={bs}")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend()
    path = os.path.join(out_dir, "bench_swap.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
