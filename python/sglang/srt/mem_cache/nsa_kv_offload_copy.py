"""Row copies between the pinned host KV pool and the GPU KV buffers.

Two Triton kernels move whole KV rows (one token of one layer) as machine
words (``word_bytes`` 4 or 8), ``block_rows`` rows per program with every
load of a tile issued before its stores:

* :func:`gather_rows`: the decode hot path, ``count[b]`` rows per batch row
  from a host buffer (read through UVA) into one layer's device buffer; fixed
  grid, counts read on the device (no host sync, CUDA-graph capturable).
* :func:`copy_rows_all_layers`: all layers in one launch through tables of
  layer base pointers (new-token and prefill backups, request warm-up).

Both run under ``TRITON_INTERPRET=1`` on CPU (host and device: CPU tensors).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

# Defaults tuned for the fp8 rows.
DEFAULT_WORD_BYTES = 4
DEFAULT_BLOCK_ROWS = 16
DEFAULT_NUM_WARPS = 4
DEFAULT_ALL_LAYER_BLOCK_ROWS = 8
# Gather grid cap (docs/ENGINE.md), each program looping over at most
# MAX_GATHER_ITERS tiles.
DEFAULT_MAX_GATHER_PROGRAMS = 1024
MAX_GATHER_ITERS = 8

# Layout of the int64 counters tensor the kernels add to (on the device).
COUNTER_H2D_ROWS = 0  # rows moved host -> device (one row = one token, one layer)
COUNTER_H2D_BYTES = 1
COUNTER_D2H_ROWS = 2  # rows moved device -> host
COUNTER_D2H_BYTES = 3
NUM_COUNTERS = 4

_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TL_WORD_DTYPES = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def pick_word_bytes(row_bytes: int, word_bytes: Optional[int] = None) -> int:
    """The widest word size (<= ``word_bytes`` if given) that divides a row."""
    if word_bytes is not None:
        if word_bytes not in _WORD_DTYPES or row_bytes % word_bytes != 0:
            raise ValueError(
                f"word_bytes={word_bytes} does not divide row_bytes={row_bytes}"
            )
        return word_bytes
    for wb in (DEFAULT_WORD_BYTES, 2, 1):
        if row_bytes % wb == 0:
            return wb
    return 1


def as_rows(buf: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """View a contiguous KV buffer of any dtype as ``(num_rows, row_bytes)`` uint8."""
    if not buf.is_contiguous():
        raise ValueError("KV buffers must be contiguous")
    if buf.dim() >= 2 and buf.shape[0] > 0 and buf[0].nbytes != row_bytes:
        raise ValueError(f"rows of {buf[0].nbytes} B, expected {row_bytes} B")
    if buf.nbytes % row_bytes != 0:
        raise ValueError(f"{buf.nbytes} B is not a whole number of {row_bytes} B rows")
    flat = buf.view(torch.uint8) if buf.dtype != torch.uint8 else buf
    return flat.view(-1, row_bytes)


def as_words(buf: torch.Tensor, row_bytes: int, word_bytes: int) -> torch.Tensor:
    """View a KV buffer as ``(num_rows, row_bytes // word_bytes)`` words."""
    rows = as_rows(buf, row_bytes)
    if word_bytes == 1:
        return rows
    return rows.view(_WORD_DTYPES[word_bytes])


def _split_row(row_words: int, split_tail: bool):
    """Column tiles of a row: a power-of-two head and a masked tail."""
    if not split_tail:
        return triton.next_power_of_2(row_words), 0
    head = 1 << (row_words.bit_length() - 1)
    if head == row_words:
        return head, 0
    return head, triton.next_power_of_2(row_words - head)


@triton.jit
def _copy_indexed_tiles(
    src_base,
    dst_base,
    src_idx_row,
    dst_idx_row,
    count,
    pid,
    nprog,
    ROW_WORDS: tl.constexpr,
    HEAD_COLS: tl.constexpr,
    TAIL_COLS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    NUM_ITERS: tl.constexpr,
):
    # Program pid copies tiles pid, pid + nprog, ... (NUM_ITERS); tiles past
    # count are skipped, their indices never read. A tile: a head of
    # HEAD_COLS words per row and an optional tail, loads before stores.
    for it in tl.static_range(NUM_ITERS):
        start = (pid + it * nprog) * BLOCK_ROWS
        if start < count:
            offs = start + tl.arange(0, BLOCK_ROWS)
            row_mask = offs < count
            src_rows = tl.load(src_idx_row + offs, mask=row_mask, other=0)
            dst_rows = tl.load(dst_idx_row + offs, mask=row_mask, other=0)
            src_rows = src_rows.to(tl.int64)
            dst_rows = dst_rows.to(tl.int64)
            cols = tl.arange(0, HEAD_COLS)
            src = src_base + src_rows[:, None] * ROW_WORDS + cols[None, :]
            dst = dst_base + dst_rows[:, None] * ROW_WORDS + cols[None, :]
            if HEAD_COLS > ROW_WORDS:
                mask = row_mask[:, None] & (cols[None, :] < ROW_WORDS)
            else:
                mask = row_mask[:, None] & (cols[None, :] < HEAD_COLS)
            if TAIL_COLS > 0:
                tcols = HEAD_COLS + tl.arange(0, TAIL_COLS)
                tsrc = src_base + src_rows[:, None] * ROW_WORDS + tcols[None, :]
                tdst = dst_base + dst_rows[:, None] * ROW_WORDS + tcols[None, :]
                tmask = row_mask[:, None] & (tcols[None, :] < ROW_WORDS)
                head = tl.load(src, mask=mask)
                tail = tl.load(tsrc, mask=tmask)
                tl.store(dst, head, mask=mask)
                tl.store(tdst, tail, mask=tmask)
            else:
                head = tl.load(src, mask=mask)
                tl.store(dst, head, mask=mask)


@triton.jit
def _count_rows(counters_ptr, COUNTER_IDX: tl.constexpr, rows, ROW_BYTES: tl.constexpr):
    # Rows and bytes moved, into the counters tensor (COUNTER_* layout).
    rows = rows.to(tl.int64)
    tl.atomic_add(counters_ptr + COUNTER_IDX, rows)
    tl.atomic_add(counters_ptr + COUNTER_IDX + 1, rows * ROW_BYTES)


@triton.jit
def _gather_rows_kernel(
    src_ptr,
    dst_ptr,
    src_idx_ptr,
    dst_idx_ptr,
    count_ptr,
    counters_ptr,
    src_idx_stride,
    dst_idx_stride,
    ROW_WORDS: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    HEAD_COLS: tl.constexpr,
    TAIL_COLS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    NUM_ITERS: tl.constexpr,
    STATS: tl.constexpr,
    COUNTER_IDX: tl.constexpr,
):
    b = tl.program_id(0)
    pid = tl.program_id(1)
    nprog = tl.num_programs(1)
    count = tl.load(count_ptr + b).to(tl.int32)

    if STATS:
        if pid == 0:
            _count_rows(counters_ptr, COUNTER_IDX, count, ROW_BYTES)

    _copy_indexed_tiles(
        src_ptr,
        dst_ptr,
        src_idx_ptr + b.to(tl.int64) * src_idx_stride,
        dst_idx_ptr + b.to(tl.int64) * dst_idx_stride,
        count,
        pid,
        nprog,
        ROW_WORDS,
        HEAD_COLS,
        TAIL_COLS,
        BLOCK_ROWS,
        NUM_ITERS,
    )


@triton.jit
def _copy_rows_all_layers_kernel(
    src_layer_ptrs,
    dst_layer_ptrs,
    src_idx_ptr,
    dst_idx_ptr,
    src_idx_layer_stride,
    dst_idx_layer_stride,
    count_ptr,
    num_rows,
    counters_ptr,
    WORD: tl.constexpr,
    NUM_LAYERS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    HEAD_COLS: tl.constexpr,
    TAIL_COLS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    NUM_ITERS: tl.constexpr,
    HAS_COUNT_PTR: tl.constexpr,
    STATS: tl.constexpr,
    COUNTER_IDX: tl.constexpr,
):
    # Axis 0 runs over row tiles (it may exceed 65535), axis 1 over layers.
    pid = tl.program_id(0)
    layer = tl.program_id(1)
    nprog = tl.num_programs(0)
    count = num_rows
    if HAS_COUNT_PTR:
        count = tl.minimum(tl.load(count_ptr).to(tl.int32), num_rows)

    if STATS:
        if pid == 0:
            if layer == 0:
                rows = count.to(tl.int64) * NUM_LAYERS
                _count_rows(counters_ptr, COUNTER_IDX, rows, ROW_BYTES)

    src_base = tl.load(src_layer_ptrs + layer).to(tl.pointer_type(WORD))
    dst_base = tl.load(dst_layer_ptrs + layer).to(tl.pointer_type(WORD))
    src_base = tl.multiple_of(src_base, 16)
    dst_base = tl.multiple_of(dst_base, 16)
    _copy_indexed_tiles(
        src_base,
        dst_base,
        src_idx_ptr + layer * src_idx_layer_stride,
        dst_idx_ptr + layer * dst_idx_layer_stride,
        count,
        pid,
        nprog,
        ROW_WORDS,
        HEAD_COLS,
        TAIL_COLS,
        BLOCK_ROWS,
        NUM_ITERS,
    )


def gather_rows(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    count: torch.Tensor,
    row_bytes: int,
    *,
    counters: Optional[torch.Tensor] = None,
    counter_idx: int = COUNTER_H2D_ROWS,
    word_bytes: Optional[int] = None,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    num_warps: int = DEFAULT_NUM_WARPS,
    programs_per_row: Optional[int] = None,
    split_tail: bool = True,
) -> None:
    """``dst[dst_idx[b, i]] = src[src_idx[b, i]]`` for ``i < count[b]``
    (``(bs,)`` on the device); ``src``/``dst`` viewable as ``(rows,
    row_bytes)``, ``src`` may be pinned host memory. ``counters``: rows and
    bytes added at ``counter_idx``; ``programs_per_row``: the second grid
    dimension (default: one tile each, capped, see module constants)."""
    bs, k = src_idx.shape
    assert dst_idx.shape == (bs, k), (src_idx.shape, dst_idx.shape)
    assert count.shape == (bs,), count.shape
    assert src_idx.stride(1) == 1 and dst_idx.stride(1) == 1
    if bs == 0 or k == 0:
        return
    wb = pick_word_bytes(row_bytes, word_bytes)
    src_w = as_words(src, row_bytes, wb)
    dst_w = as_words(dst, row_bytes, wb)
    row_words = row_bytes // wb
    head, tail = _split_row(row_words, split_tail)
    num_tiles = triton.cdiv(k, block_rows)
    if programs_per_row is None:
        programs_per_row = max(
            DEFAULT_MAX_GATHER_PROGRAMS // bs, triton.cdiv(num_tiles, MAX_GATHER_ITERS)
        )
    programs_per_row = max(1, min(programs_per_row, num_tiles))
    num_iters = triton.cdiv(num_tiles, programs_per_row)
    stats = counters is not None
    if stats:
        assert counters.dtype == torch.int64 and counters.numel() >= NUM_COUNTERS
    _gather_rows_kernel[(bs, programs_per_row)](
        src_w,
        dst_w,
        src_idx,
        dst_idx,
        count,
        counters if stats else count,
        src_idx.stride(0),
        dst_idx.stride(0),
        ROW_WORDS=row_words,
        ROW_BYTES=row_bytes,
        HEAD_COLS=head,
        TAIL_COLS=tail,
        BLOCK_ROWS=block_rows,
        NUM_ITERS=num_iters,
        STATS=stats,
        COUNTER_IDX=counter_idx,
        num_warps=num_warps,
    )


def layer_pointer_table(
    buffers, device: Union[str, torch.device], row_bytes: int
) -> torch.Tensor:
    """An int64 tensor of the base addresses of per-layer buffers, on ``device``."""
    ptrs = [as_rows(buf, row_bytes).data_ptr() for buf in buffers]  # validates
    for p in ptrs:
        if p % 16 != 0:
            raise ValueError(f"layer buffer at {p:#x} is not 16-byte aligned")
    return torch.tensor(ptrs, dtype=torch.int64, device=device)


def copy_rows_all_layers(
    src_layer_ptrs: torch.Tensor,
    dst_layer_ptrs: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    row_bytes: int,
    *,
    count: Optional[torch.Tensor] = None,
    counters: Optional[torch.Tensor] = None,
    counter_idx: int = COUNTER_D2H_ROWS,
    word_bytes: Optional[int] = None,
    block_rows: int = DEFAULT_ALL_LAYER_BLOCK_ROWS,
    num_warps: int = DEFAULT_NUM_WARPS,
    programs_per_layer: Optional[int] = None,
    split_tail: bool = True,
) -> None:
    """``dst_l[dst_idx[i]] = src_l[src_idx[i]]`` for every layer ``l`` in one
    launch; ``*_layer_ptrs``: ``(L,)`` int64 16-byte aligned layer bases on
    the device; indices ``(n,)`` or ``(L, n)``; ``count`` (1-element device
    tensor): only ``min(count, n)`` entries; ``counters``: rows (all layers)
    and bytes added at ``counter_idx``."""
    num_layers = src_layer_ptrs.numel()
    assert dst_layer_ptrs.numel() == num_layers
    assert src_layer_ptrs.dtype == torch.int64 and dst_layer_ptrs.dtype == torch.int64
    n = src_idx.shape[-1]
    assert dst_idx.shape[-1] == n, (src_idx.shape, dst_idx.shape)
    for idx in (src_idx, dst_idx):
        assert idx.dim() in (1, 2) and idx.stride(-1) == 1
        assert idx.dim() == 1 or idx.shape[0] == num_layers
    if n == 0 or num_layers == 0:
        return
    src_layer_stride = src_idx.stride(0) if src_idx.dim() == 2 else 0
    dst_layer_stride = dst_idx.stride(0) if dst_idx.dim() == 2 else 0
    wb = pick_word_bytes(row_bytes, word_bytes)
    row_words = row_bytes // wb
    head, tail = _split_row(row_words, split_tail)
    num_tiles = triton.cdiv(n, block_rows)
    if programs_per_layer is None:
        programs_per_layer = num_tiles
    programs_per_layer = max(1, min(programs_per_layer, num_tiles))
    num_iters = triton.cdiv(num_tiles, programs_per_layer)
    stats = counters is not None
    _copy_rows_all_layers_kernel[(programs_per_layer, num_layers)](
        src_layer_ptrs,
        dst_layer_ptrs,
        src_idx,
        dst_idx,
        src_layer_stride,
        dst_layer_stride,
        count if count is not None else src_idx,
        n,
        counters if stats else src_layer_ptrs,
        WORD=_TL_WORD_DTYPES[wb],
        NUM_LAYERS=num_layers,
        ROW_WORDS=row_words,
        ROW_BYTES=row_bytes,
        HEAD_COLS=head,
        TAIL_COLS=tail,
        BLOCK_ROWS=block_rows,
        NUM_ITERS=num_iters,
        HAS_COUNT_PTR=count is not None,
        STATS=stats,
        COUNTER_IDX=counter_idx,
        num_warps=num_warps,
    )


def copy_kernels_interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``
    at import)."""
    return not isinstance(_gather_rows_kernel, triton.JITFunction)


def gather_rows_reference(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    count: torch.Tensor,
    row_bytes: int,
    counters: Optional[torch.Tensor] = None,
    counter_idx: int = COUNTER_H2D_ROWS,
) -> None:
    """Pure-torch :func:`gather_rows`, counters included (syncs; CPU)."""
    src_r = as_rows(src, row_bytes)
    dst_r = as_rows(dst, row_bytes)
    if counters is not None:
        n = int(count.clamp(min=0).sum())
        counters[counter_idx] += n
        counters[counter_idx + 1] += n * row_bytes
    for b, c in enumerate(count.tolist()):
        if c <= 0:
            continue
        s = src_idx[b, :c].to(device=src_r.device, dtype=torch.int64)
        d = dst_idx[b, :c].to(device=dst_r.device, dtype=torch.int64)
        dst_r.index_copy_(0, d, src_r.index_select(0, s).to(dst_r.device))


def copy_rows_all_layers_reference(
    src_layers,
    dst_layers,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    row_bytes: int,
    count: Optional[Union[torch.Tensor, int]] = None,
    counters: Optional[torch.Tensor] = None,
    counter_idx: int = COUNTER_D2H_ROWS,
) -> None:
    """Pure-torch :func:`copy_rows_all_layers` over lists of layer buffers,
    counters included (syncs; CPU runs without Triton)."""
    n = src_idx.shape[-1]
    if count is not None:
        n = min(n, int(count.reshape(-1)[0]) if torch.is_tensor(count) else count)
    if counters is not None:
        counters[counter_idx] += n * len(src_layers)
        counters[counter_idx + 1] += n * len(src_layers) * row_bytes
    if n <= 0:
        return
    for layer, (src, dst) in enumerate(zip(src_layers, dst_layers)):
        src_r = as_rows(src, row_bytes)
        dst_r = as_rows(dst, row_bytes)
        s = src_idx[layer] if src_idx.dim() == 2 else src_idx
        d = dst_idx[layer] if dst_idx.dim() == 2 else dst_idx
        s = s[:n].to(device=src_r.device, dtype=torch.int64)
        d = d[:n].to(device=dst_r.device, dtype=torch.int64)
        dst_r.index_copy_(0, d, src_r.index_select(0, s).to(dst_r.device))
