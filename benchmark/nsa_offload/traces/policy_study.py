"""CPU study of replacement policies for the decode-side NSA KV offload.

Question: at EQUAL GPU rows per (request, layer), is there a kernel-friendly
replacement policy that needs clearly fewer host->GPU row loads than upstream
HiSparse (target P6: <= 0.8x HiSparse's misses)?

Everything is counted exactly like ``replay.py``: HiSparse gets ``H = B - 1``
LRU slots plus its newest-token row; our engine-shaped policies get ``C = B - W``
slots plus the ``W``-row recent window (positions ``p >= seq_len - W`` are free
hits); Belady's OPT gets ``B - 1`` flexible rows plus the free newest token.
Misses per (request, layer, step) in steady state (each request's first
``replay.DEFAULT_WARMUP`` steps excluded), via ``replay.result_from_misses`` and
``replay.summarize``. HiSparse, ours, the trace loading and OPT are imported
from ``replay.py``.

Candidates (all demand loading: every pick of a step must be resident at that
step; the misses of a step take victims among the slots not hit in the step, in
the order of a per-policy eviction key, ties broken by recency):

* ``ours``          -- ``replay.OursLRU`` (docs/ENGINE.md; misses most recent).
* ``lru-hitsmru``   -- ours with HiSparse's tie order (hits most recent).
* ``lfu-slot-N``    -- LFU with aging, counter per GPU slot: a hit adds 1, a
  load sets 1, all counters halve every N steps; evict the lowest count, then LRU.
* ``lfu-tok-N``     -- same, but the counter belongs to the token (per layer and
  token loc, like ``loc_to_slot``): it survives eviction, so a token picked
  often in the past comes back with its history.
* ``slru-F``        -- segmented LRU: a slot hit while resident becomes
  protected; at most ``F * C`` protected (the oldest extra ones are demoted to
  probation); evict probation first (LRU), then protected (LRU).
* ``clock`` / ``clock-ref1`` -- CLOCK second chance: a reference bit per slot
  (set by a hit; a load sets it to 0 / 1), a hand sweeps in slot order and
  clears the bits it passes; the hit slots of the step are skipped.
* ``xlayer``        -- cross-layer hint: evictable slots whose token is in the
  previous model layer's top-k at this step are evicted last (LRU otherwise).
  Layer l-1's top-k is known when layer l swaps in a real server. Only layers
  whose previous model layer is in the trace get the hint; the others run as
  ``lru-hitsmru`` (the per-layer tables say which).
* ``xlayer+lfu-tok-N`` -- the hint first, then the token counter, then LRU.
* ``opt``           -- ``replay.belady_misses``: lower bound.

Example (repository root)::

    python benchmark/nsa_offload/traces/policy_study.py \\
        --trace embedded=benchmark/nsa_offload/traces/dsv32_synth_default.npz \\
        --trace 61l_68k=/tmp/dsv32_61l_68k.npz --variants long-memory,short-memory \\
        --out-dir benchmark/nsa_offload/results/policy_study
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import replay  # noqa: E402
from trace_format import NSATopkTrace, load_trace  # noqa: E402

DEFAULT_BUDGETS = (2560, 4160, 8192)
HEADLINE_BUDGET = 4160


# ------------------------------------------------------------------ simulators


class KeyedPolicy:
    """C slots + W recent window of one (layer, request); eviction by key.

    Victims of a step: the slots not hit in the step, sorted by
    ``(empty first, primary key ascending, recency stamp ascending)``; the j-th
    miss in top-k order takes the j-th. With a constant primary key and
    ``hits_mru=False`` this is exactly ``replay.OursLRU`` (checked by
    ``self_check``).
    """

    name = "keyed"

    def __init__(self, C: int, W: int, max_pos: int, hits_mru: bool = True):
        self.C, self.W = int(C), int(W)
        self.hits_mru = hits_mru
        self.slot_pos = np.full(self.C, -1, dtype=np.int64)
        self.pos_to_slot = np.full(max_pos + 1, -1, dtype=np.int64)
        # Recency stamps: empty slots are the oldest, in slot order.
        self.stamp = np.arange(self.C, dtype=np.int64) - self.C
        self.clock = 0
        self.t = 0  # steps done

    # Hooks (override) ---------------------------------------------------
    def primary(self, slots: np.ndarray, ctx: Dict) -> Optional[np.ndarray]:
        return None  # constant key: plain LRU

    def secondary(self, slots: np.ndarray, ctx: Dict) -> Optional[np.ndarray]:
        return None

    def update(self, hit_slots: np.ndarray, victims: np.ndarray, ctx: Dict) -> None:
        pass

    # ---------------------------------------------------------------------
    def step(self, pos: np.ndarray, n: int, ctx: Optional[Dict] = None) -> int:
        ctx = ctx or {}
        pos = np.asarray(pos, dtype=np.int64)
        valid = (pos >= 0) & (pos < n)
        p = pos[valid & (pos < n - self.W)]
        if p.size and p.max() >= self.pos_to_slot.size:
            extra = np.full(int(p.max()) + 1 - self.pos_to_slot.size, -1, np.int64)
            self.pos_to_slot = np.concatenate([self.pos_to_slot, extra])
        ctx["picks"] = p
        s = self.pos_to_slot[p]
        hit = s >= 0
        miss_pos = p[~hit]
        m = miss_pos.size
        hit_slots = s[hit]
        hit_flag = np.zeros(self.C, dtype=bool)
        hit_flag[hit_slots] = True
        ev = np.nonzero(~hit_flag)[0]
        victims = self.choose(ev, m, ctx)
        old = self.slot_pos[victims]
        self.pos_to_slot[old[old >= 0]] = -1
        self.pos_to_slot[miss_pos] = victims
        self.slot_pos[victims] = miss_pos
        # Recency: hits keep their old relative order.
        hs = np.unique(hit_slots)
        hs = hs[np.argsort(self.stamp[hs], kind="stable")]
        first, second = (victims, hs) if self.hits_mru else (hs, victims)
        self.stamp[first] = self.clock + np.arange(first.size)
        self.clock += first.size
        self.stamp[second] = self.clock + np.arange(second.size)
        self.clock += second.size
        self.update(hs, victims, ctx)
        self.t += 1
        return int(m)

    def choose(self, ev: np.ndarray, m: int, ctx: Dict) -> np.ndarray:
        if m == 0:
            return ev[:0]
        keys = [self.stamp[ev]]
        sec = self.secondary(ev, ctx)
        if sec is not None:
            keys.append(sec)
        prim = self.primary(ev, ctx)
        if prim is not None:
            keys.append(prim)
        keys.append((self.slot_pos[ev] >= 0).astype(np.int8))  # empty first
        order = np.lexsort(keys)
        return ev[order[:m]]


class LFUSlot(KeyedPolicy):
    """Per-slot pick counter: hit +1, load = 1, halved every ``period`` steps."""

    def __init__(self, C, W, max_pos, period: int, hits_mru=True):
        super().__init__(C, W, max_pos, hits_mru)
        self.period = int(period)
        self.cnt = np.zeros(self.C, dtype=np.int32)

    def primary(self, slots, ctx):
        return self.cnt[slots]

    def update(self, hit_slots, victims, ctx):
        self.cnt[hit_slots] = np.minimum(self.cnt[hit_slots] + 1, 255)
        self.cnt[victims] = 1
        if (self.t + 1) % self.period == 0:
            self.cnt >>= 1


class LFUToken(KeyedPolicy):
    """Per-token pick counter (survives eviction), halved every ``period`` steps."""

    def __init__(self, C, W, max_pos, period: int, hits_mru=True, xlayer=False):
        super().__init__(C, W, max_pos, hits_mru)
        self.period = int(period)
        self.tok = np.zeros(max_pos + 1, dtype=np.int32)
        self.xlayer = xlayer

    def primary(self, slots, ctx):
        key = self.tok[self.slot_pos[slots]]
        if self.xlayer and ctx.get("prev_mark") is not None:
            # Hinted tokens go last: a large offset dominates the counter.
            key = key + 1024 * _hinted(self, slots, ctx)
        return key

    def update(self, hit_slots, victims, ctx):
        p = ctx["picks"]
        if p.size and p.max() >= self.tok.size:
            self.tok = np.concatenate(
                [self.tok, np.zeros(int(p.max()) + 1 - self.tok.size, np.int32)]
            )
        self.tok[p] = np.minimum(self.tok[p] + 1, 255)
        if (self.t + 1) % self.period == 0:
            self.tok >>= 1


class SLRU(KeyedPolicy):
    """Segmented LRU: protected after a hit, at most ``frac * C`` protected."""

    def __init__(self, C, W, max_pos, frac: float, hits_mru=True):
        super().__init__(C, W, max_pos, hits_mru)
        self.cap = int(frac * self.C)
        self.prot = np.zeros(self.C, dtype=np.int8)

    def primary(self, slots, ctx):
        return self.prot[slots]

    def update(self, hit_slots, victims, ctx):
        self.prot[victims] = 0
        self.prot[hit_slots] = 1
        excess = int(self.prot.sum()) - self.cap
        if excess > 0:  # demote the least recently used protected slots
            ps = np.nonzero(self.prot)[0]
            ps = ps[np.argsort(self.stamp[ps], kind="stable")[:excess]]
            self.prot[ps] = 0


def _hinted(pol: KeyedPolicy, slots: np.ndarray, ctx: Dict) -> np.ndarray:
    mark = ctx["prev_mark"]
    sp = pol.slot_pos[slots]
    ok = (sp >= 0) & (sp < mark.size)
    out = np.zeros(slots.size, dtype=np.int32)
    out[ok] = mark[sp[ok]]
    return out


class CrossLayer(KeyedPolicy):
    """LRU; tokens in the previous model layer's top-k of this step evicted last."""

    def primary(self, slots, ctx):
        if ctx.get("prev_mark") is None:
            return None
        return _hinted(self, slots, ctx)


