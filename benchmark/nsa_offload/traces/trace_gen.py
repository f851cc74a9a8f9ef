"""Synthetic DeepSeek-V3.2 (DSA) decode top-k traces, calibrated to published statistics.

The lightning indexer of DeepSeek Sparse Attention picks, at every decode step and
in every layer, the top-k (2048) tokens of the request. Offloading the MLA KV to
host memory and keeping a per-request working set on the GPU pays one host->GPU
row copy per pick that is not resident, so the locality of these picks decides
the copy volume. This generator produces traces (``trace_format.py``) whose
locality matches what has been published for DSA models:

* consecutive-step top-2048 overlap ~= 44% in layers 20-60 and ~= 1.5% in layers
  0-1 (NVIDIA, DeepSeek-V3.2, one 68K-token SWE-bench prompt);
* adjacent layers share most of their top-k (IndexCache: 70-100% on a DSA model);
* attention sinks (the first tokens are picked nearly always) and recency (the
  newest tokens are picked often).

Model. For request r, layer l and decode step t (sequence length
``n_t = prompt_len + 1 + t``) every position p gets a score and the top-k scores
are picked::

    score(p) = x_l,t(p) + sink_boost * [p < num_sinks]
                        + recency_amp_l * exp(-(n_t - 1 - p) / recency_tau)
                        - refractory_l * [p picked at t-1, p >= num_sinks]

``x_l,t`` is a standard-normal latent with a static and an AR(1) part::

    x_l,t = sqrt(h_l) * S_l + sqrt(1 - h_l) * D_l,t
    D_l,t = a_l * D_l,(t-1) + sqrt(1 - a_l^2) * e_l,t

``S_l`` is static (long-memory importance: picks that come back after many
steps), ``D_l`` short-memory. The lag-1 correlation ``rho_l = h_l + (1 - h_l) a_l``
of every layer is calibrated to its consecutive-step overlap target;
``--long-memory`` (lambda) splits it between the two parts (``h_l = lambda *
rho_l``), which sets how fast reuse decays with the lag (no published number
pins this down: see README.md, "Sensitivity"). Adjacent layers share their
randomness: ``S_l = k S_(l-1) + sqrt(1 - k^2) S'_l`` and
``e_l,t = k e_(l-1),t + sqrt(1 - k^2) e'_l,t``, with ``k`` calibrated to the
adjacent-layer overlap target. Each layer keeps exactly its own temporal
statistics whatever its neighbours' (a layer that merely mixed in its
predecessor's latent would inherit its predecessor's temporal correlation).
Overlap targets below the chance level ``K / n`` (layers 0-1 at 16K-32K
context) are reached with the refractory term: tokens picked at t-1 are
penalised at t (no lag-2 periodicity, unlike a negative AR coefficient).

Calibration is numeric: per request (its context length) the overlap of two
consecutive steps is measured as a function of the knob on a grid with common
random numbers, then inverted. The generated trace is then measured and the
achieved statistics are printed and stored in the metadata, so the calibration
is shown, not assumed.

Examples (from the repository root)::

    # Embedded default trace of the CPU demo (see README.md for the exact command)
    python benchmark/nsa_offload/traces/trace_gen.py --out /tmp/t.npz --requests 4 \\
        --prompt-lens 16384,32768 --steps 64 --layers 0,20,21,40

    # Calibration check against the published setup: 61 layers, one 68K prompt
    python benchmark/nsa_offload/traces/trace_gen.py --requests 1 --prompt-lens 68000 \\
        --steps 32 --out /tmp/calib_68k.npz
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trace_format import NSATopkTrace, save_trace  # noqa: E402

# Published locality of DeepSeek-V3.2 / DSA (see README.md, "Sources").
DEFAULT_STEP_OVERLAP = "0-1:0.015,2-19:0.10~0.44,20-60:0.44"
DEFAULT_ADJACENT_OVERLAP = "3-60:0.80"
DEFAULT_RECENCY_AMP = "0-1:0,2-60:4.0"
DSV32_NUM_LAYERS = 61
DSV32_TOP_K = 2048

# Largest lag-1 latent correlation (keeps the AR(1) innovation non-degenerate).
RHO_MAX = 0.9999
# Strength of the refractory penalty at knob u = -1 (in latent standard deviations).
REFRACTORY_MAX = 8.0
# Recency boost is negligible beyond this many time constants.
RECENCY_CUTOFF_TAUS = 12.0
# Distance buckets (from the newest token) of the recency statistics.
RECENCY_BUCKETS = ((0, 1), (1, 16), (16, 64), (64, 256), (256, 1024))
# Lags of the reuse statistics.
LAGS = (1, 2, 4, 8, 16)


def parse_layer_spec(
    spec: Optional[str], num_layers: int, what: str
) -> List[Optional[float]]:
    """Parse ``"0-1:0.015,2-19:0.10~0.44,20-60:0.44"`` into one value per layer.

    Each item is ``first[-last]:value`` or ``first-last:start~end`` (linear ramp).
    Layers not covered get ``None``; later items override earlier ones.
    """
    out: List[Optional[float]] = [None] * num_layers
    if not spec:
        return out
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            rng_s, val_s = item.split(":")
            first_s, _, last_s = rng_s.partition("-")
            first = int(first_s)
            last = int(last_s) if last_s else first
            if "~" in val_s:
                a, b = (float(v) for v in val_s.split("~"))
            else:
                a = b = float(val_s)
        except ValueError as e:
            raise ValueError(f"bad {what} spec item {item!r}: {e}") from None
        for layer in range(max(first, 0), min(last, num_layers - 1) + 1):
            frac = 0.0 if last == first else (layer - first) / (last - first)
            out[layer] = a + (b - a) * frac
    return out


@dataclass
class GeneratorConfig:
    num_model_layers: int = DSV32_NUM_LAYERS
    layers: Optional[List[int]] = None  # model layer ids to generate; None = all
    num_requests: int = 4
    prompt_lens: List[int] = field(default_factory=lambda: [16384, 32768])
    num_steps: int = 64
    top_k: int = DSV32_TOP_K
    seed: int = 0
    step_overlap: str = DEFAULT_STEP_OVERLAP
    adjacent_overlap: str = DEFAULT_ADJACENT_OVERLAP
    recency_amp: str = DEFAULT_RECENCY_AMP
    recency_tau: float = 64.0
    num_sinks: int = 4
    sink_boost: float = 6.0
    long_memory: float = 0.5
    order: str = "ascending"  # "ascending" position or descending "score"
    calib_reps: int = 8

    def layer_ids(self) -> List[int]:
        if self.layers is None:
            return list(range(self.num_model_layers))
        return sorted(set(int(x) for x in self.layers))

    def request_prompt_lens(self) -> List[int]:
        lens = list(self.prompt_lens)
        if len(lens) == self.num_requests:
            return [int(x) for x in lens]
        lo, hi = min(lens), max(lens)
        if self.num_requests == 1:
            return [int(lo)]
        return [int(round(v)) for v in np.linspace(lo, hi, self.num_requests)]


# --------------------------------------------------------------------- scoring


def _bias(n: int, cfg: GeneratorConfig, recency_amp: float) -> np.ndarray:
    bias = np.zeros(n, dtype=np.float32)
    bias[: min(cfg.num_sinks, n)] += cfg.sink_boost
    if recency_amp > 0:
        m = min(n, int(RECENCY_CUTOFF_TAUS * cfg.recency_tau) + 1)
        d = np.arange(m - 1, -1, -1, dtype=np.float32)  # distance from the newest
        bias[n - m :] += recency_amp * np.exp(-d / cfg.recency_tau)
    return bias


def _top_k(score: np.ndarray, k: int) -> np.ndarray:
    n = score.size
    if n <= k:
        return np.arange(n)
    return np.argpartition(score, n - k)[n - k :]


def _overlap(a: np.ndarray, b: np.ndarray, k: int) -> float:
    return np.intersect1d(a, b, assume_unique=True).size / k


def _knob_to_rho_refractory(u: float) -> Tuple[float, float]:
    """Calibration knob -> (lag-1 latent correlation, refractory penalty)."""
    if u >= 0:
        return min(u, RHO_MAX), 0.0
    return 0.0, -u * REFRACTORY_MAX


# ------------------------------------------------------------------ calibration


def _isotonic(y: np.ndarray) -> np.ndarray:
    """Least-squares non-decreasing fit (pool adjacent violators).

    Unlike a running maximum it does not bias a noisy curve upwards.
    """
    blocks: List[List[float]] = []  # [mean, weight]
    for v in y.tolist():
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return np.concatenate([np.full(int(w), m) for m, w in blocks])


@dataclass
class Curve:
    knob: np.ndarray
    value: np.ndarray  # monotone non-decreasing in knob

    def invert(self, target: float) -> Tuple[float, bool]:
        """Knob reaching ``target`` (clamped); second item: target reachable."""
        lo, hi = self.value[0], self.value[-1]
        ok = lo - 1e-3 <= target <= hi + 1e-3
        t = min(max(target, lo), hi)
        # np.interp needs strictly increasing x; break ties by position.
        x = self.value + np.arange(self.value.size) * 1e-12
        return float(np.interp(t, x, self.knob)), ok


def _step_overlap_curve(
    cfg: GeneratorConfig, n: int, recency_amp: float, rng: np.random.Generator
) -> Curve:
    """Consecutive-step overlap as a function of the knob u in [-1, 1)."""
    # Denser where the overlap rises steeply (rho -> 1).
    rhos = 1.0 - np.logspace(0, -3, 81)
    knobs = np.concatenate([np.linspace(-1.0, 0.0, 41)[:-1], rhos])
    k = cfg.top_k
    b0, b1 = _bias(n, cfg, recency_amp), _bias(n + 1, cfg, recency_amp)
    vals = np.zeros(knobs.size)
    for _ in range(cfg.calib_reps):
        x0 = rng.standard_normal(n + 1, dtype=np.float32)
        eps = rng.standard_normal(n + 1, dtype=np.float32)
        s0 = _top_k(x0[:n] + b0, k)
        s0_pen = s0[s0 >= cfg.num_sinks]
        for i, u in enumerate(knobs):
            rho, pen = _knob_to_rho_refractory(u)
            x1 = rho * x0 + math.sqrt(1 - rho * rho) * eps
            sc = x1 + b1
            if pen:
                sc[s0_pen] -= pen
            vals[i] += _overlap(s0, _top_k(sc, k), k)
    return Curve(knobs, _isotonic(vals / cfg.calib_reps))


def _adjacent_overlap_curve(
    cfg: GeneratorConfig, n: int, recency_amp: float, rng: np.random.Generator
) -> Curve:
    """Same-step overlap of two layers as a function of their latent correlation."""
    knobs = np.concatenate([[0.0], 1.0 - np.logspace(0, -4, 49)[1:]])
    k = cfg.top_k
    b = _bias(n, cfg, recency_amp)
    vals = np.zeros(knobs.size)
    for _ in range(cfg.calib_reps):
        xa = rng.standard_normal(n, dtype=np.float32)
        eps = rng.standard_normal(n, dtype=np.float32)
        sa = _top_k(xa + b, k)
        for i, kap in enumerate(knobs):
            xb = kap * xa + math.sqrt(1 - kap * kap) * eps
            vals[i] += _overlap(sa, _top_k(xb + b, k), k)
    return Curve(knobs, _isotonic(vals / cfg.calib_reps))


@dataclass
class LayerParams:
    layer: int
    chained: bool  # shares randomness with the previous model layer
    kappa: float  # correlation of the shared static part and innovations
    kappa_x: float  # resulting same-step latent correlation with layer - 1
    rho: float  # lag-1 latent correlation
    static_share: float  # h
    ar_coef: float  # a
    refractory: float
    recency_amp: float
    notes: List[str] = field(default_factory=list)


def _latent_cross_corr(p: "LayerParams", q: "LayerParams") -> float:
    """Same-step latent correlation of layers p, q per unit ``kappa``."""
    g = math.sqrt((1 - p.ar_coef**2) * (1 - q.ar_coef**2)) / (1 - p.ar_coef * q.ar_coef)
    hp, hq = p.static_share, q.static_share
    return math.sqrt(hp * hq) + math.sqrt((1 - hp) * (1 - hq)) * g


def calibrate_request(
    cfg: GeneratorConfig, prompt_len: int, rng: np.random.Generator
) -> List[LayerParams]:
    """Per-layer model parameters of one request (depends on its context length)."""
    layer_ids = cfg.layer_ids()
    n_ref = prompt_len + 1 + cfg.num_steps // 2
    step_t = parse_layer_spec(cfg.step_overlap, cfg.num_model_layers, "step-overlap")
    adj_t = parse_layer_spec(
        cfg.adjacent_overlap, cfg.num_model_layers, "adjacent-overlap"
    )
    amp = parse_layer_spec(cfg.recency_amp, cfg.num_model_layers, "recency-amp")
    step_curves: Dict[float, Curve] = {}
    adj_curves: Dict[float, Curve] = {}
    params: List[LayerParams] = []
    prev: Optional[LayerParams] = None
    for layer in layer_ids:
        a_l = amp[layer] or 0.0
        notes = []
        target = step_t[layer]
        if target is None:
            raise ValueError(f"no step-overlap target for layer {layer}")
        if a_l not in step_curves:
            step_curves[a_l] = _step_overlap_curve(cfg, n_ref, a_l, rng)
        u, ok = step_curves[a_l].invert(target)
        if not ok:
            notes.append(f"step-overlap target {target:.3f} out of reach")
        rho, refractory = _knob_to_rho_refractory(u)
        h = cfg.long_memory * rho
        a = (rho - h) / (1 - h) if h < 1 else 0.0
        p = LayerParams(layer, False, 0.0, 0.0, rho, h, a, refractory, a_l, notes)
        if prev is not None and prev.layer == layer - 1 and adj_t[layer] is not None:
            if a_l != prev.recency_amp:
                notes.append("adjacent target across a recency change: approximate")
            if a_l not in adj_curves:
                adj_curves[a_l] = _adjacent_overlap_curve(cfg, n_ref, a_l, rng)
            kappa_x, ok = adj_curves[a_l].invert(adj_t[layer])
            if not ok:
                notes.append(f"adjacent target {adj_t[layer]:.3f} out of reach")
            per_unit = _latent_cross_corr(p, prev)
            kappa = kappa_x / per_unit if per_unit > 0 else 1.0
            if kappa > 1.0:
                notes.append(
                    f"adjacent latent correlation capped at {per_unit:.3f} "
                    f"(target {kappa_x:.3f}): temporal parameters differ"
                )
                kappa = 1.0
            p.chained, p.kappa, p.kappa_x = True, kappa, kappa * per_unit
        params.append(p)
        prev = p
    return params


# ------------------------------------------------------------------- generation


def generate(cfg: GeneratorConfig, verbose: bool = True) -> Tuple[NSATopkTrace, Dict]:
    """Generate a trace; returns it with the per-request model parameters."""
    layer_ids = cfg.layer_ids()
    prompt_lens = cfg.request_prompt_lens()
    T, K, L, B = cfg.num_steps, cfg.top_k, len(layer_ids), cfg.num_requests
    topk = np.full((T, L, B, K), -1, dtype=np.int32)
    seq_lens = np.zeros((T, B), dtype=np.int32)
    seeds = np.random.SeedSequence(cfg.seed).spawn(2 * B)
    all_params = []
    for r, prompt_len in enumerate(prompt_lens):
        t0 = time.time()
        params = calibrate_request(cfg, prompt_len, np.random.default_rng(seeds[2 * r]))
        all_params.append([asdict(p) for p in params])
        rng = np.random.default_rng(seeds[2 * r + 1])
        n_max = prompt_len + T
        seq_lens[:, r] = prompt_len + 1 + np.arange(T)
        # Randomness of the previous model layer, shared with a chained layer.
        prev_static = prev_d0 = prev_innov = None
        for li, p in enumerate(params):
            k = p.kappa if p.chained else 0.0
            kc = math.sqrt(1 - k * k)

            def mix(shared, k=k, kc=kc):
                fresh = rng.standard_normal(n_max, dtype=np.float32)
                return fresh if k == 0 else k * shared + kc * fresh

            static = mix(prev_static)
            # Stationary start: D_l,0 correlates with D_(l-1),0 like the
            # stationary processes driven by the shared innovations.
            if k:
                q = params[li - 1]
                c0 = (
                    k
                    * math.sqrt((1 - p.ar_coef**2) * (1 - q.ar_coef**2))
                    / (1 - p.ar_coef * q.ar_coef)
                )
                d0 = c0 * prev_d0 + math.sqrt(1 - c0 * c0) * rng.standard_normal(
                    n_max, dtype=np.float32
                )
            else:
                d0 = rng.standard_normal(n_max, dtype=np.float32)
            innov = np.zeros((T, n_max), dtype=np.float32)
            sh, sd = math.sqrt(p.static_share), math.sqrt(1 - p.static_share)
            ic = math.sqrt(1 - p.ar_coef**2)
            dyn = d0.copy()
            prev_sel = None
            for t in range(T):
                if t:
                    innov[t] = mix(None if prev_innov is None else prev_innov[t])
                    dyn *= p.ar_coef
                    dyn += ic * innov[t]
                x = sh * static + sd * dyn
                n = int(seq_lens[t, r])
                score = x[:n] + _bias(n, cfg, p.recency_amp)
                if p.refractory and prev_sel is not None:
                    score[prev_sel[prev_sel >= cfg.num_sinks]] -= p.refractory
                sel = _top_k(score, K)
                prev_sel = sel
                if cfg.order == "score":
                    sel = sel[np.argsort(-score[sel], kind="stable")]
                else:
                    sel = np.sort(sel)
                topk[t, li, r, : sel.size] = sel
            prev_static, prev_d0, prev_innov = static, d0, innov
        if verbose:
            print(
                f"  request {r}: prompt {prompt_len}, {L} layers x {T} steps "
                f"in {time.time() - t0:.1f}s",
                file=sys.stderr,
            )
    trace = NSATopkTrace(
        topk=topk,
        seq_lens=seq_lens,
        layer_ids=layer_ids,
        request_ids=[f"synthetic-{r}" for r in range(B)],
    )
    return trace, {"per_request": all_params, "prompt_lens": prompt_lens}


# ------------------------------------------------------------------ measurement


def _rows_sets(trace: NSATopkTrace, s: int, li: int, b: int) -> np.ndarray:
    row = trace.topk[s, li, b]
    return row[row >= 0]


def measure_trace(trace: NSATopkTrace, num_sinks: int = 4) -> Dict:
    """Locality statistics of a trace (any source), per layer."""
    S, L, B, K = trace.topk.shape
    layer_ids = trace.layer_ids.tolist()
    per_layer = []
    for li, layer in enumerate(layer_ids):
        lag_vals: Dict[int, List[float]] = {lag: [] for lag in LAGS}
        sink_hits = np.zeros(num_sinks)
        rec_hits = np.zeros(len(RECENCY_BUCKETS))
        rows = 0
        chance = []
        for b in range(B):
            steps = [s for s in range(S) if trace.seq_lens[s, b] > 0]
            sets = {s: _rows_sets(trace, s, li, b) for s in steps}
            for s in steps:
                sel, n = sets[s], int(trace.seq_lens[s, b])
                rows += 1
                chance.append(min(K, n) / n)
                sink_hits += np.isin(np.arange(num_sinks), sel)
                d = n - 1 - sel
                for j, (lo, hi) in enumerate(RECENCY_BUCKETS):
                    rec_hits[j] += ((d >= lo) & (d < hi)).sum() / (hi - lo)
                for lag in LAGS:
                    if s - lag in sets:
                        lag_vals[lag].append(_overlap(sets[s - lag], sel, K))
        entry = {
            "layer": layer,
            "step_overlap": float(np.mean(lag_vals[1])) if lag_vals[1] else None,
            "step_overlap_std": float(np.std(lag_vals[1])) if lag_vals[1] else None,
            "lag_overlap": {
                str(lag): float(np.mean(v)) if v else None
                for lag, v in lag_vals.items()
            },
            "chance_overlap": float(np.mean(chance)) if chance else None,
            "sink_pick_rate": (sink_hits / max(rows, 1)).tolist(),
            "recency_pick_rate": {
                f"{lo}-{hi - 1}": float(v / max(rows, 1))
                for (lo, hi), v in zip(RECENCY_BUCKETS, rec_hits)
            },
        }
        if li > 0 and layer_ids[li - 1] == layer - 1:
            vals = [
                _overlap(
                    _rows_sets(trace, s, li - 1, b), _rows_sets(trace, s, li, b), K
                )
                for b in range(B)
                for s in range(S)
                if trace.seq_lens[s, b] > 0
            ]
            entry["adjacent_overlap"] = float(np.mean(vals))
        else:
            entry["adjacent_overlap"] = None
        per_layer.append(entry)
    return {"per_layer": per_layer}


def calibration_report(cfg: GeneratorConfig, stats: Dict) -> Dict:
    step_t = parse_layer_spec(cfg.step_overlap, cfg.num_model_layers, "step-overlap")
    adj_t = parse_layer_spec(
        cfg.adjacent_overlap, cfg.num_model_layers, "adjacent-overlap"
    )
    rows = []
    for e in stats["per_layer"]:
        layer = e["layer"]
        rows.append(
            {
                **e,
                "step_overlap_target": step_t[layer],
                "adjacent_overlap_target": (
                    adj_t[layer] if e["adjacent_overlap"] is not None else None
                ),
            }
        )
    return {"per_layer": rows}


def _fmt(v: Optional[float], pct: bool = True) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if pct else f"{v:.2f}"


def format_calibration_table(report: Dict) -> str:
    head = (
        "| layer | step overlap target | achieved (std) | adjacent target | achieved "
        "| lag-2 | lag-8 | chance K/n | sink pick | newest pick | d<64 pick rate |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for e in report["per_layer"]:
        rec = e["recency_pick_rate"]
        near = (rec["1-15"] * 15 + rec["16-63"] * 48 + rec["0-0"]) / 64
        lines.append(
            f"| {e['layer']} | {_fmt(e['step_overlap_target'])} "
            f"| {_fmt(e['step_overlap'])} ({_fmt(e['step_overlap_std'])}) "
            f"| {_fmt(e['adjacent_overlap_target'])} | {_fmt(e['adjacent_overlap'])} "
            f"| {_fmt(e['lag_overlap']['2'])} | {_fmt(e['lag_overlap']['8'])} "
            f"| {_fmt(e['chance_overlap'])} | {_fmt(float(np.mean(e['sink_pick_rate'])))} "
            f"| {_fmt(rec['0-0'])} | {_fmt(near)} |"
        )
    return "\n".join(lines)


def check_calibration(report: Dict, tol_step: float, tol_adj: float) -> List[str]:
    """Layers whose achieved overlaps miss their targets by more than the tolerance."""
    bad = []
    for e in report["per_layer"]:
        t, v = e["step_overlap_target"], e["step_overlap"]
        if t is not None and v is not None and abs(v - t) > tol_step:
            bad.append(f"layer {e['layer']}: step overlap {v:.4f} vs target {t:.4f}")
        t, v = e["adjacent_overlap_target"], e["adjacent_overlap"]
        if t is not None and v is not None and abs(v - t) > tol_adj:
            bad.append(
                f"layer {e['layer']}: adjacent overlap {v:.4f} vs target {t:.4f}"
            )
    return bad


# -------------------------------------------------------------------------- CLI


def build_trace(cfg: GeneratorConfig, command: str, verbose: bool = True):
    trace, model = generate(cfg, verbose=verbose)
    report = calibration_report(cfg, measure_trace(trace, cfg.num_sinks))
    trace.metadata = {
        "source": "synthetic",
        "model": "deepseek-ai/DeepSeek-V3.2 (imitated)",
        "num_model_layers": cfg.num_model_layers,
        "top_k": cfg.top_k,
        "topk_order": "ascending_position" if cfg.order == "ascending" else "score",
        "command": command,
        "generator": {"name": "trace_gen.py", "config": asdict(cfg), **model},
        "calibration": report,
    }
    return trace, report


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output .npz trace")
    p.add_argument(
        "--num-model-layers",
        type=int,
        default=DSV32_NUM_LAYERS,
        help="layers of the model the trace stands for",
    )
    p.add_argument(
        "--layers", default=None, help="comma list of model layer ids (default all)"
    )
    p.add_argument("--requests", type=int, default=4, help="requests in the trace")
    p.add_argument(
        "--prompt-lens",
        default="16384,32768",
        help="one value per request, or min,max spread evenly over the requests",
    )
    p.add_argument("--steps", type=int, default=64, help="decode steps")
    p.add_argument(
        "--top-k", type=int, default=DSV32_TOP_K, help="indexer top-k width K"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument(
        "--step-overlap",
        default=DEFAULT_STEP_OVERLAP,
        help="share of a layer's top-k kept from the previous step (one value, or per-layer list)",
    )
    p.add_argument(
        "--adjacent-overlap",
        default=DEFAULT_ADJACENT_OVERLAP,
        help="share of a layer's top-k shared with the layer before (one value, or list)",
    )
    p.add_argument(
        "--recency-amp",
        default=DEFAULT_RECENCY_AMP,
        help="score boost of the newest tokens (one value, or list)",
    )
    p.add_argument(
        "--recency-tau",
        type=float,
        default=64.0,
        help="decay (tokens) of the recency boost",
    )
    p.add_argument(
        "--num-sinks", type=int, default=4, help="attention-sink tokens at the start"
    )
    p.add_argument(
        "--sink-boost", type=float, default=6.0, help="score boost of the sink tokens"
    )
    p.add_argument(
        "--long-memory",
        type=float,
        default=0.5,
        help="share of the lag-1 correlation that never decays (0 = pure AR(1))",
    )
    p.add_argument(
        "--order",
        choices=["ascending", "score"],
        default="ascending",
        help="entry order of a trace row: ascending positions or by score",
    )
    p.add_argument(
        "--calib-reps", type=int, default=8, help="repetitions of the calibration runs"
    )
    p.add_argument(
        "--encoding",
        default="auto",
        choices=["auto", "dense", "sorted_delta"],
        help="file encoding of the top-k (auto picks the smaller)",
    )
    p.add_argument(
        "--report-json", default=None, help="also write the metadata (JSON) here"
    )
    p.add_argument(
        "--report-md", default=None, help="also write the calibration table here"
    )
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> GeneratorConfig:
    return GeneratorConfig(
        num_model_layers=args.num_model_layers,
        layers=(
            None if args.layers is None else [int(x) for x in args.layers.split(",")]
        ),
        num_requests=args.requests,
        prompt_lens=[int(x) for x in args.prompt_lens.split(",")],
        num_steps=args.steps,
        top_k=args.top_k,
        seed=args.seed,
        step_overlap=args.step_overlap,
        adjacent_overlap=args.adjacent_overlap,
        recency_amp=args.recency_amp,
        recency_tau=args.recency_tau,
        num_sinks=args.num_sinks,
        sink_boost=args.sink_boost,
        long_memory=args.long_memory,
        order=args.order,
        calib_reps=args.calib_reps,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    cfg = config_from_args(args)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    command = "python benchmark/nsa_offload/traces/trace_gen.py " + shlex.join(
        argv_list
    )
    t0 = time.time()
    trace, report = build_trace(cfg, command)
    encoding = save_trace(args.out, trace, encoding=args.encoding)
    size = os.path.getsize(args.out)
    print(
        f"wrote {args.out}: {trace.num_steps} steps x {trace.num_layers} layers x "
        f"{trace.num_requests} requests, K={trace.top_k}, encoding {encoding}, "
        f"{size / 1e6:.2f} MB, {time.time() - t0:.1f}s"
    )
    print("\nAchieved locality (measured on the generated trace):\n")
    print(format_calibration_table(report))
    for r, params in enumerate(trace.metadata["generator"]["per_request"]):
        for p in params:
            for note in p["notes"]:
                print(f"note: request {r} layer {p['layer']}: {note}")
    if args.report_md:
        with open(args.report_md, "w") as f:
            f.write(
                f"# Calibration of `{os.path.basename(args.out)}`\n\n"
                f"Command: `{command}`\n\n"
                f"{trace.num_steps} steps x {trace.num_layers} layers x "
                f"{trace.num_requests} requests, K={trace.top_k}, prompt lengths "
                f"{trace.metadata['generator']['prompt_lens']}. Measured on the "
                "generated trace (mean over requests and steps; std in "
                "parentheses).\n\n" + format_calibration_table(report) + "\n"
            )
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump(trace.metadata, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
