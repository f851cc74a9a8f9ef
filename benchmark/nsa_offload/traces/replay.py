"""Offline (CPU) replay of NSA decode top-k traces through GPU-residency policies.

Replays a trace (``trace_format.py``) through two policies that keep a
per-(request, layer) working set of KV rows on the GPU and load every other
picked row from host memory:

* **ours** -- ``docs/ENGINE.md``: ``C`` LRU slots plus a recent window of the
  ``W`` newest tokens. Positions ``p >= seq_len - W`` are always hits (window
  rows are written by the decode step); the others go through the LRU: hits
  keep their slot, misses in top-k order take the least recently used slots
  not hit in this step, and the new recency order is
  ``[untaken evictable] + [hits, old order] + [misses, top-k order]``.
* **hisparse** -- upstream SGLang 0.5.12.post1 HiSparse
  (``jit_kernel/csrc/hisparse.cuh``, ``managers/hisparse_coordinator.py``):
  only the newest token (``p == seq_len - 1``) is resident outside the LRU (one
  reserved row); ``H = device_buffer_size`` LRU slots. Misses in top-k order
  take the least recently used slots not hit in this step (same victim rule),
  but the new order is ``[untaken evictable] + [misses, top-k order] + [hits,
  old order]`` -- hits become the most recent. Requests with
  ``seq_len <= H`` take the kernel's fast path (everything resident).

Rows are counted per (request, layer): a GPU budget of ``B`` rows is
``C + W = B`` for ours and ``H + 1 = B`` for HiSparse (its newest-token row; the
upstream allocator reserves a whole page for it, we count one row, which
favours HiSparse). Misses are H2D row copies of ``row_bytes`` (656 B, fp8
FlashMLA layout) each.

The sweeps use the numpy models below (``OursLRU``, ``HiSparseLRU``). For one
configuration the real engine reference path
(``sglang.srt.mem_cache.lru_cache_state.LRUCacheState(use_triton=False)``) is
replayed too and compared entry by entry (miss counts, copy lists, page
tables): the "exactness of the reference engine" line.

Example (repository root)::

    python benchmark/nsa_offload/traces/replay.py \\
        --trace benchmark/nsa_offload/traces/dsv32_synth_default.npz \\
        --out-dir benchmark/nsa_offload/results/embedded
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trace_format import NSATopkTrace, load_trace  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[3]
ROW_BYTES_FP8 = 656
DEFAULT_BUDGETS = (2112, 2560, 3072, 4160, 5120, 6144, 8192)
DEFAULT_WINDOWS = (0, 1, 16, 64, 128, 256, 512)
# Engine defaults (docs/ENGINE.md): C = 2 * K, W = 64.
DEFAULT_WINDOW = 64
P6_TARGET = 0.8
# Steps per request excluded from the steady-state figures (cold working set).
DEFAULT_WARMUP = 8
# Distance-from-newest buckets of the miss breakdown.
DIST_EDGES = (0, 1, 16, 64, 256, 512, 1024)
DIST_LABELS = ("0", "1-15", "16-63", "64-255", "256-511", "512-1023", ">=1024")
LRU_CACHE_STATE_REL = Path("python/sglang/srt/mem_cache/lru_cache_state.py")
# LRU state at a request's first decode step: empty; positions 0 .. C - 1
# (HiSparse's colocated admission); every slot filled with the newest positions
# below the first step's window; the newest top-k of them (what the server's
# admission warms: SparseCacheController.warm_tokens).
INITS = ("cold", "prefix", "newest", "topk")


def warm_count(init: str, slots: int, top_k: int) -> int:
    """Positions ``init`` warms below the first step's window (prefix: 0, set
    up front instead)."""
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}")
    return {"newest": slots, "topk": min(top_k, slots)}.get(init, 0)


@dataclass
class StepResult:
    misses: int
    lru_hits: int
    window_hits: int  # ours: recent window; HiSparse: newest-token row
    valid: int
    miss_pos: np.ndarray  # missed positions, top-k order
    # Only with want_plan: slot per top-k entry (window: C + p % W; -1 padding)
    # and the victim slot of each miss, in miss order.
    rows: Optional[np.ndarray] = None
    victims: Optional[np.ndarray] = None


class _LRUBase:
    """Residency of one (layer, request): LRU slots over token positions.

    Positions stand in for token locs (a bijection within a request).
    """

    def __init__(self, lru_slots: int, max_pos: int, init: str, top_k: int = 2048):
        self.C = int(lru_slots)
        self.slot_pos = np.full(self.C, -1, dtype=np.int64)
        self.pos_to_slot = np.full(max_pos + 1, -1, dtype=np.int64)
        # order[0] is the least recently used slot.
        self.order = np.arange(self.C, dtype=np.int64)
        # Positions warmed at the first step, below its window (INITS).
        self._warm_pending = warm_count(init, self.C, top_k)
        if init == "prefix":
            # Slot i holds position i, LRU first (HiSparse's colocated admission;
            # for ours, warm_request over positions 0..C-1 gives the same state).
            m = min(self.C, max_pos + 1)
            self.slot_pos[:m] = np.arange(m)
            self.pos_to_slot[:m] = np.arange(m)

    def _warm_below(self, below: int) -> None:
        """At the first step: the newest warmed positions below ``below``,
        oldest first, as one swap of a fresh state (the engine's warm_request:
        position i of them in slot i, the newest most recent)."""
        k, self._warm_pending = min(self._warm_pending, below), 0
        if k > 0:
            self._swap(np.arange(below - k, below, dtype=np.int64), hits_mru=True)

    def _lookup(self, p: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        if p.size and p.max() >= self.pos_to_slot.size:
            grow = max(int(p.max()) + 1, 2 * self.pos_to_slot.size)
            extra = np.full(grow - self.pos_to_slot.size, -1, dtype=np.int64)
            self.pos_to_slot = np.concatenate([self.pos_to_slot, extra])
        s = self.pos_to_slot[p]
        return s, s >= 0

    def _swap(
        self, p: np.ndarray, hits_mru: bool
    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Hit/miss of looked-up positions ``p`` (top-k order); updates state.

        Returns (slot per entry, hit mask, missed positions, victim slots).
        """
        s, hit = self._lookup(p)
        miss_pos = p[~hit]
        m = miss_pos.size
        hit_flag = np.zeros(self.C, dtype=bool)
        hit_flag[s[hit]] = True
        in_order_hit = hit_flag[self.order]
        evictable = self.order[~in_order_hit]
        hits = self.order[in_order_hit]
        victims = evictable[:m]
        old = self.slot_pos[victims]
        self.pos_to_slot[old[old >= 0]] = -1
        self.pos_to_slot[miss_pos] = victims
        self.slot_pos[victims] = miss_pos
        if hits_mru:  # HiSparse and ours (docs/ENGINE.md)
            self.order = np.concatenate([evictable[m:], victims, hits])
        else:  # the engine's first rule (misses most recent), a what-if now
            self.order = np.concatenate([evictable[m:], hits, victims])
        slot = s.copy()
        slot[~hit] = victims
        return slot, hit, miss_pos, victims