class Clock(KeyedPolicy):
    """CLOCK second chance over the C slots (hit slots of the step skipped).

    ``engine_rule``: the variant the engine had (``nsa_kv_offload_clock``, since
    removed from the offload) instead
    of the study's: empty slots are found by the sweep like any clear bit
    (the study takes them first wherever they are while they outnumber the
    misses, and leaves the hand), and after a full revolution the misses
    take the first revolution's victims before the second's (the study:
    all of them in sweep order). The two pick other victims when the empty
    slots run out and place them otherwise after a full revolution; their
    misses differ by at most 0.2% on the synthetic trace
    (``results/policy_study/engine_clock/``)."""

    def __init__(self, C, W, max_pos, ref_on_load: int = 0, engine_rule=False):
        super().__init__(C, W, max_pos, hits_mru=True)
        self.ref = np.zeros(self.C, dtype=np.int8)
        self.hand = 0
        self.ref_on_load = int(ref_on_load)
        self.engine_rule = engine_rule

    def choose(self, ev, m, ctx):
        if m == 0:
            return ev[:0]
        # Sweep order: slot order starting at the hand, hit slots skipped.
        cand = np.roll(ev, -int(np.searchsorted(ev, self.hand)))
        empty = cand[self.slot_pos[cand] < 0]
        if not self.engine_rule and empty.size >= m:
            return empty[:m]
        r = self.ref[cand]
        zeros = np.nonzero(r == 0)[0]
        if zeros.size >= m:
            last = zeros[m - 1]
            self.ref[cand[:last]] = 0  # passed over: second chance used
            victims = cand[zeros[:m]]
            self.hand = (int(cand[last]) + 1) % self.C
        else:  # a full revolution clears every bit, the second pass takes the rest
            self.ref[cand] = 0
            ones = np.nonzero(r != 0)[0][: m - zeros.size]
            idx = np.concatenate([zeros, ones])
            victims = cand[idx if self.engine_rule else np.sort(idx)]
            self.hand = (int(cand[ones[-1]]) + 1) % self.C
        return victims

    def update(self, hit_slots, victims, ctx):
        self.ref[hit_slots] = 1
        self.ref[victims] = self.ref_on_load


