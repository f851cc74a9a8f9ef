"""Pinned host memory holding the MLA KV of every token of a DSA (NSA) model.

KV only (the indexer keys stay on the GPU), layer-first, one ``row_bytes`` row
per token per layer, indexed by token loc (host slot == token loc).
``kv_buffer`` is ``(layer_num, size + page_size, row_bytes)`` uint8, the rows
of the device ``DSATokenToKVPool.kv_buffer``, so a PD transfer can land pages
here (:meth:`get_contiguous_buf_infos`). Page-locked (``cudaHostRegister`` or
torch's pinned allocator) for GPU reads through UVA; ordinary memory without
CUDA. Attention-TP ranks share one segment (``nsa_kv_offload_shared_host``).
Memory and its description only; the policy is ``SparseCacheController``'s.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.nsa_kv_offload_shared_host import SharedHostSegment

logger = logging.getLogger(__name__)

PIN_METHODS = ("register", "torch", "none")

# Below this a buffer is page-locked without the threaded pre-fault.
PREFAULT_MIN_BYTES = 1 << 30


def prefault_pages(
    buffer: torch.Tensor, num_threads: int, page_bytes: Optional[int] = None
) -> None:
    """Write one byte of every page of ``buffer`` (contiguous uint8, contents
    undefined, no other process' data) from ``num_threads`` threads, so
    ``cudaHostRegister`` finds the pages present (docs/ENGINE.md)."""
    if page_bytes is None:
        page_bytes = os.sysconf("SC_PAGE_SIZE")
    flat = buffer.view(-1)
    num_pages = (flat.numel() + page_bytes - 1) // page_bytes
    num_threads = max(1, min(num_threads, num_pages))
    per_thread = (num_pages + num_threads - 1) // num_threads

    def touch(first_page: int) -> None:
        start = first_page * page_bytes
        stop = min(flat.numel(), (first_page + per_thread) * page_bytes)
        # fill_ releases the GIL: the threads fault in parallel.
        flat[start:stop:page_bytes].fill_(0)

    with ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(touch, range(0, num_pages, per_thread)))


class NSAKVOnlyTokenToKVPoolHost:
    """Layer-first pinned host KV rows for token locs ``[0, size +
    page_size)`` (``size`` rounded up to pages) of layers ``start_layer ..``
    (global ids). ``pin_method``: ``"register"`` (``cudaHostRegister``),
    ``"torch"`` (may round up to a power of two) or ``"none"``;
    ``shared_segment`` (shape :meth:`buffer_shape`) replaces the allocation."""

    def __init__(
        self,
        size: int,
        page_size: int,
        layer_num: int,
        row_bytes: int,
        start_layer: int = 0,
        pin_memory: bool = True,
        pin_method: str = "register",
        shared_segment: Optional[SharedHostSegment] = None,
    ):
        if size <= 0 or page_size <= 0 or layer_num <= 0 or row_bytes <= 0:
            raise ValueError(
                f"invalid host pool shape: size={size} page_size={page_size} "
                f"layer_num={layer_num} row_bytes={row_bytes}"
            )
        if row_bytes % 16 != 0:
            raise ValueError(f"row_bytes={row_bytes} must be a multiple of 16")
        if pin_method not in PIN_METHODS:
            raise ValueError(f"pin_method must be one of {PIN_METHODS}")
        if shared_segment is not None:
            if pin_method == "torch":
                raise ValueError("a shared segment is pinned with pin_method=register")
            shape = self.buffer_shape(size, page_size, layer_num, row_bytes)
            if tuple(shared_segment.layout.shape) != shape:
                raise ValueError(
                    f"shared segment rows {shared_segment.layout.shape} != {shape}"
                )
        self.shared_segment = shared_segment

        self.page_size = page_size
        self.page_num = (size + page_size - 1) // page_size
        self.size = self.page_num * page_size
        self.layer_num = layer_num
        self.start_layer = start_layer
        self.end_layer = start_layer + layer_num - 1
        self.row_bytes = row_bytes
        self.device = "cpu"
        self.num_rows = self.size + page_size

        if not pin_memory or not torch.cuda.is_available():
            pin_method = "none"
        self.pin_method = pin_method
        self._registered = False

        self.kv_buffer = self._alloc_buffer()
        self.pin_memory = self.is_pinned()

        self.data_refs: List[torch.Tensor] = [
            self.kv_buffer[i] for i in range(self.layer_num)
        ]
        self.layer_ptrs = torch.tensor(
            [x.data_ptr() for x in self.data_refs], dtype=torch.int64
        )
        self._layer_ptrs_on = {}

        logger.info(
            "NSA KV-only host pool: %d tokens x %d layers x %d B = %.2f GB (%s%s)",
            self.size,
            self.layer_num,
            self.row_bytes,
            self.kv_buffer.nbytes / 1e9,
            "pinned via " + pin_method if self.pin_memory else "not pinned",
            ", shared" if shared_segment is not None else "",
        )

    @staticmethod
    def get_row_bytes(kv_cache_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one token's KV in one layer, from the device pool's
        ``kv_cache_dim`` and ``store_dtype``."""
        return kv_cache_dim * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def buffer_shape(
        size: int, page_size: int, layer_num: int, row_bytes: int
    ) -> Tuple[int, int, int]:
        """``kv_buffer`` shape of a pool of ``size`` token locs."""
        num_rows = (size + page_size - 1) // page_size * page_size + page_size
        return (layer_num, num_rows, row_bytes)

    def _alloc_buffer(self) -> torch.Tensor:
        dims = (self.layer_num, self.num_rows, self.row_bytes)
        if self.shared_segment is not None:
            buffer = self.shared_segment.tensor()
        elif self.pin_method == "torch":
            return torch.empty(dims, dtype=torch.uint8, pin_memory=True)
        else:
            buffer = torch.empty(dims, dtype=torch.uint8)
            if self.pin_method == "register" and buffer.nbytes >= PREFAULT_MIN_BYTES:
                prefault_pages(buffer, min(16, os.cpu_count() or 1))
        if self.pin_method == "register":
            err = torch.cuda.cudart().cudaHostRegister(
                buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0
            )
            if int(err) != 0:
                raise RuntimeError(
                    f"cudaHostRegister of {buffer.nbytes / 1e9:.2f} GB failed "
                    f"with error {int(err)}"
                )
            self._registered = True
        return buffer

    def close(self) -> None:
        """Unregister the page lock (only for ``pin_method="register"``)."""
        if self._registered:
            self._registered = False
            torch.cuda.cudart().cudaHostUnregister(self.kv_buffer.data_ptr())

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def get_size_per_token(self) -> int:
        """Host bytes of one token over all layers of this pool."""
        return self.layer_num * self.row_bytes

    @property
    def nbytes(self) -> int:
        return self.kv_buffer.nbytes

    def is_pinned(self) -> bool:
        if self.pin_method == "none":
            return False
        if self.pin_method == "register":
            return self._registered
        return self.kv_buffer.is_pinned()

    def _local_layer(self, layer_id: int) -> int:
        idx = layer_id - self.start_layer
        if not 0 <= idx < self.layer_num:
            raise IndexError(
                f"layer {layer_id} outside [{self.start_layer}, {self.end_layer}]"
            )
        return idx

    def get_kv_buffer(self, layer_id: int) -> torch.Tensor:
        """``(size + page_size, row_bytes)`` uint8 view of one (global) layer."""
        return self.data_refs[self._local_layer(layer_id)]

    def get_layer_ptrs(self, device=None) -> torch.Tensor:
        """int64 base address of every layer on ``device`` (cached), for
        ``copy_rows_all_layers``."""
        if device is None or torch.device(device).type == "cpu":
            return self.layer_ptrs
        key = str(torch.device(device))
        if key not in self._layer_ptrs_on:
            self._layer_ptrs_on[key] = self.layer_ptrs.to(device)
        return self._layer_ptrs_on[key]

    def get_contiguous_buf_infos(self) -> Tuple[List[int], List[int], List[int]]:
        """``(data_ptrs, data_lens, item_lens)`` per layer as the device pool's
        ``get_contiguous_buf_infos`` (item = page): a PD transfer target."""
        data_ptrs = [int(p) for p in self.layer_ptrs.tolist()]
        data_lens = [x.nbytes for x in self.data_refs]
        item_lens = [self.row_bytes * self.page_size] * self.layer_num
        return data_ptrs, data_lens, item_lens