class OursLRU(_LRUBase):
    """docs/ENGINE.md swap of one (layer, request): ``C`` LRU slots + ``W`` window."""

    def __init__(
        self,
        lru_slots: int,
        window: int,
        max_pos: int,
        init: str = "cold",
        hits_mru: bool = True,
        top_k: int = 2048,
    ):
        super().__init__(lru_slots, max_pos, init, top_k)
        self.W = int(window)
        # hits_mru=False: misses most recent, the engine's first tie rule (a
        # what-if kept for comparison).
        self.hits_mru = hits_mru

    def step(self, pos: np.ndarray, n: int, want_plan: bool = False) -> StepResult:
        if self._warm_pending:
            self._warm_below(max(0, n - self.W))
        pos = np.asarray(pos, dtype=np.int64)
        valid = (pos >= 0) & (pos < n)
        in_win = valid & (pos >= n - self.W)
        lookup = valid & ~in_win
        slot, hit, miss_pos, victims = self._swap(pos[lookup], self.hits_mru)
        res = StepResult(
            misses=int(miss_pos.size),
            lru_hits=int(hit.sum()),
            window_hits=int(in_win.sum()),
            valid=int(valid.sum()),
            miss_pos=miss_pos,
        )
        if want_plan:
            rows = np.full(pos.size, -1, dtype=np.int64)
            rows[lookup] = slot
            if self.W:
                rows[in_win] = self.C + pos[in_win] % self.W
            res.rows, res.victims = rows, victims
        return res


class HiSparseLRU(_LRUBase):
    """Upstream HiSparse swap-in of one (layer, request): ``H`` LRU slots + newest row."""

    def __init__(
        self, lru_slots: int, max_pos: int, init: str = "cold", top_k: int = 2048
    ):
        super().__init__(lru_slots, max_pos, init, top_k)

    def step(self, pos: np.ndarray, n: int, want_plan: bool = False) -> StepResult:
        pos = np.asarray(pos, dtype=np.int64)
        if self._warm_pending:
            self._warm_below(max(0, n - 1))
        # Padding: the kernel's TOKEN_HIT sentinel equals -1, so -1 entries are
        # never loaded (with seq_len > H >= K the indexer emits no padding).
        valid = (pos >= 0) & (pos < n)
        if n <= self.C:
            # Fast path: short sequences sit in the buffer in position order.
            res = StepResult(0, int(valid.sum()), 0, int(valid.sum()), pos[:0])
            if want_plan:
                res.rows = np.where(valid, pos, -1)
                res.victims = pos[:0]
            return res
        newest = valid & (pos == n - 1)
        lookup = valid & ~newest
        slot, hit, miss_pos, victims = self._swap(pos[lookup], hits_mru=True)
        res = StepResult(
            misses=int(miss_pos.size),
            lru_hits=int(hit.sum()),
            window_hits=int(newest.sum()),
            valid=int(valid.sum()),
            miss_pos=miss_pos,
        )
        if want_plan:
            rows = np.full(pos.size, -1, dtype=np.int64)
            rows[lookup] = slot
            rows[newest] = self.C
            res.rows, res.victims = rows, victims
        return res


# ----------------------------------------------------------------------- replay


@dataclass
class ReplayResult:
    misses: np.ndarray  # (S, L, B) int64
    lru_hits: np.ndarray
    window_hits: np.ndarray
    valid: np.ndarray
    active: np.ndarray  # (S, B) bool
    steady: np.ndarray  # (S, B) bool: active and past the request's warm-up
    miss_dist: np.ndarray  # (L, len(DIST_LABELS)) misses by distance from newest


def steady_mask(trace: NSATopkTrace, warmup: int) -> np.ndarray:
    """(S, B): request present and at least ``warmup`` of its steps done.

    The first steps of a request fill its empty (cold) working set and cost
    about the same under every policy; the comparison uses the rest.
    """
    active = trace.seq_lens > 0
    done = np.cumsum(active, axis=0) - 1  # steps of the request before this one
    return active & (done >= warmup)


