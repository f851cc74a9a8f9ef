"""GPU self-check and timing of the LRU swap kernels (LRUCacheState).

At production sizes (C=4096, K=2048, W=64, bs 1/16/64/128, seq lens 8K-128K):

1. correctness: the Triton kernel and the torch reference run side by side over
   many decode steps with top-k locality (previous picks, recent tokens, random
   others), CUDA-graph padding rows, -1 / out-of-range entries, int32 and int64
   indices, release + re-admission with reused token locs. Outputs and the whole
   state must be bit-identical every step; state invariants are checked too;
2. CUDA graph: swap_layer captured (all layers, preallocated outputs) and
   replayed with changing inputs must match eager, outputs and state; a swap
   under ``torch.cuda.set_sync_debug_mode("error")`` must not sync the host;
3. timing: the swap per call (CUDA graph of T consecutive swaps,
   median over replays, CUDA events) for a num_warps sweep, against the torch
   reference, at realistic (~45% step-to-step overlap) and no locality.

Prints a table, writes JSON to --out, exits 1 on any mismatch.

    python benchmark/nsa_offload/engine/gpu_check_lru.py --out /tmp/lru_check.json
"""

import argparse
import json
import sys
import time
import traceback
from typing import Dict, List

import torch
from sglang.srt.mem_cache.lru_cache_state import LayerSwapPlan, LRUCacheState

from offload_bench_utils import finish_check, time_swap_graph

FAILURES: List[str] = []
# --device cpu (with TRITON_INTERPRET=1, tiny sizes) smoke-tests this script.
DEV = "cuda"


def fail(msg: str) -> None:
    FAILURES.append(msg)
    print(f"MISMATCH: {msg}", flush=True)