class OursAdapter:
    """``replay.OursLRU`` / ``replay.HiSparseLRU`` behind the study's step()."""

    def __init__(self, inner):
        self.inner = inner

    def step(self, pos, n, ctx=None):
        return self.inner.step(pos, n).misses


# ---------------------------------------------------------------------- replay


def prev_layer_index(trace: NSATopkTrace) -> List[Optional[int]]:
    ids = trace.layer_ids.tolist()
    where = {lid: i for i, lid in enumerate(ids)}
    return [where.get(lid - 1) for lid in ids]


def request_layer_steps(trace: NSATopkTrace):
    """(step, request column, sequence length, layer index, request's largest
    sequence length) for every (step, request present, layer), in replay order."""
    S, L = trace.topk.shape[:2]
    max_pos = trace.seq_lens.max(axis=0)
    for s in range(S):
        for b in np.nonzero(trace.seq_lens[s] > 0)[0]:
            n = int(trace.seq_lens[s, b])
            for li in range(L):
                yield s, int(b), n, li, int(max_pos[b])


def replay_misses(
    trace: NSATopkTrace, make: Callable[[int], object], use_hint: bool = False
) -> np.ndarray:
    """Misses (S, L, B) of one policy; per (layer, request) independent states."""
    S, L, B, _ = trace.topk.shape
    out = np.zeros((S, L, B), dtype=np.int64)
    prev = prev_layer_index(trace)
    states: Dict[Tuple[int, int], object] = {}
    for s, b, n, li, max_pos in request_layer_steps(trace):
        key = (li, b)
        if key not in states:
            states[key] = make(max_pos)
        ctx = {}
        if use_hint and prev[li] is not None:
            row = trace.topk[s, prev[li], b]
            row = row[(row >= 0) & (row < n)]
            mark = np.zeros(n, dtype=np.int32)
            mark[row] = 1
            ctx["prev_mark"] = mark
        out[s, li, b] = states[key].step(trace.topk[s, li, b], n, ctx)
    return out