def replay(
    trace: NSATopkTrace,
    make_policy: Callable[[int], _LRUBase],
    on_step: Optional[Callable[[int, int, int, StepResult], None]] = None,
    want_plan: bool = False,
    warmup: int = DEFAULT_WARMUP,
) -> ReplayResult:
    """Replay every (step, layer, request) of ``trace``.

    ``make_policy(max_pos)`` creates the state of one (layer, request) when the
    request first appears (admission).
    """
    S, L, B, _ = trace.topk.shape
    shape = (S, L, B)
    out = {k: np.zeros(shape, dtype=np.int64) for k in ("m", "h", "w", "v")}
    active = trace.seq_lens > 0
    steady = steady_mask(trace, warmup)
    max_pos = trace.seq_lens.max(axis=0)
    states: Dict[Tuple[int, int], _LRUBase] = {}
    miss_dist = np.zeros((L, len(DIST_LABELS)), dtype=np.int64)
    for s in range(S):
        for b in np.nonzero(active[s])[0]:
            n = int(trace.seq_lens[s, b])
            for li in range(L):
                key = (li, int(b))
                if key not in states:
                    states[key] = make_policy(int(max_pos[b]))
                r = states[key].step(trace.topk[s, li, b], n, want_plan=want_plan)
                out["m"][s, li, b] = r.misses
                out["h"][s, li, b] = r.lru_hits
                out["w"][s, li, b] = r.window_hits
                out["v"][s, li, b] = r.valid
                if r.misses:
                    d = n - 1 - r.miss_pos
                    miss_dist[li] += np.bincount(
                        np.searchsorted(DIST_EDGES, d, side="right") - 1,
                        minlength=len(DIST_LABELS),
                    )[: len(DIST_LABELS)]
                if on_step is not None:
                    on_step(s, li, int(b), r)
    return ReplayResult(
        out["m"], out["h"], out["w"], out["v"], active, steady, miss_dist
    )


def summarize(
    res: ReplayResult, trace: NSATopkTrace, row_bytes: int = ROW_BYTES_FP8
) -> Dict:
    """Aggregate statistics; ``steady`` excludes each request's warm-up steps."""
    mask = res.steady[:, None, :]  # (S, 1, B)
    rows_steady = int(mask.sum()) * trace.num_layers
    rows_all = int(res.active.sum()) * trace.num_layers
    m_steady = int((res.misses * mask).sum())
    v_steady = int((res.valid * mask).sum())
    m_all = int(res.misses.sum())
    per_layer = []
    for li, layer in enumerate(trace.layer_ids.tolist()):
        ml = int((res.misses[:, li, :] * res.steady).sum())
        vl = int((res.valid[:, li, :] * res.steady).sum())
        per_layer.append(
            {
                "layer": layer,
                "misses_per_row": ml / max(int(res.steady.sum()), 1),
                "hit_rate": 1 - ml / max(vl, 1),
            }
        )
    per_step = (res.misses * res.active[:, None, :]).sum(axis=(1, 2))
    return {
        "misses_total": m_all,
        "misses_steady": m_steady,
        "misses_per_row": m_steady / max(rows_steady, 1),
        "misses_per_row_all": m_all / max(rows_all, 1),
        "hit_rate": 1 - m_steady / max(v_steady, 1),
        "window_hits_per_row": int((res.window_hits * mask).sum())
        / max(rows_steady, 1),
        "h2d_bytes_total": m_all * row_bytes,
        "h2d_bytes_per_row": m_steady * row_bytes / max(rows_steady, 1),
        "misses_per_step": per_step.tolist(),
        "per_layer": per_layer,
        "miss_distance": {
            lab: int(v) for lab, v in zip(DIST_LABELS, res.miss_dist.sum(axis=0))
        },
    }


def _valid_counts(trace: NSATopkTrace) -> np.ndarray:
    n = trace.seq_lens[:, None, :, None]
    return ((trace.topk >= 0) & (trace.topk < n)).sum(axis=-1).astype(np.int64)


def result_from_misses(
    trace: NSATopkTrace, misses: np.ndarray, warmup: int = DEFAULT_WARMUP
) -> ReplayResult:
    active = trace.seq_lens > 0
    steady = steady_mask(trace, warmup)
    zeros = np.zeros_like(misses)
    dist = np.zeros((trace.num_layers, len(DIST_LABELS)), dtype=np.int64)
    return ReplayResult(
        misses, zeros, zeros, _valid_counts(trace), active, steady, dist
    )


def run_sweep(
    trace: NSATopkTrace,
    budgets: Sequence[int],
    windows: Sequence[int],
    init: str,
    row_bytes: int = ROW_BYTES_FP8,
    window: int = DEFAULT_WINDOW,
    verbose: bool = True,
    warmup: int = DEFAULT_WARMUP,
) -> Dict:
    """Per budget: HiSparse, ours for every W with ``C = budget - W >= K``,
    ours with the misses-most-recent tie rule (what-if, at ``window``) and
    Belady's OPT."""
    K = trace.top_k
    out: Dict = {"hisparse": {}, "ours": {}, "ours_hits_mru": {}, "opt": {}}
    for budget in budgets:
        t0 = time.time()
        if budget - 1 >= K:
            H = budget - 1
            res = replay(
                trace, lambda mp, H=H: HiSparseLRU(H, mp, init, K), warmup=warmup
            )
            out["hisparse"][str(budget)] = {
                "lru_slots": H,
                **summarize(res, trace, row_bytes),
            }
            opt = result_from_misses(trace, belady_misses(trace, budget, init), warmup)
            out["opt"][str(budget)] = summarize(opt, trace, row_bytes)
        if budget - window >= K:
            C = budget - window
            res = replay(
                trace,
                lambda mp, C=C: OursLRU(C, window, mp, init, hits_mru=False, top_k=K),
                warmup=warmup,
            )
            out["ours_hits_mru"][str(budget)] = {
                "lru_slots": C,
                "window": window,
                **summarize(res, trace, row_bytes),
            }
        out["ours"][str(budget)] = {}
        for w in windows:
            C = budget - w
            if C < K:
                continue
            res = replay(
                trace,
                lambda mp, C=C, w=w: OursLRU(C, w, mp, init, top_k=K),
                warmup=warmup,
            )
            out["ours"][str(budget)][str(w)] = {
                "lru_slots": C,
                "window": w,
                **summarize(res, trace, row_bytes),
            }
        if verbose:
            print(f"  budget {budget}: {time.time() - t0:.1f}s", file=sys.stderr)
    return out


