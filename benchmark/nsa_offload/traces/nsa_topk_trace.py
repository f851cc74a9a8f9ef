"""Benchmark-only tools on the NSA decode top-k: trace override and recorder.

Benchmark tooling, not part of the product: ``scripts/apply_patch.py
--with-bench-hooks`` installs this file as
``sglang/srt/layers/attention/nsa_topk_trace.py`` and applies
``benchmark/nsa_offload/traces/bench_hooks/<version>/``, so that the model's MLA forward
(``forward_mla.py``) calls :func:`apply_decode_topk_hooks` on each decode
layer's top-k of every server (no offload, HiSparse, decode NSA KV offload),
and :func:`apply_verify_topk_hooks` on the other forwards' (MTP verify rows;
the rest pass through), right after the indexer, before the offload's early
swap may take it. Without that option neither the module nor the calls are
installed. Both tools are off unless their environment variable is set; then
the hook returns its input tensor object unchanged.

Override (``SGLANG_NSA_TOPK_TRACE_OVERRIDE=/path/trace.npz``)
    Replaces the indexer's decode top-k positions with positions taken from a
    top-k trace (``benchmark/nsa_offload/traces/trace_format.py``, e.g. written by
    ``trace_gen.py``), so that servers with dummy weights see DeepSeek-V3.2-like
    locality. Needs positional top-k on every server: HiSparse and the offload
    force it; the server without offload needs ``SGLANG_DSA_FUSE_TOPK=0``.
    For batch row ``b`` with sequence length ``n`` (counting the token being
    decoded) and request pool index ``r``:

    * rows with ``n <= K`` (the indexer then picks every position) and
      CUDA-graph padding rows (``n = 1``) keep the indexer's own row;
    * trace request: the trace's requests are grouped by their first decode
      length ``m0`` (``seq_lens`` at their first step). The row uses the group
      with the largest ``m0 <= n`` (the shortest group if none), and inside it
      request number ``r mod group size``;
    * trace step: ``j = (n - m0) mod S_c`` over the ``S_c`` steps where that
      trace request is present. With a trace generated at the benchmark's
      prompt lengths, the live step ``t`` reads trace step ``t mod S_c`` whose
      sequence length ``m`` equals ``n - S_c * floor(t / S_c)``;
    * trace layer: model layer ``i`` of ``L`` reads the trace layer whose
      model-layer id is nearest to ``round(i * (L_src - 1) / (L - 1))``, where
      ``L_src`` is the trace's ``num_model_layers`` (3 tiny-model layers over a
      61-layer trace: 0, 30, 60). A trace holding every layer of a model with
      ``L`` layers is used as is; ``SGLANG_NSA_TOPK_TRACE_LAYERS=0,30,60`` sets
      the trace layer id of each model layer explicitly;
    * positions: a trace position ``p`` (trace length ``m``, distance from the
      newest ``d = m - 1 - p``) maps to ``p`` if ``p < A`` (sinks), to
      ``n - 1 - d`` if ``d < R`` (recent tokens keep their distance from the
      newest), else to ``p`` if ``n >= m`` (absolute) or to
      ``A + (p - A) * max(n - R - A, 0) // (m - R - A)`` if ``n < m``
      (scaled down). ``A`` = ``SGLANG_NSA_TOPK_TRACE_SINKS`` (64), ``R`` =
      ``SGLANG_NSA_TOPK_TRACE_RECENT`` (1024). When ``n = m`` this is the
      identity, and while ``n - m`` stays constant a token the trace picks
      again maps to the same live token: the trace's step-to-step reuse is
      preserved exactly (except for tokens crossing the ``R`` boundary and at
      the trace's wrap-around). Only the scaled-down case can map two trace
      positions to one; a fix-up in ascending position order
      (``q_i = max(q_i, q_(i-1) + 1)``, then ``q_i <= n - cnt + i``) makes
      every row unique and ``< n``. Rows keep the trace's entry order and its
      ``-1`` padding; entries ``K`` and beyond of a wider trace are dropped.

    The trace is loaded on the first call (during CUDA-graph capture warm-up,
    before any graph is recorded). Per layer the override is one Triton kernel
    (a torch implementation of the same integer arithmetic serves CPU and is
    the fallback if the kernel fails a self-check at load;
    ``SGLANG_NSA_TOPK_TRACE_IMPL=torch|triton|auto``). Fixed shapes, device
    tensors only, no host sync: safe to capture in a CUDA graph.

Recorder (``SGLANG_NSA_TOPK_TRACE_RECORD=/path/out.npz``)
    Records the decode top-k of a running server in the same trace format.
    For every decode forward (eager or CUDA-graph replay) and every recorded
    layer (``SGLANG_NSA_TOPK_TRACE_RECORD_LAYERS``, default all) it copies the
    top-k of the first ``SGLANG_NSA_TOPK_TRACE_RECORD_MAX_ROWS`` (8) batch rows
    plus their sequence length and request pool index into a ring of the
    latest ``SGLANG_NSA_TOPK_TRACE_RECORD_MAX_STEPS`` (256) steps (capped at
    512 MB of pinned memory). The file is dense over steps x requests: keep
    rows x steps modest, or flush once per run of requests.
    ``SGLANG_NSA_TOPK_TRACE_RECORD_STAGE``: ``output`` (default: what attention
    uses, i.e. after the override if any) or ``input`` (the indexer's own).
    The ring lives in pinned host memory and is written by a small Triton
    kernel through unified virtual addressing, indexed by a step counter on
    the device (one extra launch per recorded layer, one per step to commit;
    graph-safe). A host thread that makes no CUDA call writes the file
    (through ``trace_format.save_trace``; the write replaces the file
    atomically) when the ring has new steps and the server has been idle for
    ``SGLANG_NSA_TOPK_TRACE_RECORD_FLUSH_IDLE_S`` seconds (2; ``0`` = never),
    when the file ``<path>.flush`` appears (removed once written), and at
    interpreter exit. In the file: rows with ``seq_len <= 1`` (CUDA-graph
    padding) are dropped; a request id is ``slot<r>_len<n>`` after its request
    pool index and its sequence length when it appeared, and a row continues a
    request when it has the same pool index, the previous step was recorded
    and held it with ``seq_len - 1``; metadata ``recorder`` says what was
    recorded. Only TP rank 0 records.

Negative control (``SGLANG_NSA_TOPK_CORRUPT=/path/arm``)
    Makes attention read one wrong KV row, to show that an exactness check on
    a checkpoint can fail. While the file ``/path/arm`` exists and holds two
    integers ``M R``, every decode row of model layer
    ``SGLANG_NSA_TOPK_CORRUPT_LAYER`` (0) whose sequence length ``n`` (the
    token being decoded counted) has ``n > 1`` and ``n % M == R`` gets its
    first top-k entry ``p`` (if valid) replaced by ``(p + n // 2) % n``: one
    other token's KV row, read once. With ``M = 64`` a request meets exactly
    one such step in any 64 consecutive decode steps, and its output before
    that step must stay as without the control. A host thread polls the file
    (no CUDA call); the GPU reads the arm state from pinned memory through a
    copy captured in the CUDA graph, so one running server serves clean and
    corrupted requests alike. The number of rows changed so far is written
    to ``/path/arm.hits`` whenever it changes.

``trace_format.py`` is found through ``SGLANG_NSA_TOPK_TRACE_FORMAT`` (path of
the file), ``import trace_format``, or next to the working directory /
the trace (``benchmark/nsa_offload/traces/trace_format.py``).
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

ENV_OVERRIDE = "SGLANG_NSA_TOPK_TRACE_OVERRIDE"
ENV_LAYERS = "SGLANG_NSA_TOPK_TRACE_LAYERS"
ENV_SINKS = "SGLANG_NSA_TOPK_TRACE_SINKS"
ENV_RECENT = "SGLANG_NSA_TOPK_TRACE_RECENT"
ENV_IMPL = "SGLANG_NSA_TOPK_TRACE_IMPL"
ENV_FORMAT = "SGLANG_NSA_TOPK_TRACE_FORMAT"
ENV_RECORD = "SGLANG_NSA_TOPK_TRACE_RECORD"
ENV_RECORD_MAX_STEPS = "SGLANG_NSA_TOPK_TRACE_RECORD_MAX_STEPS"
ENV_RECORD_MAX_ROWS = "SGLANG_NSA_TOPK_TRACE_RECORD_MAX_ROWS"
ENV_RECORD_LAYERS = "SGLANG_NSA_TOPK_TRACE_RECORD_LAYERS"
ENV_RECORD_STAGE = "SGLANG_NSA_TOPK_TRACE_RECORD_STAGE"
ENV_RECORD_FLUSH_IDLE_S = "SGLANG_NSA_TOPK_TRACE_RECORD_FLUSH_IDLE_S"
ENV_CORRUPT = "SGLANG_NSA_TOPK_CORRUPT"
ENV_CORRUPT_LAYER = "SGLANG_NSA_TOPK_CORRUPT_LAYER"

DEFAULT_SINKS = 64
DEFAULT_RECENT = 1024
DEFAULT_RECORD_MAX_STEPS = 256
DEFAULT_RECORD_MAX_ROWS = 8
DEFAULT_RECORD_FLUSH_IDLE_S = 2.0
FLUSH_TRIGGER_SUFFIX = ".flush"
_POLL_S = 0.2
_RECORD_RING_BYTES_CAP = 512 << 20  # pinned host memory of the ring
_INT64_MAX = tl.constexpr(9223372036854775807)


# ---------------------------------------------------------------- environment


def _env(name: str) -> Optional[str]:
    value = os.environ.get(name, "").strip()
    return value or None


def _env_int(name: str, default: int) -> int:
    value = _env(name)
    return default if value is None else int(value)


def _env_float(name: str, default: float) -> float:
    value = _env(name)
    return default if value is None else float(value)


def _env_ints(name: str) -> Optional[List[int]]:
    value = _env(name)
    if value is None:
        return None
    return [int(x) for x in value.replace(" ", "").split(",") if x]


# --------------------------------------------------------------- trace format

_TRACE_FORMAT = None


def import_trace_format(near: Optional[str] = None):
    """The ``trace_format`` module of ``benchmark/nsa_offload`` (numpy only)."""
    global _TRACE_FORMAT
    if _TRACE_FORMAT is None and "trace_format" in sys.modules:
        _TRACE_FORMAT = sys.modules["trace_format"]
    if _TRACE_FORMAT is not None:
        return _TRACE_FORMAT
    candidates = []
    if _env(ENV_FORMAT):
        candidates.append(_env(ENV_FORMAT))
    else:
        try:
            import trace_format  # benchmark dir on sys.path

            _TRACE_FORMAT = trace_format
            return _TRACE_FORMAT
        except ImportError:
            pass
        roots = [os.getcwd()]
        if near:
            d = os.path.dirname(os.path.abspath(near))
            roots += [d, os.path.dirname(d)]
        for root in roots:
            candidates.append(os.path.join(root, "trace_format.py"))
            candidates.append(
                os.path.join(
                    root, "benchmark", "nsa_offload", "traces", "trace_format.py"
                )
            )
    for path in candidates:
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("trace_format", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules["trace_format"] = module  # dataclasses look it up
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules["trace_format"]
                raise
            _TRACE_FORMAT = module
            return module
    raise ImportError(
        "NSA top-k trace: cannot find trace_format.py (tried "
        f"{candidates or 'import trace_format'}); set {ENV_FORMAT}=/path/to/"
        "benchmark/nsa_offload/traces/trace_format.py"
    )


# ----------------------------------------------------------------- layer map


def map_model_layers(
    model_layer_ids: Sequence[int],
    num_model_layers: int,
    trace_layer_ids: Sequence[int],
    trace_num_model_layers: Optional[int] = None,
    explicit: Optional[Sequence[int]] = None,
) -> Dict[int, int]:
    """Model layer id -> index of the trace layer it reads (module doc)."""
    trace_ids = [int(x) for x in trace_layer_ids]
    index = {lid: i for i, lid in enumerate(trace_ids)}
    out: Dict[int, int] = {}
    if explicit is not None:
        for lid in model_layer_ids:
            if lid >= len(explicit):
                raise ValueError(
                    f"{ENV_LAYERS} names {len(explicit)} layers, model layer "
                    f"{lid} has none"
                )
            if int(explicit[lid]) not in index:
                raise ValueError(
                    f"{ENV_LAYERS}: trace has no layer {explicit[lid]} "
                    f"(layers {trace_ids})"
                )
            out[lid] = index[int(explicit[lid])]
        return out
    if all(lid in index for lid in model_layer_ids) and trace_num_model_layers in (
        None,
        num_model_layers,
    ):
        return {lid: index[lid] for lid in model_layer_ids}
    src = trace_num_model_layers or (max(trace_ids) + 1)
    ids = np.array(trace_ids, dtype=np.float64)
    for lid in model_layer_ids:
        target = (
            0.0
            if num_model_layers <= 1
            else round(lid * (src - 1) / (num_model_layers - 1))
        )
        dist = np.abs(ids - target)
        # Nearest trace layer; ties go to the smaller layer id.
        best = min(range(len(trace_ids)), key=lambda i: (dist[i], trace_ids[i]))
        out[lid] = best
    return out


# ------------------------------------------------------------------ override


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _topk_override_kernel(
    topk_ptr,
    out_ptr,
    seq_lens_ptr,
    req_ptr,
    pos_ptr,
    perm_ptr,
    cnt_ptr,
    m_tab_ptr,
    m_first_ptr,
    num_steps_ptr,
    group_m_ptr,
    group_start_ptr,
    group_count_ptr,
    col_order_ptr,
    topk_stride,
    out_stride,
    num_groups,
    max_steps,
    sinks,
    recent,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HAS_PERM: tl.constexpr,
):
    b = tl.program_id(0)
    n = tl.load(seq_lens_ptr + b).to(tl.int64)
    r = tl.load(req_ptr + b).to(tl.int64)
    # Group: the largest first-decode length <= n, else the shortest.
    gi = tl.arange(0, BLOCK_G)
    gm = tl.load(group_m_ptr + gi, mask=gi < num_groups, other=_INT64_MAX)
    g = tl.maximum(tl.sum((gm <= n).to(tl.int64), axis=0) - 1, 0)
    g_start = tl.load(group_start_ptr + g)
    g_count = tl.load(group_count_ptr + g)
    rr = r % g_count
    rr = tl.where(rr < 0, rr + g_count, rr)
    c = tl.load(col_order_ptr + g_start + rr)
    s_c = tl.load(num_steps_ptr + c)
    j = (n - tl.load(m_first_ptr + c)) % s_c
    j = tl.where(j < 0, j + s_c, j)
    flat = c * max_steps + j
    m = tl.load(m_tab_ptr + flat)
    cnt = tl.load(cnt_ptr + flat).to(tl.int64)

    i = tl.arange(0, BLOCK_K)
    kmask = i < K
    p = tl.load(pos_ptr + flat * K + i, mask=kmask, other=-1).to(tl.int64)
    d = m - 1 - p
    scale_num = tl.maximum(n - recent - sinks, 0)
    scale_den = tl.maximum(m - recent - sinks, 1)
    q_mid = tl.where(n >= m, p, sinks + (p - sinks) * scale_num // scale_den)
    q = tl.where(p < sinks, p, tl.where(d < recent, n - 1 - d, q_mid))
    q = tl.minimum(tl.maximum(q, 0), n - 1)
    # Unique and < n: strictly increasing in ascending trace-position order.
    q = tl.associative_scan(q - i, 0, _max_combine) + i
    q = tl.minimum(q, n - cnt + i)

    use = (n > K) & (cnt > 0)
    if HAS_PERM:
        dst = tl.load(perm_ptr + flat * K + i, mask=kmask, other=0).to(tl.int64)
    else:
        dst = i.to(tl.int64)
    orig = tl.load(topk_ptr + b * topk_stride + dst, mask=kmask, other=-1)
    res = tl.where(use, tl.where(i < cnt, q, -1), orig.to(tl.int64))
    tl.store(
        out_ptr + b * out_stride + dst,
        res.to(out_ptr.dtype.element_ty),
        mask=kmask,
    )


@dataclass
class _OverrideTables:
    k: int
    device: torch.device
    layer_table: Dict[int, int]  # model layer id -> first index of the tables
    pos: torch.Tensor  # (L_u, C, S_max, K) int32, ascending, valid first
    perm: Optional[torch.Tensor]  # (L_u, C, S_max, K): original entry index
    cnt: torch.Tensor  # (L_u, C, S_max) int32
    m_tab: torch.Tensor  # (C, S_max) int64: trace seq_len
    m_first: torch.Tensor  # (C,) int64
    num_steps: torch.Tensor  # (C,) int64
    group_m: torch.Tensor  # (G,) int64, ascending
    group_start: torch.Tensor  # (G,) int64
    group_count: torch.Tensor  # (G,) int64
    col_order: torch.Tensor  # (C,) int64: columns sorted by m_first
    max_steps: int


class TopkTraceOverride:
    """Maps live decode rows onto a top-k trace (rules in the module doc)."""

    def __init__(
        self,
        trace: Any,
        *,
        sinks: int = DEFAULT_SINKS,
        recent: int = DEFAULT_RECENT,
        explicit_layers: Optional[Sequence[int]] = None,
        impl: str = "auto",
        source: str = "",
    ):
        if impl not in ("auto", "torch", "triton"):
            raise ValueError(f"{ENV_IMPL} must be auto, torch or triton: {impl!r}")
        self.topk = np.asarray(trace.topk)
        self.seq_lens = np.asarray(trace.seq_lens)
        self.layer_ids = [int(x) for x in np.asarray(trace.layer_ids).tolist()]
        meta = dict(getattr(trace, "metadata", {}) or {})
        self.trace_num_model_layers = meta.get("num_model_layers")
        self.sinks = int(sinks)
        self.recent = int(recent)
        self.explicit_layers = (
            None if explicit_layers is None else [int(x) for x in explicit_layers]
        )
        self.impl = impl
        self.source = source
        if self.topk.ndim != 4 or self.seq_lens.shape != (
            self.topk.shape[0],
            self.topk.shape[2],
        ):
            raise ValueError("trace arrays do not have the trace-format shapes")
        if not (self.seq_lens > 0).any():
            raise ValueError("trace has no request present at any step")
        self.tables: Optional[_OverrideTables] = None
        self.layer_map: Dict[int, int] = {}
        self._use_triton = False

    @classmethod
    def from_file(cls, path: str, **kwargs) -> "TopkTraceOverride":
        tf = import_trace_format(near=path)
        return cls(tf.load_trace(path), source=path, **kwargs)

    # -- preparation (host arrays -> device tables), once

    def prepare(
        self,
        device: torch.device,
        k: int,
        model_layer_ids: Sequence[int],
        num_model_layers: int,
        self_check: bool = True,
    ) -> None:
        self.layer_map = map_model_layers(
            model_layer_ids,
            num_model_layers,
            self.layer_ids,
            self.trace_num_model_layers,
            self.explicit_layers,
        )
        used = sorted(set(self.layer_map.values()))
        layer_table = {lid: used.index(t) for lid, t in self.layer_map.items()}

        S, _, B, kt = self.topk.shape
        rows = self.topk[:, used]  # (S, L_u, B, Kt)
        if kt > k:
            logger.warning(
                "NSA top-k trace: trace rows hold %d entries, the model %d: "
                "keeping the first %d of each row",
                kt,
                k,
                k,
            )
            rows = rows[..., :k]
        elif kt < k:
            pad = np.full(rows.shape[:-1] + (k - kt,), -1, dtype=rows.dtype)
            rows = np.concatenate([rows, pad], axis=-1)
        rows = rows.astype(np.int64)
        key = np.where(rows >= 0, rows, np.iinfo(np.int64).max)
        perm = np.argsort(key, axis=-1, kind="stable")
        sorted_pos = np.take_along_axis(rows, perm, axis=-1)
        cnt = (rows >= 0).sum(axis=-1)

        cols = [b for b in range(B) if (self.seq_lens[:, b] > 0).any()]
        present = [np.nonzero(self.seq_lens[:, b] > 0)[0] for b in cols]
        num_steps = np.array([len(p) for p in present], dtype=np.int64)
        s_max = int(num_steps.max())
        step_idx = np.stack(
            [np.concatenate([p, np.full(s_max - len(p), p[-1])]) for p in present]
        )  # (C, S_max)
        col_idx = np.array(cols, dtype=np.int64)[:, None]
        # (S, L_u, B, K) -> (L_u, C, S_max, K)
        pos_t = sorted_pos[step_idx, :, col_idx].transpose(2, 0, 1, 3)
        perm_t = perm[step_idx, :, col_idx].transpose(2, 0, 1, 3)
        cnt_t = cnt[step_idx, :, col_idx].transpose(2, 0, 1)
        m_tab = self.seq_lens[step_idx, col_idx].astype(np.int64)
        m_first = m_tab[:, 0].copy()
        col_order = np.argsort(m_first, kind="stable")
        group_m, group_start, group_count = np.unique(
            m_first[col_order], return_index=True, return_counts=True
        )
        identity = np.arange(k)
        has_perm = not bool((perm_t == identity).all())
        perm_dtype = torch.int16 if k <= np.iinfo(np.int16).max else torch.int32

        def dev(a, dtype):
            return torch.from_numpy(np.ascontiguousarray(a)).to(
                device=device, dtype=dtype
            )

        self.tables = _OverrideTables(
            k=k,
            device=torch.device(device),
            layer_table=layer_table,
            pos=dev(pos_t, torch.int32),
            perm=dev(perm_t, perm_dtype) if has_perm else None,
            cnt=dev(cnt_t, torch.int32),
            m_tab=dev(m_tab, torch.int64),
            m_first=dev(m_first, torch.int64),
            num_steps=dev(num_steps, torch.int64),
            group_m=dev(group_m, torch.int64),
            group_start=dev(group_start, torch.int64),
            group_count=dev(group_count, torch.int64),
            col_order=dev(col_order, torch.int64),
            max_steps=s_max,
        )
        on_cuda = self.tables.device.type == "cuda"
        self._use_triton = self.impl == "triton" or (self.impl == "auto" and on_cuda)
        if self_check:
            self._self_check()
        logger.info(
            "NSA top-k trace override: %s; %d trace requests (first decode "
            "lengths %s), up to %d steps each, model layer -> trace layer %s, "
            "sinks %d, recent %d, %s kernel",
            self.source or "<in memory>",
            len(cols),
            sorted(set(m_first.tolist())),
            s_max,
            {lid: self.layer_ids[t] for lid, t in sorted(self.layer_map.items())},
            self.sinks,
            self.recent,
            "triton" if self._use_triton else "torch",
        )

    def _self_check(self) -> None:
        """Checks the torch path's output on a synthetic batch and, when the
        Triton kernel is to be used, that the kernel agrees (else torch)."""
        t = self.tables
        gen = torch.Generator().manual_seed(0)
        bs = 16
        top = int(t.m_tab.max().item()) + 3 * t.max_steps + 1
        n = torch.randint(1, top + 1, (bs,), generator=gen)
        exact = min(4, t.m_first.numel())
        n[:exact] = t.m_first.cpu()[:exact]  # rows at the trace's own lengths
        n[-1] = 1  # CUDA-graph padding row
        r = torch.randint(0, 64, (bs,), generator=gen)
        x = torch.full((bs, t.k), -1, dtype=torch.int32)
        for b in range(bs):
            m = min(int(n[b]), t.k)
            x[b, :m] = torch.randperm(int(n[b]), generator=gen)[:m].to(torch.int32)
        args = (x.to(t.device), n.to(t.device), r.to(t.device))
        ref = None
        for layer in sorted(t.layer_table):
            ref = self._apply_torch(t.layer_table[layer], *args).cpu()
            _check_rows(ref, n, x)
            if self._use_triton:
                try:
                    got = self._apply_triton(t.layer_table[layer], *args).cpu()
                    ok = torch.equal(got, ref)
                except Exception as e:  # pragma: no cover - GPU only
                    logger.warning("NSA top-k trace: Triton kernel failed (%s)", e)
                    ok = False
                if not ok:
                    logger.warning(
                        "NSA top-k trace: Triton kernel disagrees with the torch "
                        "reference; using the torch implementation"
                    )
                    self._use_triton = False

    # -- per layer

    def apply(
        self,
        layer_id: int,
        topk: torch.Tensor,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Top-k ``(bs, K)`` of ``layer_id`` with rows replaced (module doc)."""
        t = self.tables
        assert t is not None, "prepare() first"
        li = t.layer_table.get(layer_id)
        if li is None or topk.shape[0] == 0:
            return topk
        if topk.shape[1] != t.k:
            raise ValueError(f"top-k width {topk.shape[1]}, prepared for {t.k}")
        bs = topk.shape[0]
        seq_lens = seq_lens[:bs]
        req_pool_indices = req_pool_indices[:bs]
        if self._use_triton:
            return self._apply_triton(li, topk, seq_lens, req_pool_indices)
        return self._apply_torch(li, topk, seq_lens, req_pool_indices)

    def _apply_triton(self, li, topk, seq_lens, req_pool_indices) -> torch.Tensor:
        t = self.tables
        if topk.stride(1) != 1:
            topk = topk.contiguous()
        bs, k = topk.shape
        out = torch.empty_like(topk, memory_format=torch.contiguous_format)
        num_groups = t.group_m.numel()
        _topk_override_kernel[(bs,)](
            topk,
            out,
            seq_lens,
            req_pool_indices,
            t.pos[li],
            t.perm[li] if t.perm is not None else t.pos[li],
            t.cnt[li],
            t.m_tab,
            t.m_first,
            t.num_steps,
            t.group_m,
            t.group_start,
            t.group_count,
            t.col_order,
            topk.stride(0),
            out.stride(0),
            num_groups,
            t.max_steps,
            self.sinks,
            self.recent,
            K=k,
            BLOCK_K=triton.next_power_of_2(k),
            BLOCK_G=max(triton.next_power_of_2(num_groups), 2),
            HAS_PERM=t.perm is not None,
            num_warps=8 if k >= 2048 else 4,
        )
        return out

    def _apply_torch(self, li, topk, seq_lens, req_pool_indices) -> torch.Tensor:
        t = self.tables
        bs, k = topk.shape
        n = seq_lens.to(torch.int64)
        r = req_pool_indices.to(torch.int64)
        g = (torch.searchsorted(t.group_m, n, right=True) - 1).clamp_(min=0)
        count = t.group_count[g]
        c = t.col_order[t.group_start[g] + torch.remainder(r, count)]
        j = torch.remainder(n - t.m_first[c], t.num_steps[c])
        flat = c * t.max_steps + j
        p = t.pos[li].reshape(-1, k).index_select(0, flat).to(torch.int64)
        cnt = t.cnt[li].reshape(-1).index_select(0, flat).to(torch.int64)[:, None]
        m = t.m_tab.reshape(-1).index_select(0, flat)[:, None]
        nn = n[:, None]
        d = m - 1 - p
        scale_num = (nn - self.recent - self.sinks).clamp(min=0)
        scale_den = (m - self.recent - self.sinks).clamp(min=1)
        q_mid = torch.where(
            nn >= m, p, self.sinks + (p - self.sinks) * scale_num // scale_den
        )
        q = torch.where(
            p < self.sinks, p, torch.where(d < self.recent, nn - 1 - d, q_mid)
        )
        q = torch.minimum(q.clamp(min=0), nn - 1)
        ar = torch.arange(k, device=q.device, dtype=torch.int64)
        q = torch.cummax(q - ar, dim=1).values + ar
        q = torch.minimum(q, nn - cnt + ar)
        q = torch.where(ar < cnt, q, torch.full_like(q, -1))
        if t.perm is not None:
            dst = t.perm[li].reshape(-1, k).index_select(0, flat).to(torch.int64)
            q = torch.empty_like(q).scatter_(1, dst, q)
        use = (nn > k) & (cnt > 0)
        return torch.where(use, q, topk.to(torch.int64)).to(topk.dtype)