def policy_factories(budget: int, window: int) -> Dict[str, Tuple[Callable, bool]]:
    """name -> (make(max_pos), uses the cross-layer hint)."""
    C, H = budget - window, budget - 1
    f: Dict[str, Tuple[Callable, bool]] = {
        "hisparse": (lambda mp: OursAdapter(replay.HiSparseLRU(H, mp, "cold")), False),
        "ours": (lambda mp: OursAdapter(replay.OursLRU(C, window, mp, "cold")), False),
        "lru-hitsmru": (
            lambda mp: OursAdapter(
                replay.OursLRU(C, window, mp, "cold", hits_mru=True)
            ),
            False,
        ),
    }
    for period in (2, 4, 8, 16):
        f[f"lfu-slot-{period}"] = (
            lambda mp, q=period: LFUSlot(C, window, mp, q),
            False,
        )
    for period in (4, 8, 16, 32, 64):
        f[f"lfu-tok-{period}"] = (
            lambda mp, q=period: LFUToken(C, window, mp, q),
            False,
        )
    for frac in (0.25, 0.5, 0.75):
        f[f"slru-{frac}"] = (lambda mp, fr=frac: SLRU(C, window, mp, fr), False)
    f["clock"] = (lambda mp: Clock(C, window, mp, 0), False)
    f["clock-ref1"] = (lambda mp: Clock(C, window, mp, 1), False)
    f["xlayer"] = (lambda mp: CrossLayer(C, window, mp), True)
    for period in (8, 32):
        f[f"xlayer+lfu-tok-{period}"] = (
            lambda mp, q=period: LFUToken(C, window, mp, q, xlayer=True),
            True,
        )
    return f


def self_check(trace: NSATopkTrace, budget: int, window: int) -> bool:
    """KeyedPolicy(constant key, misses MRU) == replay.OursLRU on every swap."""
    C = budget - window
    a = replay_misses(
        trace, lambda mp: OursAdapter(replay.OursLRU(C, window, mp, "cold"))
    )
    b = replay_misses(trace, lambda mp: KeyedPolicy(C, window, mp, hits_mru=False))
    c = replay_misses(
        trace,
        lambda mp: OursAdapter(replay.OursLRU(C, window, mp, "cold", hits_mru=True)),
    )
    d = replay_misses(trace, lambda mp: KeyedPolicy(C, window, mp, hits_mru=True))
    return bool((a == b).all() and (c == d).all())