def belady_misses(trace: NSATopkTrace, budget: int, init: str = "cold") -> np.ndarray:
    """Misses of Belady's optimal replacement with ``budget`` rows, (S, L, B).

    A lower bound for every demand-loading policy with the same rows (ours at
    any W, HiSparse) that starts from the same state: the newest token
    (``p == seq_len - 1``) has its own row and is free, as in both policies;
    the other ``budget - 1`` rows are fully flexible, all of a step's picks
    must be resident at that step, and the resident not picked now whose next
    pick is furthest away is evicted first. ``init`` as the policies': with
    ``prefix`` positions ``0 .. budget - 2`` start resident (a superset of
    what the policies warm); ``newest`` / ``topk`` the newest ``budget - 1`` /
    top-k positions below the first step's newest token (a superset of the
    policies' below their window); ``cold`` none.
    """
    S, L, B, _ = trace.topk.shape
    slots = budget - 1
    warm = warm_count(init, slots, trace.top_k)
    out = np.zeros((S, L, B), dtype=np.int64)
    never = np.iinfo(np.int32).max
    for b in range(B):
        steps = np.nonzero(trace.seq_lens[:, b] > 0)[0]
        if steps.size == 0:
            continue
        max_pos = int(trace.seq_lens[steps, b].max())
        for li in range(L):
            sets = []
            for s in steps:
                row = trace.topk[s, li, b].astype(np.int64)
                n = int(trace.seq_lens[s, b])
                sets.append(row[(row >= 0) & (row < n - 1)])
            # next_after[i][p]: index (into steps) of p's next pick after step i.
            next_after = np.empty((steps.size, max_pos), dtype=np.int32)
            nxt = np.full(max_pos, never, dtype=np.int32)
            for i in range(steps.size - 1, -1, -1):
                next_after[i] = nxt
                nxt[sets[i]] = i
            resident = np.empty(0, dtype=np.int64)
            first = int(trace.seq_lens[steps[0], b]) - 1
            if init == "prefix":
                resident = np.arange(min(slots, first), dtype=np.int64)
            elif warm:
                resident = np.arange(max(0, first - warm), first, dtype=np.int64)
            for i, s in enumerate(steps):
                cur = sets[i]
                out[s, li, b] = cur.size - np.isin(cur, resident).sum()
                keep = resident[~np.isin(resident, cur)]
                excess = keep.size + cur.size - slots
                if excess > 0:
                    nu = next_after[i][keep]
                    keep = keep[np.argsort(nu, kind="stable")[: keep.size - excess]]
                resident = np.concatenate([keep, cur])
    return out


# ------------------------------------------------------- reference engine check


def find_reference_engine() -> Tuple[Optional[Path], str]:
    """Path of ``lru_cache_state.py``: the installed sglang's, else the repo's."""
    notes = []
    spec = importlib.util.find_spec("sglang")  # locates, does not import
    installed = None
    if spec is not None and spec.submodule_search_locations:
        cand = Path(list(spec.submodule_search_locations)[0])
        installed = cand / "srt" / "mem_cache" / "lru_cache_state.py"
    repo = REPO_ROOT / LRU_CACHE_STATE_REL
    if installed is not None and installed.exists():
        path = installed
        if repo.exists() and _sha(repo) != _sha(installed):
            notes.append(
                "installed copy differs from the repository's "
                f"{LRU_CACHE_STATE_REL} (re-copy it into the venv)"
            )
    elif repo.exists():
        path = repo
        notes.append("not installed in the venv; using the repository copy")
    else:
        return None, "lru_cache_state.py not found (engine not written yet?)"
    return path, "; ".join(notes)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def load_reference_engine(path: Path):
    """The ``lru_cache_state`` module at ``path``, which must be the installed
    sglang's: it is imported as ``sglang.srt.mem_cache.lru_cache_state`` (it
    imports its swap backends from that package). On a CPU machine this needs
    the venv of ``scripts/setup_cpu_env.sh`` (its torchvision fix-up lets
    ``import sglang`` work outside pytest).
    """
    import importlib

    mod = importlib.import_module("sglang.srt.mem_cache.lru_cache_state")
    if Path(mod.__file__).resolve() != Path(path).resolve():
        raise ImportError(
            f"{path} is not the installed sglang's lru_cache_state.py "
            f"({mod.__file__}); install it with scripts/apply_patch.py"
        )
    return mod


