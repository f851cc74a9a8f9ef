"""GPU check and timing of the multi-token LRU swap (MTP target verify).

At production sizes (K=2048, W=64; q=2 with C=4096, the one-program kernel;
q=2 and q=4 with the default C=(q+1)K, the split kernels; bs 1/16/64, seq lens
8K-64K), see docs/MTP.md:

1. correctness: the Triton swap and the torch reference side by side over
   verify steps (q query tokens per request whose top-k overlap, each step
   accepting 1..q of them), CUDA-graph padding requests, int32 / int64
   indices. Page tables, copy lists and the whole state must be bit-identical
   every step; state invariants are checked too;
2. CUDA graph: every layer's swap captured once and replayed with changing
   inputs must match eager, outputs and state;
3. timing: one layer's swap per call (CUDA graph of T swaps, median over
   replays), next to the one-token swap (C=4096) of the same requests.

Prints JSON lines and a table, writes JSON to --out, exits 1 on any mismatch.

    python benchmark/nsa_offload/engine/gpu_check_lru_multi.py --out /tmp/lru_multi.json
    TRITON_INTERPRET=1 python ... --device cpu --out /tmp/x.json   # smoke test
"""

import argparse
import json
import sys
import traceback
from typing import Dict, List

import torch
from sglang.srt.mem_cache.lru_cache_state import LayerSwapPlan, LRUCacheState

from offload_bench_utils import finish_check, time_swap_graph

FAILURES: List[str] = []
DEV = "cuda"
FIELDS = ("loc_to_slot", "slot_loc", "lru_order", "counters")


def fail(msg: str) -> None:
    FAILURES.append(msg)
    print(f"MISMATCH: {msg}", flush=True)


class VerifyWorkload:
    """bs requests verifying q tokens per step, with top-k locality between
    steps and between a step's query tokens; one loc per position for good
    (a rejected draft's loc carries the next draft at that position)."""

    def __init__(self, args, bs: int, q: int, min_len: int, max_len: int, seed: int):
        g = self.gen = torch.Generator(device=DEV).manual_seed(seed)
        self.args, self.bs, self.q, self.pad = args, bs, q, 2
        self.max_reqs = bs + self.pad + 3
        self.n = torch.randint(min_len, max_len + 1, (bs,), device=DEV, generator=g)
        self.max_ctx = max_len + (args.steps + 2) * q + 2
        self.num_locs = self.max_reqs * self.max_ctx + 64
        perm = torch.randperm(self.num_locs, device=DEV, generator=g).to(torch.int32)
        self.req_to_token = perm[: self.max_reqs * self.max_ctx].view(
            self.max_reqs, self.max_ctx
        )
        self.rpi = torch.randperm(self.max_reqs, device=DEV, generator=g)[:bs]
        self.ar = torch.arange(self.max_ctx, device=DEV)
        self.scores: Dict[int, torch.Tensor] = {}

    def state(self, C: int, q: int, use_triton: bool, layers: int) -> LRUCacheState:
        a = self.args
        s = LRUCacheState(
            num_layers=layers,
            max_num_reqs=self.max_reqs,
            num_locs=self.num_locs,
            buffer_size=C,
            recent_window=a.W,
            top_k=a.K,
            device=DEV,
            use_triton=use_triton,
            max_batch_size=self.bs + self.pad,
            max_query_tokens=q,
        )
        s.admit_request(self.rpi, (self.rpi * (C + a.W) + 5).to(torch.int32))
        return s

    def topk(self, layer: int, q: int) -> torch.Tensor:
        """(bs * q + pad * q, K) positions, request-major; query j sees n + j + 1."""
        bs, K, g = self.bs, self.args.K, self.gen
        shape = (bs, self.max_ctx)
        fresh = torch.rand(shape, device=DEV, generator=g)
        prev = self.scores.get(layer)
        # ~45% of a layer's picks carried over from the previous step.
        base = fresh if prev is None else 0.55 * prev + 0.45 * fresh
        self.scores[layer] = base
        rows = []
        for j in range(q):
            s = base + 0.15 * torch.rand(shape, device=DEV, generator=g)
            kv_len = (self.n + j + 1)[:, None]
            s = s + ((self.ar[None] >= kv_len - 64) & (self.ar[None] < kv_len)) * 2.0
            s = s.masked_fill(self.ar[None] >= kv_len, float("-inf"))
            val, idx = s.topk(K, dim=1)
            idx = torch.where(torch.isinf(val), -1, idx)
            perm = torch.rand((bs, K), device=DEV, generator=g).argsort(dim=1)
            rows.append(idx.gather(1, perm))
        topk = torch.stack(rows, dim=1).reshape(bs * q, K)
        garbage = torch.randint(
            -1, 64, (self.pad * q, K), device=DEV, generator=self.gen
        )
        return torch.cat([topk, garbage])

    def inputs(self, q: int, dtype):
        pad_rpi = torch.randint(0, self.max_reqs, (self.pad,), device=DEV)
        rpi = torch.cat([self.rpi, pad_rpi]).to(dtype)
        ones = torch.ones(self.pad, dtype=torch.int64, device=DEV)
        seq = torch.cat([self.n + q, ones]).to(dtype)
        return rpi, seq, torch.tensor([self.bs], dtype=torch.int32, device=DEV)

    def accept(self, q: int) -> None:
        self.n += torch.randint(1, q + 1, (self.bs,), device=DEV, generator=self.gen)