def study_trace(
    trace: NSATopkTrace,
    budgets: Sequence[int],
    window: int,
    warmup: int,
    only: Optional[Sequence[str]] = None,
) -> Dict:
    res: Dict = {}
    prev = prev_layer_index(trace)
    hinted_layers = [
        int(lid) for lid, p in zip(trace.layer_ids.tolist(), prev) if p is not None
    ]
    for budget in budgets:
        t0 = time.time()
        row: Dict = {}
        for name, (make, hint) in policy_factories(budget, window).items():
            if only and name not in only and name != "hisparse":
                continue
            m = replay_misses(trace, make, use_hint=hint)
            row[name] = _summ(trace, m, warmup)
        m = replay.belady_misses(trace, budget)
        row["opt"] = _summ(trace, m, warmup)
        hs = row["hisparse"]["misses_per_row"]
        for v in row.values():
            v["ratio"] = v["misses_per_row"] / hs if hs else None
            for pl, hl in zip(v["per_layer"], row["hisparse"]["per_layer"]):
                pl["ratio"] = (
                    pl["misses_per_row"] / hl["misses_per_row"]
                    if hl["misses_per_row"]
                    else None
                )
        res[str(budget)] = row
        print(f"    B={budget}: {time.time() - t0:.1f}s", file=sys.stderr)
    return {"budgets": res, "hinted_layers": hinted_layers}


def _summ(trace: NSATopkTrace, misses: np.ndarray, warmup: int) -> Dict:
    s = replay.summarize(replay.result_from_misses(trace, misses, warmup), trace)
    return {
        "misses_per_row": s["misses_per_row"],
        "misses_per_row_all": s["misses_per_row_all"],
        "hit_rate": s["hit_rate"],
        "per_layer": [
            {"layer": e["layer"], "misses_per_row": e["misses_per_row"]}
            for e in s["per_layer"]
        ],
    }


# ----------------------------------------------------------------------- traces


# Sensitivity variants (same overrides as sensitivity.py's VARIANTS).
def variant_trace(name: str, layers: Sequence[int], requests: int, steps: int):
    import sensitivity
    import trace_gen

    desc, overrides, init = sensitivity.VARIANTS[name]
    if init != "cold":
        raise ValueError("only cold-init variants are supported here")
    cfg = trace_gen.GeneratorConfig(
        layers=list(layers),
        num_requests=requests,
        prompt_lens=[16384, 32768],
        num_steps=steps,
        seed=0,
    )
    cfg = dataclasses.replace(cfg, **overrides)
    trace, _ = trace_gen.build_trace(cfg, f"policy_study.py variant {name}", False)
    return trace, desc


# ---------------------------------------------------------------------- report


