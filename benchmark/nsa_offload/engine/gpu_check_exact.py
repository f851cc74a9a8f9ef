"""Exactness of decode attention through the offloaded page table (H200).

FlashMLA fp8 sparse decode (``flash_mla_with_kvcache``, called as sglang's NSA
backend calls it for ``--dsa-decode-backend flashmla_kv``) must give
bit-identical output (``torch.equal``) whether it reads the top-k rows

* from the full GPU KV (every token at row = token loc: the reference), or
* from our offloaded working set: ``SparseCacheController.swap_one_layer``'s
  page table into the small device buffer, misses loaded from pinned host.

The run simulates decoding: prefilled prompts are backed up from GPU staging
rows to the host pool and admitted (window + LRU warm-up), every step appends
one token per request into its window row, new tokens are backed up to host
one step late on the side stream, the indexer's top-k is random with
step-to-step locality (so the LRU hits, misses and evicts), requests finish
and new ones take over their regions. Mode ``eager`` calls the swap directly;
mode ``graph`` captures all layers' swaps in one CUDA graph (batch padded with
a stale CUDA-graph row) and replays it every step.

Exits non-zero on any mismatch; writes gpu_check_exact.json to ``--out``.

    python benchmark/nsa_offload/engine/gpu_check_exact.py --out /tmp/out/exact
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Dict, List

import torch

from offload_bench_utils import (
    SMOKE,
    bench_device,
    env_info,
    import_offload_modules,
    require_cuda,
    sync,
    write_json,
)

PAGE = 64
KV_LORA_RANK = 512
ROPE_DIM = 64
FP8_ROW_BYTES = 656


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        required=True,
        help="output directory (created) for the JSON/markdown results",
    )
    p.add_argument(
        "--modes",
        type=str,
        default="eager,graph",
        help="comma-separated: eager, graph (CUDA graph replay)",
    )
    p.add_argument(
        "--steps", type=int, default=40, help="decode steps checked per mode"
    )
    p.add_argument("--layers", type=int, default=3, help="model layers")
    p.add_argument("--bs", type=int, default=4, help="decode batch size")
    p.add_argument(
        "--heads",
        type=str,
        default="64,128",
        help="comma-separated query head counts for FlashMLA",
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
    p.add_argument(
        "--min-ctx", type=int, default=3000, help="shortest request context (tokens)"
    )
    p.add_argument(
        "--max-ctx", type=int, default=24000, help="longest request context (tokens)"
    )
    p.add_argument(
        "--turnover-every",
        type=int,
        default=9,
        help="replace a request (release + admit) every N steps",
    )
    p.add_argument(
        "--max-units",
        type=int,
        default=1,
        help="regions a request may hold (--nsa-kv-offload-max-units in a server)",
    )
    p.add_argument(
        "--extra-regions",
        type=int,
        default=0,
        help="regions beyond the batch size: handed out as extra units "
        "between steps and taken back by admissions (with --max-units > 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")
    return p.parse_args()


def round_up(x, m):
    return (x + m - 1) // m * m


def random_fp8_rows(n: int, dev) -> torch.Tensor:
    """``n`` valid FlashMLA fp8 KV rows (656 B) from random bf16 K."""
    k = torch.randn((n, KV_LORA_RANK + ROPE_DIM), dtype=torch.bfloat16, device=dev)
    if SMOKE:
        return torch.randint(0, 256, (n, FP8_ROW_BYTES), dtype=torch.uint8)
    from sglang.srt.layers.attention.nsa.quant_k_cache import quantize_k_cache

    rows = quantize_k_cache(k.view(n, 1, 1, -1))
    return rows.view(n, -1).view(torch.uint8).contiguous()


class Attention:
    """FlashMLA sparse fp8 decode exactly as nsa_backend._forward_flashmla_kv."""

    def __init__(self, top_k: int):
        self.top_k = top_k
        if SMOKE:
            self.fwd = None
            return
        from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

        self.fwd, self.get_meta = flash_mla_with_kvcache, get_mla_metadata

    def __call__(self, q, kv_rows, indices, seq_lens):
        """q (bs, 1, H, 576) bf16; kv_rows (N, 656) uint8; indices (bs, K) int32."""
        bs, _, heads, _ = q.shape
        if self.fwd is None:  # CPU smoke: a stand-in that depends on row order
            idx = indices.long().clamp_min(0)
            g = kv_rows[idx].float() * (indices >= 0)[..., None]
            w = torch.arange(1, g.shape[1] + 1, dtype=torch.float32)[None, :, None]
            return (g * w).sum(1)
        cache_seqlens = torch.clamp(seq_lens, max=self.top_k).to(torch.int32)
        meta, splits = self.get_meta(
            cache_seqlens=cache_seqlens,
            num_q_tokens_per_head_k=heads,
            num_heads_k=1,
            num_heads_q=heads,
            is_fp8_kvcache=True,
            topk=self.top_k,
        )
        k_cache = kv_rows.view(torch.float8_e4m3fn).view(-1, PAGE, 1, FP8_ROW_BYTES)
        out, _ = self.fwd(
            q=q,
            k_cache=k_cache,
            block_table=torch.empty((bs, 0), dtype=torch.int32, device=q.device),
            cache_seqlens=cache_seqlens,
            head_dim_v=KV_LORA_RANK,
            tile_scheduler_metadata=meta,
            num_splits=splits,
            softmax_scale=192**-0.5,
            indices=indices.unsqueeze(1),
            is_fp8_kvcache=True,
        )
        return out


class Sim:
    def __init__(self, args, mode, mods):
        lru_mod, skc, host_mod, ctrl_mod = mods
        self.args, self.mode, self.lru_mod = args, mode, lru_mod
        self.rng = random.Random(args.seed + (0 if mode == "eager" else 1000))
        torch.manual_seed(args.seed)
        dev = bench_device()
        self.dev = dev
        L, K, C, W, bs = args.layers, args.top_k, args.buffer_size, args.window, args.bs
        self.L, self.K, self.C, self.W, self.bs = L, K, C, W, bs
        self.max_reqs = 2 * bs + 2
        self.max_ctx = args.max_ctx + args.steps + 8
        # Enough token locs for every request ever admitted.
        num_reqs_total = bs + args.steps // max(1, args.turnover_every) + 2
        n_locs = round_up(num_reqs_total * self.max_ctx, PAGE)
        self.host = host_mod.NSAKVOnlyTokenToKVPoolHost(
            size=n_locs, page_size=PAGE, layer_num=L, row_bytes=FP8_ROW_BYTES
        )
        rows = self.host.num_rows
        # Reference: the full GPU KV, row = token loc.
        self.full = [random_fp8_rows(rows, dev) for _ in range(L)]
        self.staging_rows = round_up(args.max_ctx, PAGE)
        R = C + W
        num_regions = bs + args.extra_regions
        n_gpu = round_up(self.staging_rows + num_regions * R, PAGE)
        self.gpu = [
            torch.zeros((n_gpu, 1, FP8_ROW_BYTES), dtype=torch.uint8, device=dev)
            for _ in range(L)
        ]
        self.ctrl = ctrl_mod.SparseCacheController(
            self.gpu,
            self.host,
            max_num_reqs=self.max_reqs,
            top_k=K,
            buffer_size=C,
            recent_window=W,
            region_start_row=self.staging_rows,
            num_regions=num_regions,
            max_batch_size=bs + 1,
            max_units=args.max_units,
        )
        self.free_locs = list(range(PAGE, rows))
        self.rng.shuffle(self.free_locs)
        self.free_reqs = list(range(self.max_reqs))
        self.req_to_token = torch.zeros(
            (self.max_reqs, self.max_ctx), dtype=torch.int32
        )
        self.r2t_dev = torch.zeros_like(self.req_to_token, device=dev)
        self.live: Dict[int, int] = {}
        self.prev_pick: Dict[tuple, List[int]] = {}
        self.pending = None
        self.attn = Attention(K)
        self.heads = [int(h) for h in args.heads.split(",")]
        self.stats = {
            "checks": 0,
            "mismatch": 0,
            "row_mismatch": 0,
            "ref_nondet": 0,
            "units_granted": 0,
            "admissions_taking_units_back": 0,
        }
        self.failures: List[str] = []
        self.graph = None

    # ---- lifecycle -------------------------------------------------------

    def admit(self):
        r = self.free_reqs.pop(self.rng.randrange(len(self.free_reqs)))
        n = self.rng.randint(self.args.min_ctx, self.args.max_ctx)
        locs = [self.free_locs.pop() for _ in range(n)]
        self.req_to_token[r, :n] = torch.tensor(locs, dtype=torch.int32)
        loc_t = torch.tensor(locs, dtype=torch.int64, device=self.dev)
        staging = torch.arange(n, dtype=torch.int64, device=self.dev)
        for layer in range(self.L):  # prefill writes the prompt KV to staging rows
            self.gpu[layer].view(-1, FP8_ROW_BYTES)[staging] = self.full[layer][loc_t]
        self.ctrl.backup_prefilled_request(staging, loc_t)
        if self.ctrl.num_free_regions() == 0:
            self.stats["admissions_taking_units_back"] += 1
        base = self.ctrl.admit_request(r, prefix_locs=loc_t)
        assert base is not None, "no free region"
        # Staging rows are reused by the next prefill: wait for the backup.
        self.ctrl.wait_backup()
        self.live[r] = n

    def release(self, r):
        self.ctrl.release_request(r)
        n = self.live.pop(r)
        self.free_locs.extend(self.req_to_token[r, :n].tolist())
        for layer in range(self.L):
            self.prev_pick.pop((r, layer), None)
        self.free_reqs.append(r)

    # ---- one decode step ---------------------------------------------------

    def decode_writes(self, reqs):
        rows, locs = [], []
        for r in reqs:
            p = self.live[r]
            loc = self.free_locs.pop()
            self.req_to_token[r, p] = loc
            self.live[r] = p + 1
            rows.append(self.ctrl.region_base(r) + self.C + p % self.W)
            locs.append(loc)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=self.dev)
        locs_t = torch.tensor(locs, dtype=torch.int64, device=self.dev)
        for layer in range(self.L):  # set_mla_kv_buffer of the new tokens
            self.gpu[layer].view(-1, FP8_ROW_BYTES)[rows_t] = self.full[layer][locs_t]
        return rows_t, locs_t

    def pick_topk(self, reqs, layer):
        K, rng = self.K, self.rng
        out = torch.full((len(reqs), K), -1, dtype=torch.int32)
        for b, r in enumerate(reqs):
            n = self.live[r]
            keep = [
                p
                for p in self.prev_pick.get((r, layer), [])
                if p < n and rng.random() < 0.6
            ]
            recent = list(range(max(0, n - self.W - 8), n))
            rng.shuffle(recent)
            fresh = rng.sample(range(n), min(n, K))
            pick = list(dict.fromkeys(keep + recent[:16] + fresh))
            want = K if rng.random() < 0.85 else rng.randint(K // 2, K)
            pick = pick[: min(want, n)]
            self.prev_pick[r, layer] = pick
            pick = pick + [-1] * (K - len(pick))
            rng.shuffle(pick)
            out[b] = torch.tensor(pick, dtype=torch.int32)
        return out

    def step(self, step_idx):
        ctrl = self.ctrl
        if self.pending is not None:  # last step's new tokens, one step late
            ctrl.write_back_new_tokens(*self.pending)
        te = self.args.turnover_every
        if te and step_idx % te == te - 1:
            self.release(self.rng.choice(sorted(self.live)))
        # With --max-units > 1 the freed regions go to the running requests
        # first, so that the admissions below take units back.
        self.stats["units_granted"] += ctrl.rebalance()
        while ctrl.can_admit() and len(self.live) < self.bs:
            self.admit()
        self.stats["units_granted"] += ctrl.rebalance()
        reqs = sorted(self.live)
        self.rng.shuffle(reqs)
        self.pending = self.decode_writes(reqs)
        self.r2t_dev.copy_(self.req_to_token)
        topks = [self.pick_topk(reqs, layer) for layer in range(self.L)]
        seq = torch.tensor([self.live[r] for r in reqs], dtype=torch.int64)
        ctrl.wait_backup()
        if self.mode == "graph":
            tables = self.run_graph(reqs, topks, seq)
        else:
            req_idx = torch.tensor(reqs, dtype=torch.int64, device=self.dev)
            seq_d = seq.to(self.dev)
            tables = [
                ctrl.swap_one_layer(
                    layer, topks[layer].to(self.dev), req_idx, seq_d, self.r2t_dev
                ).clone()
                for layer in range(self.L)
            ]
        self.compare(step_idx, reqs, topks, seq, tables)

    # ---- CUDA graph of all layers' swaps -----------------------------------

    def build_graph(self):
        bsg, K, dev = self.bs + 1, self.K, self.dev
        self.g_topk = torch.full((self.L, bsg, K), -1, dtype=torch.int32, device=dev)
        self.g_req = torch.zeros((bsg,), dtype=torch.int64, device=dev)
        self.g_seq = torch.ones((bsg,), dtype=torch.int64, device=dev)
        self.g_num_real = torch.zeros((1,), dtype=torch.int32, device=dev)
        self.g_out = [
            self.lru_mod.LayerSwapPlan(
                torch.empty((bsg, K), dtype=torch.int32, device=dev),
                torch.empty((bsg, K), dtype=torch.int64, device=dev),
                torch.empty((bsg, K), dtype=torch.int32, device=dev),
                torch.empty((bsg,), dtype=torch.int32, device=dev),
            )
            for _ in range(self.L)
        ]

        def body():
            for layer in range(self.L):
                self.ctrl.swap_one_layer(
                    layer,
                    self.g_topk[layer],
                    self.g_req,
                    self.g_seq,
                    self.r2t_dev,
                    self.g_num_real,
                    out=self.g_out[layer],
                )

        # Warm up (compiles kernels) with all-padding rows: no state change.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            body()
        torch.cuda.synchronize()

    def run_graph(self, reqs, topks, seq):
        if self.graph is None:
            self.build_graph()
        n = len(reqs)
        stale = self.rng.randrange(self.max_reqs)  # a padded CUDA-graph row
        self.g_req.copy_(torch.tensor(reqs + [stale], dtype=torch.int64))
        self.g_seq.copy_(torch.cat([seq, torch.ones(1, dtype=torch.int64)]))
        self.g_num_real.fill_(n)
        for layer in range(self.L):
            pad = torch.randint(-1, 64, (1, self.K), dtype=torch.int32)
            self.g_topk[layer].copy_(torch.cat([topks[layer], pad]))
        self.graph.replay()
        tables = []
        for layer in range(self.L):
            pt = self.g_out[layer].page_table
            if not bool((pt[n] == -1).all()):
                self.failures.append("graph padding row has a non -1 page table entry")
            tables.append(pt[:n].clone())
        return tables

    # ---- comparison ---------------------------------------------------------

    def compare(self, step_idx, reqs, topks, seq, tables):
        req_t = torch.tensor(reqs, dtype=torch.int64)
        for layer in range(self.L):
            topk = topks[layer]
            valid = topk >= 0
            locs = self.req_to_token[req_t[:, None], topk.long().clamp_min(0)]
            ref_idx = torch.where(valid, locs, -1).to(torch.int32).to(self.dev)
            pt = tables[layer]
            if not torch.equal((pt >= 0).cpu(), valid):
                self.failures.append(
                    f"step {step_idx} layer {layer}: -1 pattern differs"
                )
            dev_rows = self.gpu[layer].view(-1, FP8_ROW_BYTES)
            got = dev_rows[pt.long().clamp_min(0)][valid.to(self.dev)]
            want = self.full[layer][ref_idx.long().clamp_min(0)][valid.to(self.dev)]
            if not torch.equal(got, want):
                bad = (got != want).any(-1).sum().item()
                self.stats["row_mismatch"] += 1
                self.failures.append(
                    f"step {step_idx} layer {layer}: {bad} rows differ"
                )
            seq_d = seq.to(self.dev)
            for heads in self.heads:
                q = torch.randn(
                    (len(reqs), 1, heads, KV_LORA_RANK + ROPE_DIM),
                    dtype=torch.bfloat16,
                    device=self.dev,
                )
                out_ref = self.attn(q, self.full[layer], ref_idx, seq_d)
                out_ours = self.attn(q, dev_rows, pt, seq_d)
                self.stats["checks"] += 1
                if not torch.equal(out_ref, out_ours):
                    again = self.attn(q, self.full[layer], ref_idx, seq_d)
                    if not torch.equal(out_ref, again):
                        self.stats["ref_nondet"] += 1
                    self.stats["mismatch"] += 1
                    diff = (out_ref.float() - out_ours.float()).abs().max().item()
                    self.failures.append(
                        f"step {step_idx} layer {layer} heads {heads}: output differs "
                        f"(max abs diff {diff:.3g})"
                    )
                if not bool(torch.isfinite(out_ours.float()).all()):
                    self.failures.append(f"step {step_idx} layer {layer}: non-finite")

    def order_sensitivity(self):
        """Permuting the page table changes FlashMLA's output (the check has teeth)."""
        reqs = sorted(self.live)
        seq = torch.tensor([self.live[r] for r in reqs], dtype=torch.int64)
        req_t = torch.tensor(reqs, dtype=torch.int64)
        topk = self.pick_topk(reqs, 0)
        locs = self.req_to_token[req_t[:, None], topk.long().clamp_min(0)]
        idx = torch.where(topk >= 0, locs, -1).to(torch.int32).to(self.dev)
        perm = torch.randperm(self.K, device=self.dev)
        q = torch.randn(
            (len(reqs), 1, self.heads[0], KV_LORA_RANK + ROPE_DIM),
            dtype=torch.bfloat16,
            device=self.dev,
        )
        a = self.attn(q, self.full[0], idx, seq.to(self.dev))
        b = self.attn(q, self.full[0], idx[:, perm].contiguous(), seq.to(self.dev))
        return {
            "permuted_equal": bool(torch.equal(a, b)),
            "max_abs_diff": (a.float() - b.float()).abs().max().item(),
        }