class Workload:
    """bs decoding requests with distinct, shuffled token locs and top-k locality."""

    def __init__(
        self,
        bs: int,
        pad: int,
        args,
        min_len: int,
        max_len: int,
        steps: int,
        keep: float,
        seed: int,
    ):
        dev = DEV
        self.bs, self.pad, self.args = bs, pad, args
        self.K, self.W = args.K, args.W
        self.keep = keep
        self.gen = torch.Generator(device=dev).manual_seed(seed)
        g = self.gen
        self.max_reqs = bs + pad + 3
        self.seq_lens = torch.randint(
            min_len, max_len + 1, (bs,), device=dev, generator=g
        )
        self.max_ctx = max_len + steps + 2
        alloc = (self.seq_lens + steps + 2).tolist()
        self.num_locs = sum(alloc) + 4096
        perm = torch.randperm(self.num_locs, device=dev, generator=g).to(torch.int32)
        # Pool indices are a random subset: batch row != pool index.
        self.rpi = torch.randperm(self.max_reqs, device=dev, generator=g)[:bs]
        self.req_to_token = torch.zeros(
            (self.max_reqs, self.max_ctx), dtype=torch.int32, device=dev
        )
        off = 0
        for i, r in enumerate(self.rpi.tolist()):
            self.req_to_token[r, : alloc[i]] = perm[off : off + alloc[i]]
            off += alloc[i]
        self.region_rows = args.C + args.W
        self.bases = torch.randperm(self.max_reqs, device=dev, generator=g)[:bs]
        self.bases = (self.bases * self.region_rows + 5).to(torch.int32)
        self.prev: Dict[int, torch.Tensor] = {}
        self.ar = torch.arange(self.max_ctx, device=dev)

    def admit(self, state: LRUCacheState, warm: bool) -> None:
        state.admit_request(self.rpi, self.bases)
        if warm:
            self.warm(state, range(self.bs))

    def warm(self, state: LRUCacheState, rows) -> None:
        # Tokens just below the window (oldest first), as the controller does.
        C, W = self.args.C, self.W
        for i in rows:
            n = int(self.seq_lens[i])
            r = int(self.rpi[i])
            lo = max(0, n - W - C // 2)
            locs = self.req_to_token[r, lo : max(lo, n - W)].long()
            state.warm_request(range(state.num_layers), r, locs)

    def reuse_locs(self, rows: List[int]) -> None:
        """Released requests come back as new ones holding the same locs."""
        for i in rows:
            r = int(self.rpi[i])
            n = int(self.seq_lens[i])
            row = self.req_to_token[r, :n]
            p = torch.randperm(n, device=DEV, generator=self.gen)
            self.req_to_token[r, :n] = row[p]
            for key in list(self.prev):
                self.prev[key][i] = -1

    def topk(self, layer: int) -> torch.Tensor:
        """(bs + pad, K) int64 positions; padding rows hold garbage."""
        bs, K, W, g = self.bs, self.K, self.W, self.gen
        n = self.seq_lens[:, None]
        scores = torch.rand((bs, self.max_ctx), device=DEV, generator=g)
        recent = (self.ar[None] >= n - W - 32) & (self.ar[None] < n)
        pick = torch.rand((bs, self.max_ctx), device=DEV, generator=g) < 0.7
        scores += (recent & pick).float() * 2.0
        prev = self.prev.get(layer)
        if prev is not None:
            keep = torch.rand((bs, K), device=DEV, generator=g) < self.keep
            boost = (keep & (prev >= 0)).float() * 1.5
            scores.scatter_add_(1, prev.clamp(min=0), boost)
        scores.masked_fill_(self.ar[None] >= n, float("-inf"))
        val, idx = scores.topk(K, dim=1)
        idx = torch.where(torch.isinf(val), -1, idx)
        perm = torch.rand((bs, K), device=DEV, generator=g).argsort(dim=1)
        idx = idx.gather(1, perm)
        self.prev[layer] = idx
        idx = idx.clone()
        u = torch.rand((bs, K), device=DEV, generator=g)
        idx = torch.where(u < 0.004, -1, idx)
        oob = n + torch.arange(K, device=DEV)[None]  # distinct, >= seq_len
        idx = torch.where((u > 0.004) & (u < 0.006), oob, idx)
        if self.pad:
            garbage = torch.randint(-1, 64, (self.pad, K), device=DEV, generator=g)
            idx = torch.cat([idx, garbage])
        return idx

    def inputs(self, dtype):
        pad_rpi = torch.randint(
            0, self.max_reqs, (self.pad,), device=DEV, generator=self.gen
        )
        rpi = torch.cat([self.rpi, pad_rpi]).to(dtype)
        seq = torch.cat(
            [self.seq_lens, torch.ones(self.pad, dtype=torch.int64, device=DEV)]
        ).to(dtype)
        num_real = torch.tensor([self.bs], dtype=torch.int32, device=DEV)
        return rpi, seq, num_real


def new_states(
    wl: Workload, args, layers: int, kinds=(True, False), direct_slots=False
):
    return [
        LRUCacheState(
            num_layers=layers,
            max_num_reqs=wl.max_reqs,
            num_locs=wl.num_locs,
            buffer_size=args.C,
            recent_window=args.W,
            top_k=args.K,
            device=DEV,
            use_triton=k,
            direct_slots=direct_slots,
        )
        for k in kinds
    ]


STATE_FIELDS = ("loc_to_slot", "slot_loc", "lru_order", "region_base", "counters")


def compare_plans(tag: str, a: LayerSwapPlan, b: LayerSwapPlan) -> bool:
    ok = True
    if not torch.equal(a.page_table, b.page_table):
        bad = (a.page_table != b.page_table).sum().item()
        fail(f"{tag}: page_table differs in {bad} entries")
        ok = False
    if not torch.equal(a.miss_count, b.miss_count):
        fail(f"{tag}: miss_count differs")
        return False
    k = a.page_table.shape[1]
    mask = torch.arange(k, device=DEV)[None] < a.miss_count[:, None].long()
    for name in ("miss_src_loc", "miss_dst_row"):
        x, y = getattr(a, name), getattr(b, name)
        if not torch.equal(torch.where(mask, x, 0), torch.where(mask, y, 0)):
            fail(f"{tag}: {name} differs")
            ok = False
    return ok


def compare_states(tag: str, a: LRUCacheState, b: LRUCacheState) -> bool:
    ok = True
    for name in STATE_FIELDS:
        if not torch.equal(getattr(a, name), getattr(b, name)):
            fail(f"{tag}: state {name} differs")
            ok = False
    return ok


def check_invariants(tag: str, s: LRUCacheState) -> bool:
    C = s.num_slots
    ok = True
    lru = s.lru_order.long()
    # Each request's order: its held slots once each, then -1.
    ar = torch.arange(C, device=DEV)
    held = torch.where(ar < s.capacity.long()[None, :, None], ar, -1)
    got = torch.where(lru >= 0, lru, C).sort(-1).values
    if not torch.equal(torch.where(got < C, got, -1), held.expand_as(lru)):
        fail(f"{tag}: lru_order is not a permutation of the held slots")
        ok = False
    for layer in range(s.num_layers):
        sl = s.slot_loc[layer].long()  # (R, U x C)
        slots = torch.arange(C, device=DEV).expand_as(sl)
        res = sl >= 0
        l2s = s.loc_to_slot[layer].long()
        if not torch.equal(l2s[sl[res]], slots[res]):
            fail(f"{tag}: layer {layer} slot_loc -> loc_to_slot inconsistent")
            ok = False
        if int((l2s >= 0).sum()) != int(res.sum()):
            fail(f"{tag}: layer {layer} stale loc_to_slot entries")
            ok = False
    return ok


def check_plan_structure(tag, s: LRUCacheState, plan, topk, seq, wl: Workload):
    """Page-table rows inside the region; misses hit distinct victims."""
    bs, C, R = wl.bs, s.buffer_size, s.region_size
    pt = plan.page_table[:bs].long()
    base = s.region_base[wl.rpi].long()[:, None]
    pos = topk[:bs].long()
    n = seq[:bs].long()[:, None]
    pad = (pos < 0) | (pos >= n)
    inside = (pt >= base) & (pt < base + R)
    if not bool(((pt == -1) == pad).all()) or not bool((inside | pad).all()):
        fail(f"{tag}: page-table rows outside the region or bad padding")
    if not bool((plan.page_table[bs:] == -1).all()) or not bool(
        (plan.miss_count[bs:] == 0).all()
    ):
        fail(f"{tag}: padding rows not no-ops")
    k = pt.shape[1]
    cnt = plan.miss_count[:bs].long()
    mask = torch.arange(k, device=DEV)[None] < cnt[:, None]
    dst = torch.where(mask, plan.miss_dst_row[:bs].long(), -1)
    srt = dst.sort(dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(dup.any()):
        fail(f"{tag}: two misses share a victim row")
    if not bool(((dst >= base) & (dst < base + C) | ~mask).all()):
        fail(f"{tag}: victim row outside the LRU slots")


def decode_step(wl: Workload, tri, ref, L: int, step: int, tag0: str) -> bool:
    """One decode step of every layer on both states: plans and states
    compared, the Triton plan's structure checked."""
    ok = True
    wl.seq_lens += 1
    dtype = torch.int32 if step % 2 else torch.int64
    rpi, seq, num_real = wl.inputs(dtype)
    for layer in range(L):
        topk = wl.topk(layer).to(dtype)
        tag = f"{tag0} step {step} layer {layer}"
        a = tri.swap_layer(layer, topk, rpi, seq, wl.req_to_token, num_real)
        b = ref.swap_layer(layer, topk, rpi, seq, wl.req_to_token, num_real)
        ok &= compare_plans(tag, a, b)
        check_plan_structure(tag, tri, a, topk, seq, wl)
    return ok & compare_states(f"{tag0} step {step}", tri, ref)


def run_record(tri, ok, wl, min_len, max_len, steps, L, t0, **extra) -> Dict:
    """A correctness run's JSON record (the Triton state's counters)."""
    if DEV == "cuda":
        torch.cuda.synchronize()
    c = tri.counters.sum(0).tolist()
    return {
        "bs": wl.bs,
        "seq_len_range": [min_len, max_len],
        "steps": steps,
        "layers": L,
        "ok": bool(ok),
        **extra,
        "lru_hits": c[0],
        "window_hits": c[1],
        "misses": c[2],
        "seconds": round(time.time() - t0, 2),
    }


def run_correctness(args, bs: int, min_len: int, max_len: int, seed: int) -> Dict:
    pad = 3
    L = args.layers
    wl = Workload(bs, pad, args, min_len, max_len, args.steps, keep=0.45, seed=seed)
    tri, ref = new_states(wl, args, L)
    for s in (tri, ref):
        wl.admit(s, warm=True)
    tag0 = f"correctness bs={bs} len={min_len}-{max_len}"
    ok = compare_states(f"{tag0} after warm", tri, ref)
    t0 = time.time()
    for step in range(args.steps):
        if step == args.steps // 2:
            # Churn: release a quarter of the requests, re-admit them with
            # their locs reshuffled (token locs reused by "new" requests).
            rows = list(range(0, bs, 4))
            rs = wl.rpi[rows]
            for s in (tri, ref):
                s.release_request(rs)
            wl.reuse_locs(rows)
            for s in (tri, ref):
                s.admit_request(rs, wl.bases[rows])
                wl.warm(s, rows)
        ok &= decode_step(wl, tri, ref, L, step, tag0)
        if not ok:
            break
    ok &= check_invariants(tag0, tri)
    return run_record(tri, ok, wl, min_len, max_len, step + 1, L, t0)


def run_direct_correctness(args, bs: int, min_len: int, max_len: int, seed: int):
    """Direct slots (``direct_slots``): every request admitted with the
    positions below its first window in slots 0.. (as the controller warms
    it), then decode steps, Triton vs the reference, bit for bit. Contexts
    near ``C + W`` leave direct mode during the run (``seq - W > C``)."""
    L, W = args.layers, args.W
    wl = Workload(bs, 3, args, min_len, max_len, args.steps, keep=0.45, seed=seed)
    tri, ref = new_states(wl, args, L, direct_slots=True)
    for s in (tri, ref):
        wl.admit(s, warm=False)
        for i in range(bs):
            # The first decode step has seq n + 1: its window starts at n + 1 - W.
            win_start = max(0, int(wl.seq_lens[i]) + 1 - W)
            r = int(wl.rpi[i])
            if win_start > 0:
                s.warm_request(range(L), r, wl.req_to_token[r, :win_start].long())
            s.enter_direct(r, win_start)
    tag0 = f"direct bs={bs} len={min_len}-{max_len}"
    ok = compare_states(f"{tag0} after warm", tri, ref)
    entered = int(tri.direct[wl.rpi].sum())
    t0 = time.time()
    for step in range(args.steps):
        ok &= decode_step(wl, tri, ref, L, step, tag0)
        if not torch.equal(tri.direct, ref.direct):
            fail(f"{tag0} step {step}: direct flags differ")
            ok = False
        if not ok:
            break
    ok &= check_invariants(tag0, tri)
    return run_record(
        tri,
        ok,
        wl,
        min_len,
        max_len,
        step + 1,
        L,
        t0,
        direct_entered=entered,
        direct_at_end=int(tri.direct[wl.rpi].sum()),
    )


def make_out(bs: int, K: int) -> LayerSwapPlan:
    return LayerSwapPlan(
        torch.empty((bs, K), dtype=torch.int32, device=DEV),
        torch.empty((bs, K), dtype=torch.int64, device=DEV),
        torch.empty((bs, K), dtype=torch.int32, device=DEV),
        torch.empty((bs,), dtype=torch.int32, device=DEV),
    )


def run_cuda_graph(args, bs: int, use_triton: bool, seed: int) -> Dict:
    pad = 2
    L = args.layers
    wl = Workload(bs, pad, args, 8192, 32768, args.steps, keep=0.45, seed=seed)
    eager, graphed = new_states(wl, args, L, kinds=(use_triton, use_triton))
    for s in (eager, graphed):
        wl.admit(s, warm=True)
    rows = bs + pad
    # -1 (padding) for the warm-up call below.
    s_topk = [
        torch.full((rows, args.K), -1, dtype=torch.int64, device=DEV) for _ in range(L)
    ]
    s_rpi, s_seq, s_num_real = (t.clone() for t in wl.inputs(torch.int64))
    outs = [make_out(rows, args.K) for _ in range(L)]
    tag0 = f"cuda graph bs={bs} triton={use_triton}"

    def swap_all(state: LRUCacheState, out) -> List[LayerSwapPlan]:
        return [
            state.swap_layer(
                layer,
                s_topk[layer],
                s_rpi,
                s_seq,
                wl.req_to_token,
                s_num_real,
                out=None if out is None else out[layer],
            )
            for layer in range(L)
        ]

    # Warm up (JIT) on a throwaway state, on a side stream as capture wants.
    scratch = new_states(wl, args, L, kinds=(use_triton,))[0]
    wl.admit(scratch, warm=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        swap_all(scratch, outs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        swap_all(graphed, outs)
    ok = True
    for step in range(args.steps):
        wl.seq_lens += 1
        rpi, seq, num_real = wl.inputs(torch.int64)
        if step % 3 == 2:
            # The last real row becomes padding (stale pool index, seq_len 1).
            num_real.fill_(max(0, bs - 1))
            seq[bs - 1] = 1
        s_rpi.copy_(rpi)
        s_seq.copy_(seq)
        s_num_real.copy_(num_real)
        for layer in range(L):
            s_topk[layer].copy_(wl.topk(layer))
        graph.replay()
        refs = swap_all(eager, None)
        for layer in range(L):
            tag = f"{tag0} step {step} layer {layer}"
            ok &= compare_plans(tag, outs[layer], refs[layer])
        ok &= compare_states(f"{tag0} step {step}", eager, graphed)
        if not ok:
            break

    # No host sync inside a swap (CUDA-graph safety, overlap scheduler).
    sync_ok = True
    prev_mode = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("error")
        eager.swap_layer(
            0, s_topk[0], s_rpi, s_seq, wl.req_to_token, s_num_real, out=outs[0]
        )
    except RuntimeError as e:
        sync_ok = False
        fail(f"{tag0}: swap_layer syncs the host: {e}")
    finally:
        torch.cuda.set_sync_debug_mode(prev_mode)
    torch.cuda.synchronize()
    return {
        "bs": bs,
        "use_triton": use_triton,
        "steps": step + 1,
        "ok": bool(ok),
        "no_host_sync": sync_ok,
    }


# The state's own buffers (slot_loc and lru_order are gathered views).
STATE_BUFFERS = (
    "_loc_to_slot_buf",
    "_slot_loc_buf",
    "_lru_buf",
    "_unit_base_buf",
    "_unit_index_buf",
    "_capacity_buf",
    "_direct_buf",
    "counters",
)


def snapshot(s: LRUCacheState):
    return [getattr(s, n).clone() for n in STATE_BUFFERS]


def restore(s: LRUCacheState, snap) -> None:
    for n, t in zip(STATE_BUFFERS, snap):
        getattr(s, n).copy_(t)


def time_graph(
    state: LRUCacheState, wl: Workload, topks, seqs, rpi, num_real, reps: int
):
    """Per-swap microseconds: a graph of len(topks) consecutive swaps of layer 0."""
    T = len(topks)
    outs = [make_out(topks[0].shape[0], state.top_k) for _ in range(2)]

    def body():
        for t in range(T):
            state.swap_layer(
                0, topks[t], rpi, seqs[t], wl.req_to_token, num_real, out=outs[t % 2]
            )

    return time_swap_graph(body, state.counters[0], T, reps)


def timing_workload(args, bs: int, keep: float, seed: int, kinds=(True, False)):
    """A timed graph's inputs: the workload, warm one-layer states of
    ``kinds``, the batch and --graph-steps steps of top-k and lengths."""
    T = args.graph_steps
    wl = Workload(bs, 0, args, args.min_len, args.max_len, 2 * T + 2, keep, seed)
    states = new_states(wl, args, 1, kinds)
    for s in states:
        wl.admit(s, warm=True)
    rpi, _, num_real = wl.inputs(torch.int64)
    topks, seqs = [], []
    for _ in range(T):
        wl.seq_lens += 1
        topks.append(wl.topk(0))
        seqs.append(wl.seq_lens.clone())
    return wl, states, rpi, num_real, topks, seqs


def run_timing(args, bs: int, keep: float, seed: int) -> Dict:
    wl, (tri, ref), rpi, num_real, topks, seqs = timing_workload(args, bs, keep, seed)
    snap = snapshot(tri)
    res = {
        "bs": bs,
        "keep": keep,
        "default_num_warps": tri.swap_backend.num_warps,
        "triton_us": {},
    }
    for nw in args.num_warps:
        restore(tri, snap)
        tri.swap_backend.num_warps = nw
        try:
            us, miss_rate = time_graph(tri, wl, topks, seqs, rpi, num_real, args.reps)
            res["triton_us"][nw] = round(us, 2)
            res["miss_rate"] = round(miss_rate, 4)
        except Exception as e:  # noqa: BLE001 - e.g. out of registers
            res["triton_us"][nw] = None
            print(f"num_warps={nw} failed: {type(e).__name__}: {e}")
    ok_times = {k: v for k, v in res["triton_us"].items() if v is not None}
    if ok_times:
        res["best_num_warps"] = min(ok_times, key=ok_times.get)
    if not args.skip_reference_timing:
        us, _ = time_graph(ref, wl, topks, seqs, rpi, num_real, max(5, args.reps // 5))
        res["reference_us"] = round(us, 2)
    return res


def add_workload_args(p: argparse.ArgumentParser, batch_sizes: List[int]) -> None:
    """The workload's options."""
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--C", type=int, default=4096, help="LRU rows per request and layer")
    p.add_argument("--K", type=int, default=2048, help="top-k width")
    p.add_argument("--W", type=int, default=64, help="recent-window rows")
    p.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=batch_sizes,
        help="decode batch sizes",
    )
    p.add_argument(
        "--min-len", type=int, default=8192, help="shortest request (tokens)"
    )
    p.add_argument(
        "--max-len", type=int, default=131072, help="longest request (tokens)"
    )
    p.add_argument("--graph-steps", type=int, default=16, help="swaps per timed graph")
    p.add_argument("--reps", type=int, default=50, help="timed graph replays")
    p.add_argument("--seed", type=int, default=0, help="random seed")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(p, [1, 16, 64, 128])
    p.add_argument("--layers", type=int, default=2, help="layers of the LRU state")
    p.add_argument("--steps", type=int, default=24, help="correctness steps")
    p.add_argument(
        "--num-warps",
        type=int,
        nargs="+",
        default=[4, 8, 16, 32],
        help="num_warps values of the swap kernels to time",
    )
    p.add_argument(
        "--skip-reference-timing",
        action="store_true",
        help="do not time the torch reference",
    )
    p.add_argument("--device", default="cuda", help="cpu: smoke test of the script")
    args = p.parse_args()
    global DEV
    DEV = args.device
    if DEV == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2

    import triton

    result = {
        "device": torch.cuda.get_device_name() if DEV == "cuda" else DEV,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "config": {k: v for k, v in vars(args).items()},
        "correctness": [],
        "direct": [],
        "cuda_graph": [],
        "timing": [],
    }

    def guarded(section: str, fn, *a):
        try:
            r = fn(*a)
            result[section].append(r)
            print(json.dumps(r), flush=True)
        except Exception:  # noqa: BLE001 - record and keep going
            tb = traceback.format_exc()
            fail(f"{section} {a[1:]}: exception\n{tb}")
            result[section].append({"args": repr(a[1:]), "error": tb})

    seed = args.seed
    for bs in args.batch_sizes:
        guarded(
            "correctness", run_correctness, args, bs, args.min_len, args.max_len, seed
        )
        seed += 1
    # Short sequences (n < K): top-k padding with -1, window-heavy rows.
    guarded("correctness", run_correctness, args, 16, 1, 3 * args.K, seed)
    seed += 1
    # Direct slots: contexts that fit their slots, and ones that outgrow
    # them during the run (seq - W crosses C).
    C, W, half = args.C, args.W, args.steps // 2
    for bs, lo, hi in ((16, 1, C + W - 1), (64, C + W - 1 - half, C + W - 1)):
        guarded("direct", run_direct_correctness, args, bs, lo, hi, seed)
        seed += 1
    if DEV == "cuda":
        for bs in (16, 64):
            for use_triton in (True, False):
                guarded("cuda_graph", run_cuda_graph, args, bs, use_triton, seed)
                seed += 1
        for bs in args.batch_sizes:
            for keep in (0.45, 0.0):
                guarded("timing", run_timing, args, bs, keep, seed)
                seed += 1

    print()
    hdr = f"{'bs':>4} {'keep':>5} {'miss%':>6} " + " ".join(
        f"{'nw=' + str(w):>8}" for w in args.num_warps
    )
    hdr += f" {'default':>8} {'ref':>9}  (us per layer swap)"
    print(hdr)
    for r in result["timing"]:
        if "error" in r:
            continue
        cells = " ".join(
            f"{r['triton_us'][w]:8.2f}" if r["triton_us"].get(w) else f"{'-':>8}"
            for w in args.num_warps
        )
        ref = r.get("reference_us")
        print(
            f"{r['bs']:>4} {r['keep']:>5} {100 * r.get('miss_rate', 0):6.1f} {cells} "
            f"{r['default_num_warps']:>8} {ref if ref is not None else '-':>9}"
        )
    return finish_check(result, FAILURES, args.out)


if __name__ == "__main__":
    sys.exit(main())