def render(results: Dict, budgets: Sequence[int], window: int) -> str:
    traces = list(results["traces"])
    lines = ["# Replacement-policy study (CPU replay, synthetic traces)\n"]
    lines.append(
        "Misses per (request, layer, decode step), steady state (first "
        f"{results['warmup']} steps of each request excluded), and the ratio to "
        "HiSparse at equal GPU rows B per (request, layer): HiSparse H = B - 1 "
        f"LRU slots + newest row; all other policies C = B - {window} slots + "
        f"W = {window} recent window; OPT = Belady with B - 1 rows + newest.\n"
    )
    for t in traces:
        info = results["traces"][t]
        lines.append(f"- `{t}`: {info['description']} (layers {info['layers']})")
    lines.append("")
    for budget in budgets:
        lines.append(f"## B = {budget}\n")
        lines.append(
            "| policy | " + " | ".join(f"{t}" for t in traces) + " | worst ratio |"
        )
        lines.append("|:--|" + "---:|" * (len(traces) + 1))
        names = list(results["traces"][traces[0]]["study"]["budgets"][str(budget)])
        for name in names:
            cells, ratios = [], []
            for t in traces:
                v = results["traces"][t]["study"]["budgets"][str(budget)].get(name)
                if v is None:
                    cells.append("-")
                    continue
                cells.append(f"{v['misses_per_row']:.1f} ({v['ratio']:.3f})")
                ratios.append(v["ratio"])
            worst = f"{max(ratios):.3f}" if ratios else "-"
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {worst} |")
        lines.append("")
    # Cross-layer hint on hinted layers only.
    lines.append("## Cross-layer hint, layers whose previous model layer is traced\n")
    lines.append(
        "Mean over those layers of misses per (request, step) (ratio to "
        "HiSparse on the same layers).\n"
    )
    cols = [
        "hisparse",
        "lru-hitsmru",
        "xlayer",
        "lfu-tok-32",
        "xlayer+lfu-tok-32",
        "opt",
    ]
    lines.append("| trace | B | hinted layers | " + " | ".join(cols) + " |")
    lines.append("|:--|---:|:--|" + "---:|" * len(cols))
    for t in traces:
        st = results["traces"][t]["study"]
        hl = set(st["hinted_layers"])
        if not hl:
            continue
        for budget in budgets:
            row = st["budgets"][str(budget)]
            base = None
            cells = []
            for c in cols:
                if c not in row:
                    cells.append("-")
                    continue
                vals = [
                    e["misses_per_row"] for e in row[c]["per_layer"] if e["layer"] in hl
                ]
                mean = float(np.mean(vals))
                if c == "hisparse":
                    base = mean
                cells.append(f"{mean:.1f} ({mean / base:.3f})")
            lab = (
                f"{min(hl)}-{max(hl)} ({len(hl)})"
                if len(hl) > 3
                else ",".join(map(str, sorted(hl)))
            )
            lines.append(f"| {t} | {budget} | {lab} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--trace",
        action="append",
        default=[],
        help="NAME=PATH of a trace .npz (repeatable)",
    )
    p.add_argument(
        "--variants",
        default="",
        help="comma list of sensitivity.py variants to generate (cold init only)",
    )
    p.add_argument(
        "--variant-layers",
        default="20,21,22,40",
        help="comma-separated layers of the generated trace variants",
    )
    p.add_argument(
        "--variant-requests",
        type=int,
        default=4,
        help="requests per generated trace variant",
    )
    p.add_argument(
        "--variant-steps",
        type=int,
        default=64,
        help="decode steps per generated trace variant",
    )
    p.add_argument(
        "--budgets",
        default=",".join(map(str, DEFAULT_BUDGETS)),
        help="comma-separated LRU rows per request and layer",
    )
    p.add_argument(
        "--window",
        type=int,
        default=replay.DEFAULT_WINDOW,
        help="recent-window rows per request (W)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=replay.DEFAULT_WARMUP,
        help="first decode steps left out of the steady-state counts",
    )
    p.add_argument("--only", default="", help="comma list of policies (+hisparse)")
    p.add_argument(
        "--no-self-check",
        action="store_true",
        help="skip the policies' self-check against the reference model",
    )
    p.add_argument(
        "--out-dir", default=None, help="folder for the results (default: print only)"
    )
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    budgets = [int(x) for x in args.budgets.split(",")]
    only = [x for x in args.only.split(",") if x] or None
    results: Dict = {
        "window": args.window,
        "warmup": args.warmup,
        "budgets": budgets,
        "traces": {},
    }
    todo = []
    for spec in args.trace:
        name, path = spec.split("=", 1)
        todo.append((name, lambda path=path: (load_trace(path), path)))
    vlayers = [int(x) for x in args.variant_layers.split(",")]
    for v in [x for x in args.variants.split(",") if x]:
        todo.append(
            (
                v,
                lambda v=v: variant_trace(
                    v, vlayers, args.variant_requests, args.variant_steps
                ),
            )
        )
    for name, load in todo:
        t0 = time.time()
        trace, desc = load()
        if name == todo[0][0] and not args.no_self_check:
            ok = self_check(trace, budgets[0], args.window)
            results["self_check"] = ok
            print(f"  self-check KeyedPolicy == OursLRU: {ok}", file=sys.stderr)
        print(f"  {name}: {trace.topk.shape}", file=sys.stderr)
        study = study_trace(trace, budgets, args.window, args.warmup, only)
        results["traces"][name] = {
            "description": os.path.basename(desc) if "/" in desc else desc,
            "layers": (
                f"{len(trace.layer_ids)} layers"
                if len(trace.layer_ids) > 8
                else ",".join(map(str, trace.layer_ids.tolist()))
            ),
            "shape": list(trace.topk.shape),
            "study": study,
        }
        print(f"  {name}: {time.time() - t0:.1f}s", file=sys.stderr)
    md = render(results, budgets, args.window)
    print(md)
    if args.out_dir:
        replay.write_summary(args.out_dir, md, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