def compare(tag: str, a: LayerSwapPlan, b: LayerSwapPlan) -> bool:
    if not torch.equal(a.page_table, b.page_table):
        fail(f"{tag}: page_table differs in {(a.page_table != b.page_table).sum()}")
        return False
    if not torch.equal(a.miss_count, b.miss_count):
        fail(f"{tag}: miss_count differs")
        return False
    width = a.miss_src_loc.shape[1]
    mask = torch.arange(width, device=DEV)[None] < a.miss_count[:, None].long()
    for name in ("miss_src_loc", "miss_dst_row"):
        x, y = getattr(a, name), getattr(b, name)
        if not torch.equal(torch.where(mask, x, 0), torch.where(mask, y, 0)):
            fail(f"{tag}: {name} differs")
            return False
    # Each missing loc copied once per request.
    src = torch.where(mask, a.miss_src_loc, -1).sort(dim=1).values
    if bool(((src[:, 1:] == src[:, :-1]) & (src[:, 1:] >= 0)).any()):
        fail(f"{tag}: a loc copied twice")
        return False
    return True


def same_state(tag: str, a: LRUCacheState, b: LRUCacheState) -> bool:
    for name in FIELDS:
        if not torch.equal(getattr(a, name), getattr(b, name)):
            fail(f"{tag}: state {name} differs")
            return False
    l2s, slot_loc = a.loc_to_slot.long(), a.slot_loc.long()
    for layer in range(a.num_layers):
        held = slot_loc[layer][slot_loc[layer] >= 0]
        if int((l2s[layer] >= 0).sum()) != held.numel():
            fail(f"{tag}: layer {layer} loc_to_slot / slot_loc disagree")
            return False
    return True


def run_correctness(args, bs: int, q: int, C: int, seed: int) -> Dict:
    wl = VerifyWorkload(args, bs, q, args.min_len, args.max_len, seed)
    tri, ref = (wl.state(C, q, t, args.layers) for t in (True, False))
    ok = True
    for step in range(args.steps):
        dtype = torch.int32 if step % 2 else torch.int64
        rpi, seq, num_real = wl.inputs(q, dtype)
        for layer in range(args.layers):
            topk = wl.topk(layer, q).to(dtype)
            swap = (layer, topk, rpi, seq, wl.req_to_token, num_real)
            a = tri.swap_layer(*swap, num_query_tokens=q)
            b = ref.swap_layer(*swap, num_query_tokens=q)
            ok &= compare(f"bs={bs} q={q} C={C} step {step} layer {layer}", a, b)
        ok &= same_state(f"bs={bs} q={q} C={C} step {step}", tri, ref)
        wl.accept(q)
        if not ok:
            break
    c = tri.counters.sum(0).tolist()
    return {"bs": bs, "q": q, "C": C, "ok": bool(ok), "hits": c[0], "misses": c[2]}


def plan_buffers(rows: int, q: int, K: int) -> LayerSwapPlan:
    return LayerSwapPlan(
        torch.empty((rows * q, K), dtype=torch.int32, device=DEV),
        torch.empty((rows, q * K), dtype=torch.int64, device=DEV),
        torch.empty((rows, q * K), dtype=torch.int32, device=DEV),
        torch.empty((rows,), dtype=torch.int32, device=DEV),
    )


def run_cuda_graph(args, bs: int, q: int, C: int, seed: int) -> Dict:
    L, K = args.layers, args.K
    wl = VerifyWorkload(args, bs, q, 8192, 32768, seed)
    eager, graphed, scratch = (wl.state(C, q, True, L) for _ in range(3))
    rpi, seq, num_real = (t.clone() for t in wl.inputs(q, torch.int64))
    topk = [torch.full(((bs + wl.pad) * q, K), -1, device=DEV) for _ in range(L)]
    outs = [plan_buffers(bs + wl.pad, q, K) for _ in range(L)]

    def swap_all(state):
        for layer in range(L):
            swap = (layer, topk[layer], rpi, seq, wl.req_to_token, num_real)
            state.swap_layer(*swap, out=outs[layer], num_query_tokens=q)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        swap_all(scratch)  # JIT warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        swap_all(graphed)
    ok = True
    for step in range(args.steps):
        seq[:bs].copy_(wl.n + q)
        num_real.fill_(bs - step % 2)
        for layer in range(L):
            topk[layer].copy_(wl.topk(layer, q))
        graph.replay()
        for layer in range(L):
            swap = (layer, topk[layer], rpi, seq, wl.req_to_token, num_real)
            ref = eager.swap_layer(*swap, num_query_tokens=q)
            ok &= compare(f"graph bs={bs} q={q} step {step}", ref, outs[layer])
        ok &= same_state(f"graph bs={bs} q={q} step {step}", eager, graphed)
        wl.accept(q)
        if not ok:
            break
    return {"bs": bs, "q": q, "C": C, "ok": bool(ok)}