def run_mode(args, mode, mods):
    t0 = time.time()
    sim = Sim(args, mode, mods)
    for step_idx in range(args.steps):
        sim.step(step_idx)
        if len(sim.failures) > 20:
            break
    sync()
    stats = sim.ctrl.get_stats()
    res = {
        "mode": mode,
        "steps": step_idx + 1,
        "seconds": time.time() - t0,
        "checks": sim.stats,
        "controller_stats": stats,
        "failures": sim.failures[:50],
        "order_sensitivity": sim.order_sensitivity(),
    }
    res["passed"] = (
        not sim.failures
        and sim.stats["checks"] > 0
        and stats["misses"] > 0
        and stats["lru_hits"] > 0
    )
    print(
        f"[{mode}] passed={res['passed']} checks={sim.stats} "
        f"hits={stats['lru_hits']} window={stats['window_hits']} "
        f"misses={stats['misses']} h2d={stats['h2d_bytes'] / 1e6:.1f}MB "
        f"d2h={stats['d2h_bytes'] / 1e6:.1f}MB order={res['order_sensitivity']}",
        flush=True,
    )
    for f in sim.failures[:10]:
        print(f"  FAIL {f}", flush=True)
    sim.host.close()
    return res


def main():
    args = parse_args()
    require_cuda()
    mods = import_offload_modules()
    out = {"env": env_info(), "config": vars(args), "modes": []}
    ok = True
    for mode in args.modes.split(","):
        if SMOKE and mode == "graph":
            print("[skip] graph mode in CPU smoke", flush=True)
            continue
        try:
            res = run_mode(args, mode, mods)
        except Exception as e:  # a crash is a failure too, with its reason
            import traceback

            traceback.print_exc()
            res = {"mode": mode, "passed": False, "error": f"{type(e).__name__}: {e}"}
        out["modes"].append(res)
        ok = ok and res["passed"]
    out["passed"] = ok
    write_json(args.out, "gpu_check_exact.json", out)
    print("EXACT: PASS" if ok else "EXACT: FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
