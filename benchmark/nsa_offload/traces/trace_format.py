"""On-disk format of NSA decode top-k traces (``.npz``), reader, writer, recorder.

A trace holds, for every decode step, every recorded attention layer and every
request of the batch, the indexer's top-k token positions and the request's
sequence length. It is what the offline replay (``replay.py``) consumes; the
synthetic generator (``trace_gen.py``) writes it and the in-server recorder will
write the same format. This module only needs numpy so that it can be imported
anywhere (benchmarks, tests, the server).

Format version 1 -- one ``.npz`` (zip of ``.npy`` arrays, deflate-compressed):

=================  ==================  =================================================
key                dtype / shape       meaning
=================  ==================  =================================================
``format_version`` int64, ()           ``TRACE_FORMAT_VERSION`` (= 1)
``metadata_json``  str, ()             JSON object, see "Metadata" below
``layer_ids``      int32, (L,)         model layer index of each recorded layer
``request_ids``    str, (B,)           stable id of each request column
``seq_lens``       int32, (S, B)       sequence length of request b at step s, counting
                                       the token decoded in that step; 0 = request not
                                       in the batch at that step
``topk_encoding``  str, ()             ``"dense"`` or ``"sorted_delta"``
``top_k``          int64, ()           K, width of a top-k row
=================  ==================  =================================================

Top-k, ``topk_encoding == "dense"``:

* ``topk``: int32 ``(S, L, B, K)``. Entry ``topk[s, l, b, i]`` is the i-th
  top-k position (``0 <= p < seq_lens[s, b]``) in the indexer's output order,
  ``-1`` for padding. Rows of absent requests are all ``-1``.

Top-k, ``topk_encoding == "sorted_delta"`` (lossless, used automatically when
every row lists its valid positions in ascending order followed only by ``-1``):

* ``topk_counts``: int32 ``(S, L, B)``, number of valid entries of each row.
* ``topk_deltas``: uint8, uint16 or uint32 (the narrowest that fits)
  ``(sum(topk_counts),)``, rows concatenated in C order; within a row the first
  value is the first position and each next value is
  ``position - previous_position - 1``.

Positions are token positions within the request (what the NSA indexer returns
before they are mapped to token locs through ``req_to_token``), not locs.

Metadata (JSON object; keys the replay relies on are marked *):

* ``source`` *: ``"synthetic"`` or ``"recorded"``.
* ``topk_order`` *: ``"ascending_position"`` or ``"indexer"`` (order as produced by
  the indexer; the replay's tie rules follow the row order).
* ``model``: model the trace stems from or imitates.
* ``num_model_layers``: attention layers of that model (61 for DeepSeek-V3.2).
* ``command``: command line that produced the file.
* ``generator`` / ``recorder``: parameters of the producer.
* ``calibration``: targets and achieved statistics (synthetic traces).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

TRACE_FORMAT_VERSION = 1
ENCODING_DENSE = "dense"
ENCODING_SORTED_DELTA = "sorted_delta"


@dataclass
class NSATopkTrace:
    """In-memory trace. Arrays follow the layout of the file format."""

    topk: np.ndarray  # (S, L, B, K) int32, -1 padded
    seq_lens: np.ndarray  # (S, B) int32, 0 = absent
    layer_ids: np.ndarray  # (L,) int32
    request_ids: List[str]
    metadata: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.topk = np.ascontiguousarray(self.topk, dtype=np.int32)
        self.seq_lens = np.ascontiguousarray(self.seq_lens, dtype=np.int32)
        self.layer_ids = np.ascontiguousarray(self.layer_ids, dtype=np.int32)
        self.request_ids = [str(r) for r in self.request_ids]

    @property
    def num_steps(self) -> int:
        return self.topk.shape[0]

    @property
    def num_layers(self) -> int:
        return self.topk.shape[1]

    @property
    def num_requests(self) -> int:
        return self.topk.shape[2]

    @property
    def top_k(self) -> int:
        return self.topk.shape[3]

    def validate(self) -> None:
        """Raise ``ValueError`` if the arrays break the format's invariants."""
        if self.topk.ndim != 4:
            raise ValueError(f"topk must be (S, L, B, K), got {self.topk.shape}")
        S, L, B, _ = self.topk.shape
        if self.seq_lens.shape != (S, B):
            raise ValueError(f"seq_lens shape {self.seq_lens.shape} != {(S, B)}")
        if self.layer_ids.shape != (L,):
            raise ValueError(f"layer_ids shape {self.layer_ids.shape} != {(L,)}")
        if len(self.request_ids) != B:
            raise ValueError(f"{len(self.request_ids)} request ids for {B} requests")
        if len(set(self.layer_ids.tolist())) != L:
            raise ValueError("layer_ids must be unique")
        if (self.seq_lens < 0).any():
            raise ValueError("seq_lens must be >= 0")
        if (self.topk < -1).any():
            raise ValueError("top-k entries must be >= -1")
        n = self.seq_lens[:, None, :, None]
        if (self.topk >= np.maximum(n, 0)).any():
            raise ValueError("a top-k position is >= its sequence length")
        # Uniqueness of the valid entries of every row (as the indexer's top-k is).
        rows = np.sort(self.topk.reshape(-1, self.top_k), axis=1)
        dup = (rows[:, 1:] == rows[:, :-1]) & (rows[:, 1:] >= 0)
        if dup.any():
            raise ValueError("a top-k row repeats a position")

    def active(self, step: int) -> np.ndarray:
        """Request columns present in the batch at ``step``."""
        return np.nonzero(self.seq_lens[step] > 0)[0]

    def iter_batches(
        self,
    ) -> Iterator[Tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]:
        """Yield ``(step, layer_index, req_columns, seq_lens, topk)`` per step/layer."""
        for s in range(self.num_steps):
            cols = self.active(s)
            for li in range(self.num_layers):
                yield s, li, cols, self.seq_lens[s, cols], self.topk[s, li, cols]