def _check_rows(out: torch.Tensor, seq_lens: torch.Tensor, orig: torch.Tensor):
    """Host check of an override output (self-check): rows with ``n <= K``
    unchanged, others unique positions ``< n`` or ``-1``."""
    k = out.shape[1]
    for b in range(out.shape[0]):
        n = int(seq_lens[b])
        row = out[b]
        if n <= k:
            if not torch.equal(row, orig[b]):
                raise AssertionError(f"row {b} (n={n} <= K) was changed")
            continue
        valid = row[row >= 0]
        if (row < -1).any() or (valid >= n).any():
            raise AssertionError(f"row {b}: position out of range (n={n})")
        if valid.unique().numel() != valid.numel():
            raise AssertionError(f"row {b}: repeated position")


# ------------------------------------------------------------------ recorder


@triton.jit
def _record_topk_kernel(
    topk_ptr,
    seq_lens_ptr,
    req_ptr,
    counter_ptr,
    ring_topk_ptr,
    ring_meta_ptr,
    topk_stride,
    bs,
    layer_idx,
    num_layers,
    num_slots,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WRITE_META: tl.constexpr,
):
    row = tl.program_id(0)
    step = tl.load(counter_ptr)
    slot = step % num_slots
    live = row < bs
    if WRITE_META:
        n = tl.load(seq_lens_ptr + row, mask=live, other=0).to(tl.int64)
        r = tl.load(req_ptr + row, mask=live, other=-1).to(tl.int64)
        meta = (slot * ROWS + row) * 2
        tl.store(ring_meta_ptr + meta, n)
        tl.store(ring_meta_ptr + meta + 1, r)
    i = tl.arange(0, BLOCK_K)
    mask = (i < K) & live
    x = tl.load(topk_ptr + row * topk_stride + i, mask=mask, other=-1)
    dst = ((slot * num_layers + layer_idx) * ROWS + row) * K
    tl.store(ring_topk_ptr + dst + i, x.to(tl.int32), mask=mask)