def engine_check(
    trace: NSATopkTrace,
    lru_slots: int,
    window: int,
    init: str = "cold",
    engine_path: Optional[Path] = None,
) -> Dict:
    """Replay ``trace`` through ``LRUCacheState(use_triton=False)`` and the model.

    Compares, for every (step, layer, request): miss count, the copy list
    (source loc, destination row, in order) and the page table. Returns a dict
    with ``status`` in ``{"exact", "mismatch", "unavailable"}``.
    """
    if engine_path is None:
        engine_path, note = find_reference_engine()
    else:
        note = ""
    if engine_path is None:
        return {"status": "unavailable", "reason": note}
    try:
        import torch

        mod = load_reference_engine(engine_path)
        cls = mod.LRUCacheState
    except Exception as e:  # noqa: BLE001 -- report any import failure
        return {
            "status": "unavailable",
            "reason": f"cannot import {engine_path}: {type(e).__name__}: {e}",
        }
    S, L, B, K = trace.topk.shape
    C, W = lru_slots, window
    R = C + W
    max_len = trace.seq_lens.max(axis=0).astype(np.int64)
    loc_base = np.concatenate([[0], np.cumsum(max_len)[:-1]])
    # Token locs: request b's positions map to a contiguous range, reversed so
    # that positions and locs differ (catches a position/loc mix-up).
    req_to_token = np.zeros((B, int(max_len.max())), dtype=np.int32)
    for b in range(B):
        req_to_token[b, : max_len[b]] = (
            loc_base[b] + max_len[b] - 1 - np.arange(max_len[b])
        )
    num_locs = int(max_len.sum())
    t0 = time.time()
    try:
        state = cls(
            num_layers=L,
            max_num_reqs=B,
            num_locs=num_locs,
            buffer_size=C,
            recent_window=W,
            top_k=K,
            device="cpu",
            use_triton=False,
        )
    except Exception as e:  # noqa: BLE001
        return {
            "status": "unavailable",
            "reason": f"LRUCacheState(...) failed: {type(e).__name__}: {e}",
        }
    r2t = torch.from_numpy(req_to_token)
    admitted = np.zeros(B, dtype=bool)
    models: Dict[Tuple[int, int], OursLRU] = {}
    mismatches: List[str] = []
    engine_misses = np.zeros((S, L, B), dtype=np.int64)
    model_misses = np.zeros((S, L, B), dtype=np.int64)
    for s in range(S):
        cols = np.nonzero(trace.seq_lens[s] > 0)[0]
        for b in cols:
            if not admitted[b]:
                state.admit_request(int(b), int(b) * R)
                if init == "prefix":
                    m = min(C, int(max_len[b]))
                    state.warm_request(
                        range(L), int(b), torch.from_numpy(req_to_token[b, :m].copy())
                    )
                below = max(0, int(trace.seq_lens[s, b]) - W)
                k = min(warm_count(init, C, trace.top_k), below)
                if k > 0:
                    locs = req_to_token[b, below - k : below].copy()
                    state.warm_request(range(L), int(b), torch.from_numpy(locs))
                admitted[b] = True
        if cols.size == 0:
            continue
        seq = trace.seq_lens[s, cols].astype(np.int64)
        for li in range(L):
            topk = torch.from_numpy(trace.topk[s, li, cols].copy())
            plan = state.swap_layer(
                li,
                topk,
                torch.from_numpy(cols.astype(np.int64)),
                torch.from_numpy(seq),
                r2t,
                torch.tensor([cols.size], dtype=torch.int32),
            )
            pt = plan.page_table.numpy()
            cnt = plan.miss_count.numpy()
            src = plan.miss_src_loc.numpy()
            dst = plan.miss_dst_row.numpy()
            for j, b in enumerate(cols):
                key = (li, int(b))
                if key not in models:
                    models[key] = OursLRU(
                        C, W, int(max_len[b]), init, top_k=trace.top_k
                    )
                r = models[key].step(trace.topk[s, li, b], int(seq[j]), want_plan=True)
                base = int(b) * R
                exp_pt = np.where(r.rows >= 0, base + r.rows, -1)
                exp_src = req_to_token[b, r.miss_pos]
                exp_dst = base + r.victims
                engine_misses[s, li, b] = int(cnt[j])
                model_misses[s, li, b] = r.misses
                n_j = int(cnt[j])
                ok = (
                    n_j == r.misses
                    and np.array_equal(pt[j], exp_pt)
                    and np.array_equal(src[j, :n_j], exp_src)
                    and np.array_equal(dst[j, :n_j], exp_dst)
                )
                if not ok and len(mismatches) < 10:
                    mismatches.append(
                        f"step {s} layer {trace.layer_ids[li]} request {b}: "
                        f"engine misses {n_j}, model {r.misses}, page table "
                        f"{'equal' if np.array_equal(pt[j], exp_pt) else 'differs'}"
                    )
    counters = state.counters.numpy().tolist()
    elapsed = time.time() - t0
    exact = not mismatches and np.array_equal(engine_misses, model_misses)
    return {
        "status": "exact" if exact else "mismatch",
        "engine_path": str(engine_path),
        "note": note,
        "lru_slots": C,
        "window": W,
        "init": init,
        "swaps": int((trace.seq_lens > 0).sum()) * L,
        "engine_misses": int(engine_misses.sum()),
        "model_misses": int(model_misses.sum()),
        "engine_counters_hit_window_miss": counters,
        "mismatches": mismatches,
        "seconds": elapsed,
    }


# ---------------------------------------------------------------------- reports


def p6_rows(sweep: Dict, window: int) -> List[Dict]:
    rows = []
    for budget, hs in sweep["hisparse"].items():
        ours = sweep["ours"].get(budget, {})
        if not ours:
            continue
        best_w, best = min(
            ((int(w), v) for w, v in ours.items() if int(w) > 0),
            key=lambda wv: wv[1]["misses_per_row"],
        )
        default = ours.get(str(window))
        opt = sweep.get("opt", {}).get(budget)
        alt = sweep.get("ours_hits_mru", {}).get(budget)
        hm = hs["misses_per_row"]
        rows.append(
            {
                "opt_misses_per_row": opt["misses_per_row"] if opt else None,
                "opt_ratio": opt["misses_per_row"] / hm if opt and hm else None,
                "ours_hits_mru_misses_per_row": (
                    alt["misses_per_row"] if alt else None
                ),
                "ours_hits_mru_ratio": (
                    alt["misses_per_row"] / hm if alt and hm else None
                ),
                "budget": int(budget),
                "hisparse_lru_slots": hs["lru_slots"],
                "hisparse_misses_per_row": hs["misses_per_row"],
                "hisparse_hit_rate": hs["hit_rate"],
                "ours_window": window if default else None,
                "ours_misses_per_row": default["misses_per_row"] if default else None,
                "ours_hit_rate": default["hit_rate"] if default else None,
                "ratio": (
                    default["misses_per_row"] / hs["misses_per_row"]
                    if default and hs["misses_per_row"]
                    else None
                ),
                "best_window": best_w,
                "best_misses_per_row": best["misses_per_row"],
                "best_ratio": (
                    best["misses_per_row"] / hs["misses_per_row"]
                    if hs["misses_per_row"]
                    else None
                ),
            }
        )
    return rows