def _is_sorted_delta_encodable(topk: np.ndarray) -> bool:
    rows = topk.reshape(-1, topk.shape[-1]).astype(np.int64)
    valid = rows >= 0
    # Valid entries first, then only padding.
    if (valid[:, 1:] & ~valid[:, :-1]).any():
        return False
    inc = rows[:, 1:] > rows[:, :-1]
    return bool((inc | ~valid[:, 1:]).all())


def _encode_sorted_delta(topk: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    flat = topk.reshape(-1, topk.shape[-1]).astype(np.int64)
    counts = (flat >= 0).sum(axis=1)
    prev = np.concatenate([np.full((flat.shape[0], 1), -1), flat[:, :-1]], axis=1)
    deltas = (flat - prev - 1)[flat >= 0]
    top = int(deltas.max()) if deltas.size else 0
    dtype = next(t for t in (np.uint8, np.uint16, np.uint32) if top <= np.iinfo(t).max)
    return counts.reshape(topk.shape[:-1]).astype(np.int32), deltas.astype(dtype)


def _decode_sorted_delta(counts: np.ndarray, deltas: np.ndarray, k: int) -> np.ndarray:
    flat_counts = counts.reshape(-1).astype(np.int64)
    out = np.full((flat_counts.size, k), -1, dtype=np.int64)
    mask = np.arange(k)[None, :] < flat_counts[:, None]
    vals = np.zeros_like(out)
    vals[mask] = deltas.astype(np.int64) + 1
    pos = np.cumsum(vals, axis=1) - 1
    out[mask] = pos[mask]
    return out.reshape(tuple(counts.shape) + (k,)).astype(np.int32)


def save_trace(
    path: str, trace: NSATopkTrace, encoding: str = "auto", compress: bool = True
) -> str:
    """Write ``trace`` to ``path`` (``.npz``). Returns the encoding used.

    ``encoding``: ``"auto"`` (``sorted_delta`` when lossless, else ``dense``),
    ``"dense"`` or ``"sorted_delta"``. ``compress=False`` stores the arrays
    uncompressed: no zlib pass over the in-server recorder's unsorted dense
    rows (random positions compress poorly); readers see no difference.
    """
    trace.validate()
    if encoding == "auto":
        encoding = (
            ENCODING_SORTED_DELTA
            if _is_sorted_delta_encodable(trace.topk)
            else ENCODING_DENSE
        )
    arrays: Dict[str, np.ndarray] = {
        "format_version": np.array(TRACE_FORMAT_VERSION, dtype=np.int64),
        "metadata_json": np.array(json.dumps(trace.metadata, sort_keys=True)),
        "layer_ids": trace.layer_ids,
        "request_ids": np.array(trace.request_ids, dtype=np.str_),
        "seq_lens": trace.seq_lens,
        "topk_encoding": np.array(encoding),
        "top_k": np.array(trace.top_k, dtype=np.int64),
    }
    if encoding == ENCODING_DENSE:
        arrays["topk"] = trace.topk
    elif encoding == ENCODING_SORTED_DELTA:
        if not _is_sorted_delta_encodable(trace.topk):
            raise ValueError("sorted_delta needs ascending rows padded at the end")
        arrays["topk_counts"], arrays["topk_deltas"] = _encode_sorted_delta(trace.topk)
    else:
        raise ValueError(f"unknown encoding {encoding!r}")
    with open(path, "wb") as f:
        (np.savez_compressed if compress else np.savez)(f, **arrays)
    return encoding


def load_trace(path: str) -> NSATopkTrace:
    """Read a trace written by :func:`save_trace` (any supported version)."""
    with np.load(path, allow_pickle=False) as z:
        version = int(z["format_version"])
        if version != TRACE_FORMAT_VERSION:
            raise ValueError(
                f"{path}: trace format version {version} is not supported "
                f"(this reader handles version {TRACE_FORMAT_VERSION})"
            )
        encoding = str(z["topk_encoding"])
        k = int(z["top_k"])
        if encoding == ENCODING_DENSE:
            topk = z["topk"]
        elif encoding == ENCODING_SORTED_DELTA:
            topk = _decode_sorted_delta(z["topk_counts"], z["topk_deltas"], k)
        else:
            raise ValueError(f"{path}: unknown top-k encoding {encoding!r}")
        trace = NSATopkTrace(
            topk=topk,
            seq_lens=z["seq_lens"],
            layer_ids=z["layer_ids"],
            request_ids=[str(r) for r in z["request_ids"]],
            metadata=json.loads(str(z["metadata_json"])),
        )
    trace.validate()
    return trace


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch
        x = x.detach().cpu().numpy()
    return np.asarray(x)


@dataclass
class _RecordedStep:
    rows: Dict[int, int]  # request column -> row in the step's batch
    seq_lens: np.ndarray  # (bs,)
    layers: Dict[int, np.ndarray]  # layer id -> (bs, K) top-k


class TraceRecorder:
    """Accumulates decode steps into a trace (for the in-server recorder).

    Per decode step: :meth:`begin_step` with the batch's request ids and
    sequence lengths, one :meth:`record_layer` per recorded layer with the
    indexer's ``(bs, K)`` top-k positions (numpy array or tensor; tensors are
    copied to the host, so record off the hot path or on a side stream), then
    :meth:`end_step`. Requests may join and leave between steps; each distinct
    request id gets a column. :meth:`to_trace` / :meth:`save` build the file.
    """

    def __init__(
        self,
        top_k: int,
        layer_ids: Optional[Sequence[int]] = None,
        metadata: Optional[Dict[str, Any]] = None,
    ):
        self.top_k = top_k
        self.layer_ids = None if layer_ids is None else [int(x) for x in layer_ids]
        self.metadata: Dict[str, Any] = {"source": "recorded", "topk_order": "indexer"}
        self.metadata.update(metadata or {})
        self._columns: Dict[str, int] = {}
        self._steps: List[_RecordedStep] = []
        self._current: Optional[Tuple[List[str], np.ndarray, Dict[int, np.ndarray]]]
        self._current = None

    def begin_step(self, request_ids: Sequence[str], seq_lens: Any) -> None:
        if self._current is not None:
            raise RuntimeError("begin_step called twice without end_step")
        seq_lens = _to_numpy(seq_lens).astype(np.int64).reshape(-1)
        request_ids = [str(r) for r in request_ids]
        if len(request_ids) != seq_lens.size:
            raise ValueError("one sequence length per request id")
        self._current = (request_ids, seq_lens, {})

    def record_layer(self, layer_id: int, topk: Any) -> None:
        if self._current is None:
            raise RuntimeError("record_layer outside begin_step/end_step")
        rids, _, layers = self._current
        topk = _to_numpy(topk).astype(np.int32)
        if topk.ndim != 2 or topk.shape[0] < len(rids):
            raise ValueError(f"top-k of shape {topk.shape} for {len(rids)} requests")
        if topk.shape[1] > self.top_k:
            raise ValueError(f"top-k width {topk.shape[1]} > {self.top_k}")
        row = np.full((len(rids), self.top_k), -1, dtype=np.int32)
        row[:, : topk.shape[1]] = topk[: len(rids)]
        layers[int(layer_id)] = row

    def end_step(self) -> None:
        if self._current is None:
            raise RuntimeError("end_step without begin_step")
        rids, seq_lens, layers = self._current
        rows = {}  # column -> row of this step's batch
        for i, rid in enumerate(rids):
            rows[self._columns.setdefault(rid, len(self._columns))] = i
        self._steps.append(_RecordedStep(rows, seq_lens, layers))
        self._current = None

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def to_trace(self) -> NSATopkTrace:
        if self.layer_ids is not None:
            layer_ids = self.layer_ids
        else:
            layer_ids = sorted({l for step in self._steps for l in step.layers})
        S, L, B, K = len(self._steps), len(layer_ids), len(self._columns), self.top_k
        topk = np.full((S, L, B, K), -1, dtype=np.int32)
        seq_lens = np.zeros((S, B), dtype=np.int32)
        for s, step in enumerate(self._steps):
            cols = np.fromiter(step.rows.keys(), dtype=np.int64, count=len(step.rows))
            rows = np.fromiter(step.rows.values(), dtype=np.int64, count=len(cols))
            seq_lens[s, cols] = step.seq_lens[rows]
            for li, layer_id in enumerate(layer_ids):
                if layer_id in step.layers:
                    topk[s, li, cols] = step.layers[layer_id][rows]
        request_ids = sorted(self._columns, key=self._columns.get)
        return NSATopkTrace(topk, seq_lens, layer_ids, request_ids, dict(self.metadata))

    def save(self, path: str, encoding: str = "auto") -> str:
        return save_trace(path, self.to_trace(), encoding=encoding)