@triton.jit
def _record_commit_kernel(counter_ptr, stamps_ptr, num_slots):
    step = tl.load(counter_ptr)
    # Step `step` is complete; the slot of the next step is invalid until its
    # own commit (the host never reads a half-written slot as valid).
    tl.store(stamps_ptr + step % num_slots, step + 1)
    tl.store(stamps_ptr + (step + 1) % num_slots, -1)
    tl.store(counter_ptr, step + 1)


class TopkTraceRecorder:
    """Ring of the latest decode steps' top-k, written to a trace file."""

    def __init__(
        self,
        path: str,
        *,
        max_steps: int = DEFAULT_RECORD_MAX_STEPS,
        max_rows: int = DEFAULT_RECORD_MAX_ROWS,
        layer_ids: Optional[Sequence[int]] = None,
        stage: str = "output",
        flush_idle_s: float = DEFAULT_RECORD_FLUSH_IDLE_S,
        impl: str = "auto",
        start_thread: bool = True,
    ):
        if max_steps < 1 or max_rows < 1:
            raise ValueError("recorder needs max_steps >= 1 and max_rows >= 1")
        if stage not in ("input", "output"):
            raise ValueError(f"{ENV_RECORD_STAGE} must be input or output: {stage!r}")
        self.path = path
        self.max_steps = int(max_steps)
        # One more slot than steps kept: the slot being written is invalid.
        self.num_slots = self.max_steps + 1
        self.max_rows = int(max_rows)
        self.requested_layers = None if layer_ids is None else list(layer_ids)
        self.stage = stage
        self.flush_idle_s = float(flush_idle_s)
        self.impl = impl
        self.start_thread = start_thread
        self.ready = False
        self.num_model_layers: Optional[int] = None
        self._lock = threading.Lock()
        self._flushed_newest = 0
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.num_flushes = 0

    # -- setup at the first call (before CUDA-graph capture)

    def setup(
        self,
        device: torch.device,
        k: int,
        model_layer_ids: Sequence[int],
        num_model_layers: int,
    ) -> None:
        layers = self.requested_layers
        if layers is None:
            layers = list(model_layer_ids)
        self.layer_ids = sorted(int(x) for x in layers)
        self.layer_index = {lid: i for i, lid in enumerate(self.layer_ids)}
        self.last_layer = self.layer_ids[-1]
        self.first_layer = self.layer_ids[0]
        self.k = int(k)
        self.num_model_layers = int(num_model_layers)
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        self._use_triton = self.impl == "triton" or (self.impl == "auto" and on_cuda)
        pin = on_cuda
        L, R = len(self.layer_ids), self.max_rows
        step_bytes = L * R * self.k * 4
        if (self.max_steps + 1) * step_bytes > _RECORD_RING_BYTES_CAP:
            self.max_steps = max(1, _RECORD_RING_BYTES_CAP // step_bytes - 1)
            self.num_slots = self.max_steps + 1
            logger.warning(
                "NSA top-k trace recorder: ring capped at %d steps (%d MB)",
                self.max_steps,
                _RECORD_RING_BYTES_CAP >> 20,
            )
        S = self.num_slots
        self.ring_topk = torch.full((S, L, R, self.k), -1, dtype=torch.int32)
        self.ring_meta = torch.zeros((S, R, 2), dtype=torch.int64)
        self.stamps = torch.zeros((S,), dtype=torch.int64)
        if pin:
            self.ring_topk = self.ring_topk.pin_memory()
            self.ring_meta = self.ring_meta.pin_memory()
            self.stamps = self.stamps.pin_memory()
        self.counter = torch.zeros((1,), dtype=torch.int64, device=self.device)
        self._stamps_np = self.stamps.numpy()
        self.ready = True
        logger.info(
            "NSA top-k trace recorder: %s; layers %s, first %d batch rows, ring "
            "of %d steps (%.1f MB pinned), stage %s",
            self.path,
            self.layer_ids,
            R,
            S,
            (self.ring_topk.nbytes + self.ring_meta.nbytes) / 1e6,
            self.stage,
        )
        if self.start_thread:
            self._thread = threading.Thread(
                target=self._run, name="nsa-topk-trace-recorder", daemon=True
            )
            self._thread.start()
        atexit.register(self._at_exit)

    # -- per layer (hot path)

    def record(
        self,
        layer_id: int,
        topk: torch.Tensor,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
    ) -> None:
        li = self.layer_index.get(layer_id)
        if li is None:
            return
        bs, k = topk.shape
        if k != self.k:
            return
        if topk.stride(1) != 1:
            topk = topk.contiguous()
        if self._use_triton:
            _record_topk_kernel[(self.max_rows,)](
                topk,
                seq_lens,
                req_pool_indices,
                self.counter,
                self.ring_topk,
                self.ring_meta,
                topk.stride(0),
                bs,
                li,
                len(self.layer_ids),
                self.num_slots,
                K=k,
                ROWS=self.max_rows,
                BLOCK_K=triton.next_power_of_2(k),
                WRITE_META=layer_id == self.first_layer,
                num_warps=4,
            )
            if layer_id == self.last_layer:
                _record_commit_kernel[(1,)](self.counter, self.stamps, self.num_slots)
            return
        # Eager torch path (CPU, tests): same layout and protocol.
        step = int(self.counter.item())
        slot = step % self.num_slots
        rows = min(bs, self.max_rows)
        if layer_id == self.first_layer:
            self.ring_meta[slot].zero_()
            self.ring_meta[slot, :, 1] = -1
            self.ring_meta[slot, :rows, 0] = seq_lens[:rows].to("cpu", torch.int64)
            self.ring_meta[slot, :rows, 1] = req_pool_indices[:rows].to(
                "cpu", torch.int64
            )
        self.ring_topk[slot, li, :rows, :k] = topk[:rows, :k].to("cpu", torch.int32)
        if layer_id == self.last_layer:
            self.stamps[slot] = step + 1
            self.stamps[(step + 1) % self.num_slots] = -1
            self.counter += 1

    # -- host side

    def newest_step(self) -> int:
        """Steps committed so far (0 before the first)."""
        return int(self._stamps_np.max()) if self.ready else 0

    def snapshot(self):
        """The recorded steps as a trace (``NSATopkTrace``), or None if empty."""
        if not self.ready:
            return None
        tf = import_trace_format(near=self.path)
        stamps1 = self._stamps_np.copy()
        slots = np.nonzero(stamps1 > 0)[0]
        slots = slots[np.argsort(stamps1[slots], kind="stable")]
        topk = self.ring_topk.numpy()[slots].copy()
        meta = self.ring_meta.numpy()[slots].copy()
        stamps2 = self._stamps_np.copy()
        keep = stamps2[slots] == stamps1[slots]  # not rewritten while copied
        steps = stamps1[slots] - 1
        rec = tf.TraceRecorder(
            top_k=self.k,
            layer_ids=self.layer_ids,
            metadata={
                "num_model_layers": self.num_model_layers,
                "recorder": {
                    "what": "decode top-k positions of the first batch rows, "
                    "per decode forward, as passed to the attention "
                    + (
                        "(after the trace override, if any)"
                        if self.stage == "output"
                        else "by the indexer (before any override)"
                    ),
                    "stage": self.stage,
                    "max_steps": self.max_steps,
                    "max_rows": self.max_rows,
                    "layers": self.layer_ids,
                    "steps_committed": int(stamps1.max(initial=0)),
                    "padding_rows_dropped": "seq_len <= 1",
                    "request_id": "slot<req_pool_idx>_len<seq_len when it " "appeared>",
                },
            },
        )
        last: Dict[int, tuple] = {}  # req_pool_idx -> (step, seq_len, rid)
        for i in np.nonzero(keep)[0]:
            step = int(steps[i])
            n = meta[i, :, 0]
            r = meta[i, :, 1]
            live = np.nonzero(n > 1)[0]
            if live.size == 0:
                continue
            rids = []
            for row in live:
                slot_r, seq = int(r[row]), int(n[row])
                prev = last.get(slot_r)
                if prev is not None and prev[0] == step - 1 and prev[1] == seq - 1:
                    rid = prev[2]
                else:
                    rid = f"slot{slot_r}_len{seq}"
                last[slot_r] = (step, seq, rid)
                rids.append(rid)
            if len(set(rids)) != len(rids):
                continue  # two rows claim one request: not a decode batch
            rec.begin_step(rids, n[live])
            for li, lid in enumerate(self.layer_ids):
                rec.record_layer(lid, topk[i, li, live])
            rec.end_step()
        if rec.num_steps == 0:
            return None
        return rec.to_trace()

    def flush(self) -> Optional[str]:
        """Write the file now if the ring has steps; returns the path written."""
        with self._lock:
            if not self.ready:
                return None
            newest = self.newest_step()
            trace = self.snapshot()
            if trace is None:
                self._warn_if_uncommitted()
                return None
            tf = import_trace_format(near=self.path)
            tmp = f"{self.path}.tmp{os.getpid()}"
            try:
                try:
                    # Uncompressed: a flush then takes milliseconds of the
                    # server's CPU instead of seconds.
                    tf.save_trace(tmp, trace, compress=False)
                    os.replace(tmp, self.path)
                    written = self.path
                except ValueError as e:
                    # Invalid rows (e.g. a repeated position): keep the raw arrays.
                    written = self.path + ".raw.npz"
                    logger.error(
                        "NSA top-k trace recorder: %s; raw arrays in %s", e, written
                    )
                    with open(written, "wb") as f:
                        np.savez_compressed(
                            f,
                            topk=trace.topk,
                            seq_lens=trace.seq_lens,
                            layer_ids=trace.layer_ids,
                            request_ids=np.array(trace.request_ids),
                        )
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            self._flushed_newest = newest
            self.num_flushes += 1
            logger.info(
                "NSA top-k trace recorder: wrote %s (%d steps x %d layers x %d "
                "requests)",
                written,
                trace.num_steps,
                trace.num_layers,
                trace.num_requests,
            )
            return written

    def _warn_if_uncommitted(self) -> None:
        # A step is committed after its last layer: rows written at the
        # first layer without any committed step mean that layer never runs.
        if self.newest_step() == 0 and bool((self.ring_meta[..., 0] > 0).any()):
            logger.warning(
                "NSA top-k trace recorder: top-k rows were recorded but no step "
                "was committed: layer %d (the last of %s) never ran a decode "
                "forward; set %s to the layers that do",
                self.last_layer,
                self.layer_ids,
                ENV_RECORD_LAYERS,
            )

    def _run(self) -> None:
        trigger = self.path + FLUSH_TRIGGER_SUFFIX
        seen, seen_at = 0, time.monotonic()
        while not self._stop.wait(_POLL_S):
            try:
                now = time.monotonic()
                newest = self.newest_step()
                if newest != seen:
                    seen, seen_at = newest, now
                triggered = os.path.exists(trigger)
                idle = (
                    self.flush_idle_s > 0
                    and newest > self._flushed_newest
                    and now - seen_at >= self.flush_idle_s
                )
                if triggered or idle:
                    try:
                        self.flush()
                    finally:
                        if triggered and os.path.exists(trigger):
                            os.remove(trigger)
            except Exception:  # keep the server alive whatever happens here
                logger.exception("NSA top-k trace recorder: flush failed")
                time.sleep(1.0)

    def _at_exit(self) -> None:
        try:
            if self.ready and self.newest_step() > self._flushed_newest:
                self.flush()
        except Exception:  # pragma: no cover
            logger.exception("NSA top-k trace recorder: flush at exit failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        atexit.unregister(self._at_exit)


class TopkCorruption:
    """The negative control: one top-k entry of one layer replaced while the
    arm file says so (module docstring)."""

    HITS_SUFFIX = ".hits"

    def __init__(self, path: str, layer: int, poll_s: float = _POLL_S):
        self.path = path
        self.layer = layer
        self.poll_s = poll_s
        self._hits_written = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def setup(self, device: torch.device) -> None:
        pin = device.type == "cuda"
        # [armed, M, R] as the poll thread last read them; the row count
        # changed so far, copied back after every corrupted layer call.
        self.arm_host = torch.zeros(3, dtype=torch.int64, pin_memory=pin)
        self.hits_host = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
        self.arm_dev = torch.zeros(3, dtype=torch.int64, device=device)
        self.hits_dev = torch.zeros(1, dtype=torch.int64, device=device)
        self.poll()
        if self._thread is None and self.poll_s > 0:
            self._thread = threading.Thread(
                target=self._run, name="nsa-topk-corrupt", daemon=True
            )
            self._thread.start()
        logger.warning(
            "NSA top-k negative control on layer %d, armed by %s",
            self.layer,
            self.path,
        )

    def poll(self) -> None:
        """Read the arm file into pinned memory and publish the hit count."""
        arm = [0, 1, 0]
        try:
            with open(self.path) as f:
                m, r = (int(x) for x in f.read().split()[:2])
            arm = [1, max(m, 1), r]
        except (OSError, ValueError):
            pass
        self.arm_host[1], self.arm_host[2] = arm[1], arm[2]
        self.arm_host[0] = arm[0]
        hits = int(self.hits_host[0])
        if hits != self._hits_written:
            tmp = self.path + self.HITS_SUFFIX + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"{hits}\n")
            os.replace(tmp, self.path + self.HITS_SUFFIX)
            self._hits_written = hits

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # pragma: no cover - keep the server up
                logger.exception("NSA top-k negative control: poll failed")

    def stop(self) -> None:
        self._stop.set()

    def apply(
        self, layer_id: int, topk: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        if layer_id != self.layer:
            return topk
        self.arm_dev.copy_(self.arm_host, non_blocking=True)
        n = seq_lens.to(topk.dtype)
        first = topk[:, 0]
        hit = (
            (self.arm_dev[0] > 0)
            & (n > 1)
            & (n % self.arm_dev[1] == self.arm_dev[2])
            & (first >= 0)
        )
        out = topk.clone()
        out[:, 0] = torch.where(hit, (first + n // 2) % n.clamp(min=1), first)
        self.hits_dev += hit.sum()
        self.hits_host.copy_(self.hits_dev, non_blocking=True)
        return out


# ---------------------------------------------------------------------- hook


def _model_layers(forward_batch) -> tuple:
    """(model layer ids on this rank, number of model layers).

    The pool's ``end_layer`` is what the model runner passes: the model's
    exclusive end (a model's MTP layer has no pool layers here), so the
    layers are ``start_layer .. start_layer + layer_num - 1``. sglang 0.5.17's
    batch has no pool: it is its forward context's attention backend's."""
    pool = getattr(forward_batch, "token_to_kv_pool", None)
    if pool is None:
        from sglang.srt.model_executor.forward_context import get_attn_backend

        pool = getattr(get_attn_backend(), "token_to_kv_pool", None)
    layer_num = getattr(pool, "layer_num", None)
    if layer_num is None:
        raise RuntimeError("NSA top-k trace: the KV pool has no layer_num")
    start = int(getattr(pool, "start_layer", 0) or 0)
    end = start + int(layer_num)
    return list(range(start, end)), end


def _is_tp_rank0() -> bool:
    try:
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0
    except Exception:  # pragma: no cover
        return True


class DecodeTopkHooks:
    """What ``apply_decode_topk_hooks`` runs when an env var is set."""

    def __init__(
        self,
        override: Optional[TopkTraceOverride],
        recorder: Optional[TopkTraceRecorder],
        corruption: Optional[TopkCorruption] = None,
    ):
        self.override = override
        self.recorder = recorder
        self.corruption = corruption
        self.active = any(h is not None for h in (override, recorder, corruption))
        self._ready = False

    @classmethod
    def from_env(cls) -> "DecodeTopkHooks":
        override = recorder = None
        impl = _env(ENV_IMPL) or "auto"
        path = _env(ENV_OVERRIDE)
        if path is not None:
            override = TopkTraceOverride.from_file(
                path,
                sinks=_env_int(ENV_SINKS, DEFAULT_SINKS),
                recent=_env_int(ENV_RECENT, DEFAULT_RECENT),
                explicit_layers=_env_ints(ENV_LAYERS),
                impl=impl,
            )
        path = _env(ENV_RECORD)
        if path is not None and _is_tp_rank0():
            recorder = TopkTraceRecorder(
                path,
                max_steps=_env_int(ENV_RECORD_MAX_STEPS, DEFAULT_RECORD_MAX_STEPS),
                max_rows=_env_int(ENV_RECORD_MAX_ROWS, DEFAULT_RECORD_MAX_ROWS),
                layer_ids=_env_ints(ENV_RECORD_LAYERS),
                stage=_env(ENV_RECORD_STAGE) or "output",
                flush_idle_s=_env_float(
                    ENV_RECORD_FLUSH_IDLE_S, DEFAULT_RECORD_FLUSH_IDLE_S
                ),
                impl=impl,
            )
        corruption = None
        path = _env(ENV_CORRUPT)
        if path is not None:
            corruption = TopkCorruption(path, _env_int(ENV_CORRUPT_LAYER, 0))
        return cls(override, recorder, corruption)

    def _setup(self, forward_batch, topk: torch.Tensor) -> None:
        if topk.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "NSA top-k trace: first call inside a CUDA-graph capture; it "
                "must come from an eager forward (capture warm-up) first"
            )
        layer_ids, num_layers = _model_layers(forward_batch)
        if self.override is not None:
            self.override.prepare(topk.device, topk.shape[1], layer_ids, num_layers)
        if self.recorder is not None:
            try:
                self.recorder.setup(topk.device, topk.shape[1], layer_ids, num_layers)
            except Exception:
                logger.exception("NSA top-k trace recorder disabled")
                self.recorder = None
        if self.corruption is not None:
            self.corruption.setup(topk.device)
        self._ready = True

    def __call__(self, forward_batch, layer_id: int, topk: torch.Tensor):
        if topk.dim() != 2 or topk.shape[0] == 0:
            return topk
        if not self._ready:
            self._setup(forward_batch, topk)
        bs = topk.shape[0]
        seq_lens = forward_batch.seq_lens[:bs]
        req_pool_indices = forward_batch.req_pool_indices[:bs]
        out = topk
        if self.override is not None:
            out = self.override.apply(layer_id, topk, seq_lens, req_pool_indices)
        if self.corruption is not None:
            out = self.corruption.apply(layer_id, out, seq_lens)
        if self.recorder is not None:
            src = out if self.recorder.stage == "output" else topk
            try:
                self.recorder.record(layer_id, src, seq_lens, req_pool_indices)
            except Exception:
                # Python runs here only in eager forwards (capture warm-up
                # included): a broken recorder must not take the server down.
                logger.exception("NSA top-k trace recorder disabled")
                self.recorder = None
        return out

    def verify(self, forward_batch, layer_id: int, topk: torch.Tensor):
        """MTP target verify: ``q`` rows per request (request-major), row
        ``j`` the query at position ``seq_len + j``, which sees ``seq_len +
        j + 1`` positions. The override maps each row as the decode step at
        that length (consecutive queries get consecutive steps' rows) and
        the negative control corrupts rows by that length; the recorder
        records decode steps only."""
        if (self.override is None and self.corruption is None) or (
            topk.dim() != 2 or topk.shape[0] == 0
        ):
            return topk
        if not self._ready:
            self._setup(forward_batch, topk)
        bs = forward_batch.batch_size
        q = topk.shape[0] // bs
        j = torch.arange(q, device=topk.device, dtype=forward_batch.seq_lens.dtype)
        row_lens = (forward_batch.seq_lens[:bs, None] + j[None, :] + 1).reshape(-1)
        out = topk
        if self.override is not None:
            rows_req = forward_batch.req_pool_indices[:bs].repeat_interleave(q)
            out = self.override.apply(layer_id, out, row_lens, rows_req)
        if self.corruption is not None:
            out = self.corruption.apply(layer_id, out, row_lens)
        return out


_HOOKS: Optional[DecodeTopkHooks] = None
_HOOKS_LOCK = threading.Lock()


def get_decode_topk_hooks() -> DecodeTopkHooks:
    """The process's hooks, built from the environment at the first call."""
    global _HOOKS
    hooks = _HOOKS
    if hooks is None:
        with _HOOKS_LOCK:
            if _HOOKS is None:
                _HOOKS = DecodeTopkHooks.from_env()
            hooks = _HOOKS
    return hooks


def apply_decode_topk_hooks(forward_batch, layer_id: int, topk: torch.Tensor):
    hooks = _HOOKS if _HOOKS is not None else get_decode_topk_hooks()
    if not hooks.active:
        return topk
    return hooks(forward_batch, layer_id, topk)


def apply_verify_topk_hooks(forward_batch, layer_id: int, topk: torch.Tensor):
    """The hooks for the MLA forward's non-decode top-k: target-verify forwards
    only (bench_hooks/0001, ``DecodeTopkHooks.verify``); prefill and draft
    extends pass through."""
    if not forward_batch.forward_mode.is_target_verify():
        return topk
    hooks = _HOOKS if _HOOKS is not None else get_decode_topk_hooks()
    if not hooks.active:
        return topk
    return hooks.verify(forward_batch, layer_id, topk)


def reset_decode_topk_hooks() -> None:
    """Forget the hooks (tests): the next call reads the environment again."""
    global _HOOKS
    with _HOOKS_LOCK:
        if _HOOKS is not None and _HOOKS.recorder is not None:
            _HOOKS.recorder.stop()
        if _HOOKS is not None and _HOOKS.corruption is not None:
            _HOOKS.corruption.stop()
        _HOOKS = None