def time_swaps(state, wl, topks, seqs, rpi, num_real, q, reps):
    """(median us per swap, miss rate) of a CUDA graph of len(topks)
    consecutive swaps of layer 0, replayed (as gpu_check_lru.time_graph)."""
    rows = rpi.shape[0]
    outs = [plan_buffers(rows, q, wl.args.K) for _ in range(2)]

    def body():
        for t, (topk, seq) in enumerate(zip(topks, seqs)):
            swap = (0, topk, rpi, seq, wl.req_to_token, num_real)
            state.swap_layer(*swap, out=outs[t % 2], num_query_tokens=q)

    return time_swap_graph(body, state.counters[0], len(topks), reps)


def run_timing(args, bs: int, q: int, C: int, seed: int) -> Dict:
    wl = VerifyWorkload(args, bs, q, args.min_len, args.max_len, seed)
    multi, single = wl.state(C, q, True, 1), wl.state(2 * args.K, 1, True, 1)
    rpi, _, num_real = wl.inputs(q, torch.int64)
    topks, seqs, lasts, last_seqs = [], [], [], []
    ones = torch.ones(wl.pad, dtype=torch.int64, device=DEV)
    for _ in range(args.graph_steps):
        topk = wl.topk(0, q)
        topks.append(topk)
        seqs.append(torch.cat([wl.n + q, ones]))
        # The one-token swap of the same requests: each step's last token.
        lasts.append(topk.view(-1, q, args.K)[:, q - 1].contiguous())
        last_seqs.append(seqs[-1].clone())
        wl.accept(q)
    us, miss_rate = time_swaps(multi, wl, topks, seqs, rpi, num_real, q, args.reps)
    us1, miss_rate1 = time_swaps(
        single, wl, lasts, last_seqs, rpi, num_real, 1, args.reps
    )
    return {
        "bs": bs,
        "q": q,
        "C": C,
        "multi_us": round(us, 2),
        "miss_rate": round(miss_rate, 4),
        "single_us": round(us1, 2),
        "single_miss_rate": round(miss_rate1, 4),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--K", type=int, default=2048, help="top-k width")
    p.add_argument("--W", type=int, default=64, help="recent-window rows")
    p.add_argument("--layers", type=int, default=2, help="layers of the LRU state")
    p.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[1, 16, 64],
        help="requests per verify step, one check each",
    )
    p.add_argument("--min-len", type=int, default=8192, help="shortest request")
    p.add_argument("--max-len", type=int, default=65536, help="longest request")
    p.add_argument("--steps", type=int, default=12, help="verify steps checked")
    p.add_argument("--graph-steps", type=int, default=8, help="swaps per timed graph")
    p.add_argument("--reps", type=int, default=30, help="timed graph replays")
    p.add_argument("--device", default="cuda", help="cpu: smoke test of the script")
    args = p.parse_args()
    global DEV
    DEV = args.device
    if DEV == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    # (q, C): the one-program kernel (C = 2K), then the defaults (q + 1) K.
    configs = [(2, 2 * args.K), (2, 3 * args.K), (4, 5 * args.K)]
    result = {"config": vars(args), "correctness": [], "cuda_graph": [], "timing": []}

    def guarded(section, fn, *a):
        try:
            row = fn(args, *a)
        except Exception:  # noqa: BLE001 - record and keep going
            row = {"args": repr(a), "error": traceback.format_exc()}
            fail(f"{section} {a}: exception\n{row['error']}")
        result[section].append(row)
        print(json.dumps(row), flush=True)

    seed = 0
    for q, C in configs:
        for bs in args.batch_sizes:
            seed += 1
            guarded("correctness", run_correctness, bs, q, C, seed)
        if DEV == "cuda":
            seed += 1
            guarded("cuda_graph", run_cuda_graph, 16, q, C, seed)
            for bs in args.batch_sizes:
                seed += 1
                guarded("timing", run_timing, bs, q, C, seed)
    print(
        f"\n{'q':>2} {'C':>6} {'bs':>4} {'miss%':>6} {'multi us':>9} {'1-token us':>10}"
    )
    for r in result["timing"]:
        if "error" not in r:
            print(
                f"{r['q']:>2} {r['C']:>6} {r['bs']:>4} {100 * r['miss_rate']:6.1f} "
                f"{r['multi_us']:9.2f} {r['single_us']:10.2f}"
            )
    return finish_check(result, FAILURES, args.out)


if __name__ == "__main__":
    sys.exit(main())