def _layers_str(ids: List[int]) -> str:
    if len(ids) > 8 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"[{ids[0]}..{ids[-1]}]"
    return str(ids)


def _f(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


def render_markdown(
    trace: NSATopkTrace,
    sweep: Dict,
    engine: Optional[Dict],
    args_desc: Dict,
    headline_budget: int,
    window: int,
) -> str:
    K = trace.top_k
    rb = args_desc["row_bytes"]
    lines = []
    meta = trace.metadata
    lines.append("# NSA KV offload: offline replay, ours vs HiSparse\n")
    lines.append(
        f"Trace `{args_desc['trace']}`: {meta.get('source', '?')}, "
        f"{trace.num_steps} steps x {trace.num_layers} layers "
        f"{_layers_str(trace.layer_ids.tolist())} x {trace.num_requests} requests, "
        f"K={K}, "
        f"seq_len {int(trace.seq_lens[trace.seq_lens > 0].min())}-"
        f"{int(trace.seq_lens.max())}, top-k order `{meta.get('topk_order', '?')}`. "
        f"Init `{args_desc['init']}`.\n"
    )
    lines.append(
        "Rows are counted per (request, layer): budget B = C + W for ours "
        "(C LRU slots + W recent-window rows) and B = H + 1 for HiSparse (H LRU "
        "slots + its newest-token row; upstream reserves a whole page for that "
        "row, counted here as 1, in HiSparse's favour). Misses = H2D row copies "
        f"({rb} B each). Per-row numbers are per (request, layer, decode step) "
        f"and exclude each request's first {args_desc['warmup']} steps (cold "
        "working set, filled alike by both policies: "
        "see `misses_per_row_all` in the JSON for all steps).\n"
    )
    rows = p6_rows(sweep, window)
    lines.append(
        f"## P6: ours <= {P6_TARGET}x HiSparse's misses at equal buffer size\n"
    )
    lines.append(
        "Misses per (request, layer, step); ratio = / HiSparse at the same B. "
        "OPT = Belady's optimal replacement with the same rows (a lower bound for "
        "any demand-loading policy); alt. tie = ours with misses instead of hits "
        "most recent (the engine's first rule), a what-if, not the engine.\n"
    )
    lines.append(
        f"| budget B | HiSparse H | HiSparse | ours W={window} | ratio | best W "
        "| ours best W | ratio | alt. tie | ratio | OPT | ratio | P6 |"
    )
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--|")
    r3 = "{:.3f}"
    for r in rows:
        verdict = (
            "-"
            if r["ratio"] is None
            else ("met" if r["ratio"] <= P6_TARGET else "not met")
        )
        lines.append(
            f"| {r['budget']} | {r['hisparse_lru_slots']} "
            f"| {_f(r['hisparse_misses_per_row'])} | {_f(r['ours_misses_per_row'])} "
            f"| {_f(r['ratio'], r3)} | {r['best_window']} "
            f"| {_f(r['best_misses_per_row'])} | {_f(r['best_ratio'], r3)} "
            f"| {_f(r['ours_hits_mru_misses_per_row'])} "
            f"| {_f(r['ours_hits_mru_ratio'], r3)} "
            f"| {_f(r['opt_misses_per_row'])} | {_f(r['opt_ratio'], r3)} "
            f"| {verdict} |"
        )
    head = next((r for r in rows if r["budget"] == headline_budget), None)
    if head and head["ratio"] is not None:
        verdict = "MET" if head["ratio"] <= P6_TARGET else "NOT MET"
        lines.append(
            f"\n**P6 at the engine default (B = {headline_budget}: C = "
            f"{headline_budget - window}, W = {window}): ours / HiSparse = "
            f"{head['ratio']:.3f} -> {verdict}** (target <= {P6_TARGET}).\n"
        )
        if head["opt_ratio"] is not None:
            feasible = head["opt_ratio"] <= P6_TARGET
            lines.append(
                f"Belady's OPT with the same {headline_budget} rows reaches "
                f"{head['opt_ratio']:.3f}x HiSparse's misses on this trace: "
                + (
                    "a better replacement policy could in principle meet P6."
                    if feasible
                    else "no demand-loading replacement policy can meet P6 here."
                )
                + "\n"
            )
    # Full grid.
    lines.append("## Ours: misses per (request, layer, step) by budget and window\n")
    windows = sorted({int(w) for v in sweep["ours"].values() for w in v})
    lines.append(
        "| budget B | HiSparse | " + " | ".join(f"W={w}" for w in windows) + " |"
    )
    lines.append("|---:|---:|" + "---:|" * len(windows))
    for budget, ours in sweep["ours"].items():
        hs = sweep["hisparse"].get(budget)
        cells = []
        for w in windows:
            v = ours.get(str(w))
            if v is None:
                cells.append("-")
            elif hs and hs["misses_per_row"]:
                r = v["misses_per_row"] / hs["misses_per_row"]
                cells.append(f"{v['misses_per_row']:.1f} ({r:.2f}x)")
            else:
                cells.append(f"{v['misses_per_row']:.1f}")
        lines.append(
            f"| {budget} | {_f(hs['misses_per_row']) if hs else '-'} | "
            + " | ".join(cells)
            + " |"
        )
    lines.append(
        "\nW=0 is a model point only (the engine needs W >= 1: the newest token "
        "has no host copy yet when it is first attended).\n"
    )
    lines.append("Hit rate (window hits count as hits), same grid:\n")
    lines.append(
        "| budget B | HiSparse | " + " | ".join(f"W={w}" for w in windows) + " |"
    )
    lines.append("|---:|---:|" + "---:|" * len(windows))
    for budget, ours in sweep["ours"].items():
        hs = sweep["hisparse"].get(budget)
        cells = [
            f"{100 * ours[str(w)]['hit_rate']:.1f}%" if str(w) in ours else "-"
            for w in windows
        ]
        lines.append(
            f"| {budget} | {_f(100 * hs['hit_rate'] if hs else None)}% | "
            + " | ".join(cells)
            + " |"
        )
    lines.append("")
    # Hit rate and bytes at the headline budget.
    hb = str(headline_budget)
    if hb in sweep["hisparse"] and str(window) in sweep["ours"].get(hb, {}):
        hs, ours = sweep["hisparse"][hb], sweep["ours"][hb][str(window)]
        L, gbps = trace.num_layers, args_desc["h2d_gbps"]
        lines.append(f"## Headline configuration (B = {headline_budget})\n")
        lines.append(
            f"Per (request, decode step) columns sum over the trace's {L} layers "
            f"(a whole-model figure only for a trace of all layers); copy time at "
            f"{gbps} GB/s (the scattered-row H2D rate measured on an H200, "
            "DESIGN.md).\n"
        )
        lines.append(
            "| policy | misses / (req, layer, step) | hit rate | window/newest hits "
            f"/ (req, layer, step) | H2D MB / (req, step) | copy ms / (req, step) |"
        )
        lines.append("|:--|---:|---:|---:|---:|---:|")
        for name, v in (
            (f"HiSparse (H={hs['lru_slots']})", hs),
            (f"ours (C={ours['lru_slots']}, W={window})", ours),
        ):
            per_step = v["h2d_bytes_per_row"] * L
            lines.append(
                f"| {name} | {v['misses_per_row']:.1f} | {100 * v['hit_rate']:.2f}% "
                f"| {v['window_hits_per_row']:.1f} | {per_step / 1e6:.2f} "
                f"| {per_step / (gbps * 1e9) * 1e3:.3f} |"
            )
        lines.append("\nPer layer (misses / (req, step), steady state):\n")
        lines.append(
            "| layer | HiSparse | ours | ratio | HiSparse hit rate | ours hit rate |"
        )
        lines.append("|---:|---:|---:|---:|---:|---:|")
        for a, b in zip(hs["per_layer"], ours["per_layer"]):
            ratio = (
                b["misses_per_row"] / a["misses_per_row"] if a["misses_per_row"] else 0
            )
            lines.append(
                f"| {a['layer']} | {a['misses_per_row']:.1f} | {b['misses_per_row']:.1f} "
                f"| {ratio:.3f} | {100 * a['hit_rate']:.1f}% | {100 * b['hit_rate']:.1f}% |"
            )
        lines.append(
            "\nMisses by distance from the newest token (whole trace; a miss at "
            f"distance < W is what the recent window removes):\n"
        )
        lines.append("| policy | " + " | ".join(DIST_LABELS) + " |")
        lines.append("|:--|" + "---:|" * len(DIST_LABELS))
        for name, v in (("HiSparse", hs), ("ours", ours)):
            tot = max(sum(v["miss_distance"].values()), 1)
            lines.append(
                f"| {name} | "
                + " | ".join(
                    f"{v['miss_distance'][lab]} ({100 * v['miss_distance'][lab] / tot:.1f}%)"
                    for lab in DIST_LABELS
                )
                + " |"
            )
    lines.append("\n## Exactness of the reference engine\n")
    lines.append(engine_line(engine) + "\n")
    return "\n".join(lines)


def engine_line(engine: Optional[Dict]) -> str:
    if engine is None:
        return "reference engine check: skipped (--no-engine-check)"
    if engine["status"] == "unavailable":
        return f"reference engine check: NOT RUN -- {engine['reason']}"
    head = (
        f"reference engine `LRUCacheState(use_triton=False)` (C={engine['lru_slots']}, "
        f"W={engine['window']}, init {engine['init']}) over {engine['swaps']} "
        f"(layer, request) swaps: engine misses {engine['engine_misses']}, "
        f"model misses {engine['model_misses']}"
    )
    if engine["status"] == "exact":
        line = head + " -> EXACT (miss counts, copy lists and page tables identical)"
    else:
        line = head + " -> MISMATCH: " + "; ".join(engine["mismatches"][:3])
    if engine.get("note"):
        line += f" [{engine['note']}]"
    return line


def write_summary(out_dir: str, md: str, result) -> Path:
    """``summary.md`` and ``summary.json`` in ``out_dir`` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(md)
    with open(out / "summary.json", "w") as f:
        json.dump(result, f, indent=1)
    return out


def make_plots(
    out_dir: Path,
    trace: NSATopkTrace,
    sweep: Dict,
    window: int,
    budget: int,
    args_warmup: int = DEFAULT_WARMUP,
):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return []
    files = []
    budgets = sorted(int(b) for b in sweep["hisparse"])
    windows = sorted({int(w) for v in sweep["ours"].values() for w in v})

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(
        budgets,
        [sweep["hisparse"][str(b)]["misses_per_row"] for b in budgets],
        "k-o",
        label="HiSparse (H = B - 1)",
    )
    for w in windows:
        xs = [b for b in budgets if str(w) in sweep["ours"].get(str(b), {})]
        if not xs:
            continue
        ys = [sweep["ours"][str(b)][str(w)]["misses_per_row"] for b in xs]
        ax.plot(xs, ys, "-s" if w == window else "--.", label=f"ours W={w}", alpha=0.85)
    ax.set_xlabel("GPU rows per (request, layer), B")
    ax.set_ylabel("misses per (request, layer, step)")
    ax.set_title("Misses vs GPU buffer size (steady state)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(out_dir / "misses_vs_budget.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b in budgets:
        ours = sweep["ours"].get(str(b), {})
        ws = sorted(int(w) for w in ours)
        if not ws:
            continue
        hs = sweep["hisparse"][str(b)]["misses_per_row"]
        ax.plot(
            ws, [ours[str(w)]["misses_per_row"] / hs for w in ws], "-o", label=f"B={b}"
        )
    ax.axhline(P6_TARGET, color="r", ls=":", label=f"P6 target {P6_TARGET}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("recent window W (rows)")
    ax.set_ylabel("ours / HiSparse misses at equal B")
    ax.set_title("Effect of the recent window")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(out_dir / "ratio_vs_window.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    hb = str(budget)
    if hb in sweep["hisparse"] and str(window) in sweep["ours"].get(hb, {}):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        rows = trace.num_layers * (trace.seq_lens > 0).sum(axis=1)
        hs = np.array(sweep["hisparse"][hb]["misses_per_step"]) / np.maximum(rows, 1)
        ours = np.array(sweep["ours"][hb][str(window)]["misses_per_step"]) / np.maximum(
            rows, 1
        )
        ax.plot(hs, "k-", label=f"HiSparse (H={budget - 1})")
        ax.plot(ours, "b-", label=f"ours (C={budget - window}, W={window})")
        ax.axvspan(-0.5, args_warmup - 0.5, color="0.9", label="warm-up (excluded)")
        ax.set_ylim(0, None)
        ax.set_xlabel("decode step")
        ax.set_ylabel("misses per (request, layer)")
        ax.set_title(f"Misses per step at B = {budget}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        files.append(out_dir / "misses_per_step.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files


# -------------------------------------------------------------------------- CLI


def _display_path(path: str) -> str:
    p = Path(path).resolve()
    try:
        return str(p.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Offline replay: ours vs HiSparse")
    p.add_argument(
        "--trace", required=True, help="top-k trace file (.npz, trace_format.py)"
    )
    p.add_argument("--out-dir", default=None, help="write summary.md/.json + plots")
    p.add_argument(
        "--budgets",
        default=",".join(map(str, DEFAULT_BUDGETS)),
        help="comma-separated LRU rows per request and layer",
    )
    p.add_argument(
        "--windows",
        default=",".join(map(str, DEFAULT_WINDOWS)),
        help="comma-separated recent-window sizes",
    )
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="ours' W for P6")
    p.add_argument(
        "--headline-budget",
        type=int,
        default=None,
        help="budget of the P6 verdict (default 2*K + W, the engine default)",
    )
    p.add_argument(
        "--init",
        choices=list(INITS),
        default="cold",
        help="LRU state at the first decode step: cold; prefix (positions 0 .. "
        "C - 1); newest (every slot, the newest positions below the window); "
        "topk (the newest top-k of them: the server's admission)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        help="steps per request left out of the steady-state figures",
    )
    p.add_argument(
        "--row-bytes",
        type=int,
        default=ROW_BYTES_FP8,
        help="bytes of one KV row (656: fp8 FlashMLA layout)",
    )
    p.add_argument(
        "--h2d-gbps",
        type=float,
        default=43.6,
        help="H2D rate for the copy-time column (H200 scattered rows, DESIGN.md)",
    )
    p.add_argument(
        "--no-engine-check",
        action="store_true",
        help="skip the reference engine's exactness check",
    )
    p.add_argument(
        "--engine-path",
        default=None,
        help="lru_cache_state.py to check (default: the installed sglang's, "
        "else the repository's)",
    )
    p.add_argument("--no-plots", action="store_true", help="do not write PNGs")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> Dict:
    t0 = time.time()
    trace = load_trace(args.trace)
    K = trace.top_k
    headline = args.headline_budget or 2 * K + args.window
    budgets = sorted(set(_ints(args.budgets)) | {headline})
    windows = sorted(set(_ints(args.windows)) | {args.window})
    print(
        f"replaying {args.trace}: {trace.num_steps} steps x {trace.num_layers} layers "
        f"x {trace.num_requests} requests, K={K}",
        file=sys.stderr,
    )
    sweep = run_sweep(
        trace,
        budgets,
        windows,
        args.init,
        args.row_bytes,
        window=args.window,
        warmup=args.warmup,
    )
    engine = None
    if not args.no_engine_check:
        engine = engine_check(
            trace,
            headline - args.window,
            args.window,
            args.init,
            engine_path=Path(args.engine_path) if args.engine_path else None,
        )
    desc = {
        "trace": _display_path(args.trace),
        "init": args.init,
        "row_bytes": args.row_bytes,
        "h2d_gbps": args.h2d_gbps,
        "warmup": args.warmup,
    }
    md = render_markdown(trace, sweep, engine, desc, headline, args.window)
    rows = p6_rows(sweep, args.window)
    head = next((r for r in rows if r["budget"] == headline), None)
    result = {
        "trace": desc["trace"],
        "trace_metadata": {
            k: v for k, v in trace.metadata.items() if k not in ("calibration",)
        },
        "init": args.init,
        "warmup": args.warmup,
        "row_bytes": args.row_bytes,
        "headline_budget": headline,
        "window": args.window,
        "p6_target": P6_TARGET,
        "p6": rows,
        "p6_met_at_headline": (
            None
            if head is None or head["ratio"] is None
            else head["ratio"] <= P6_TARGET
        ),
        "engine_check": engine,
        "sweep": sweep,
        "seconds": time.time() - t0,
    }
    if args.out_dir:
        out = write_summary(args.out_dir, md, result)
        if not args.no_plots:
            for p in make_plots(out, trace, sweep, args.window, headline, args.warmup):
                print(f"wrote {p}", file=sys.stderr)
        print(f"wrote {out / 'summary.md'} and summary.json", file=sys.stderr)
    result["markdown"] = md
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    res = run(parse_args(argv))
    print(res["markdown"])
    print(f"({res['seconds']:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
