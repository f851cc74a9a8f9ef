"""Pinned host memory holding the MLA KV of every token of a DSA (NSA) model.

Decode-side KV offload keeps the full MLA KV of all tokens in host memory and
only a small working set per request on the GPU. This pool is that host
memory: KV only (the indexer keys stay on the GPU), layer-first, one row of
``row_bytes`` per token per layer, indexed by token loc (host slot == token
loc, so no second allocator or table is needed).

``kv_buffer`` has shape ``(layer_num, size + page_size, row_bytes)`` uint8, the
same row count as the device ``NSATokenToKVPool.kv_buffer`` of a pool of
``size`` tokens, so a page of tokens is contiguous in host memory exactly as on
the GPU and a PD transfer can land pages straight here
(:meth:`get_contiguous_buf_infos`).

The memory is page-locked (``cudaHostRegister`` by default, or torch's pinned
allocator) so GPU kernels read it directly through unified virtual addressing.
Without CUDA it falls back to ordinary memory (CPU tests). The ranks of an
attention-TP group hold the same KV: they give the pool one shared segment
(``nsa_kv_offload_shared_host``), which each rank page-locks in its process.

This class holds memory and describes it; it has no policy (what to keep,
when to copy: see ``SparseCacheController``).
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
    """Write one byte of every page of ``buffer`` (contiguous, uint8, its
    contents undefined), the pages split across ``num_threads`` threads.

    ``cudaHostRegister`` of a fresh allocation faults every page in itself,
    in one thread (the kernel zero-fills each page first): ~35 s for the
    84 GB pool of a rank server. Faulted here in parallel, the register only
    locks pages that are present. Not for memory another process may have
    written (a shared segment): the writes would overwrite its data. The
    threads inherit the process' CPU affinity, so with the process bound to
    a NUMA node (``--numa-node``) the pages land there, as the register's do.
    """
    if page_bytes is None:
        page_bytes = os.sysconf("SC_PAGE_SIZE")
    flat = buffer.view(-1)
    num_pages = (flat.numel() + page_bytes - 1) // page_bytes
    num_threads = max(1, min(num_threads, num_pages))
    per_thread = (num_pages + num_threads - 1) // num_threads

    def touch(first_page: int) -> None:
        start = first_page * page_bytes
        stop = min(flat.numel(), (first_page + per_thread) * page_bytes)
        # torch releases the GIL in fill_: the threads fault in parallel.
        flat[start:stop:page_bytes].fill_(0)

    with ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(touch, range(0, num_pages, per_thread)))


class NSAKVOnlyTokenToKVPoolHost:
    """Layer-first pinned host KV rows for every token loc.

    Args:
        size: number of token locs (rounded up to a multiple of ``page_size``).
            Valid locs are ``[0, size + page_size)``, as in the device pool.
        page_size: token page size of the device pool (64 for NSA).
        layer_num: layers held (those of this pipeline rank).
        row_bytes: bytes of one token's KV in one layer (656 for the fp8
            FlashMLA layout, 1152 for bf16); see :meth:`get_row_bytes`.
        start_layer: global id of the first layer held (layer ids passed to the
            accessors are global, as in the device pool).
        pin_memory: page-lock the buffer (ignored without CUDA).
        pin_method: ``"register"`` (``cudaHostRegister`` on an ordinary
            allocation; no rounding of the size), ``"torch"`` (torch's pinned
            host allocator, which may round large sizes up to a power of two)
            or ``"none"``.
        shared_segment: memory shared with the other ranks of an attention-TP
            group (``layout.shape`` must be this pool's buffer shape, see
            :meth:`buffer_shape`), used instead of a private allocation and
            registered in this process (``pin_method="register"`` or
            ``"none"``).
    """

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
        self.size_per_token = self.get_size_per_token()

        if not pin_memory or not torch.cuda.is_available():
            pin_method = "none"
        self.pin_method = pin_method
        self._registered = False

        self.kv_buffer = self._alloc_buffer()
        self.pin_memory = self.is_pinned()

        # Per-layer views (num_rows, row_bytes) and their base addresses.
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

    # ---- construction helpers -------------------------------------------------

    @staticmethod
    def get_row_bytes(kv_cache_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one token's KV in one layer of the device pool.

        ``kv_cache_dim`` and ``dtype`` are the device pool's ``kv_cache_dim`` and
        ``store_dtype`` (fp8: 656 x uint8; bf16: 576 x bfloat16 = 1152 B).
        """
        return kv_cache_dim * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def buffer_shape(
        size: int, page_size: int, layer_num: int, row_bytes: int
    ) -> Tuple[int, int, int]:
        """``kv_buffer`` shape of a pool of ``size`` token locs."""
        num_rows = (size + page_size - 1) // page_size * page_size + page_size
        return (layer_num, num_rows, row_bytes)

    @staticmethod
    def bytes_per_token(layer_num: int, row_bytes: int) -> int:
        """Host bytes of one token over all layers."""
        return layer_num * row_bytes

    @classmethod
    def num_tokens_for_gb(
        cls, host_gb: float, layer_num: int, row_bytes: int, page_size: int
    ) -> int:
        """How many token locs (a multiple of ``page_size``) fit in ``host_gb`` GB.

        Accounts for the extra page of rows the buffer carries.
        """
        per_token = cls.bytes_per_token(layer_num, row_bytes)
        pages = int(host_gb * 1e9) // (per_token * page_size) - 1
        return max(pages, 0) * page_size

    @classmethod
    def from_device_pool(
        cls,
        device_pool,
        size: Optional[int] = None,
        host_gb: Optional[float] = None,
        pin_memory: bool = True,
        pin_method: str = "register",
    ) -> "NSAKVOnlyTokenToKVPoolHost":
        """Build the host pool matching an ``NSATokenToKVPool`` (or an object with
        ``layer_num``, ``kv_cache_dim``, ``store_dtype``, ``page_size`` and
        ``start_layer``). Give either ``size`` (token locs) or ``host_gb``."""
        row_bytes = cls.get_row_bytes(device_pool.kv_cache_dim, device_pool.store_dtype)
        if size is None:
            if host_gb is None:
                raise ValueError("give size or host_gb")
            size = cls.num_tokens_for_gb(
                host_gb, device_pool.layer_num, row_bytes, device_pool.page_size
            )
        return cls(
            size=size,
            page_size=device_pool.page_size,
            layer_num=device_pool.layer_num,
            row_bytes=row_bytes,
            start_layer=getattr(device_pool, "start_layer", 0) or 0,
            pin_memory=pin_memory,
            pin_method=pin_method,
        )

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

    # ---- description -----------------------------------------------------------

    def get_size_per_token(self) -> int:
        """Host bytes of one token over all layers of this pool."""
        return self.bytes_per_token(self.layer_num, self.row_bytes)

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token()

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
        """int64 base address of every layer, as a tensor on ``device``.

        Feed it to all-layer kernels (``copy_rows_all_layers``); the copy per
        device is cached.
        """
        if device is None or torch.device(device).type == "cpu":
            return self.layer_ptrs
        key = str(torch.device(device))
        if key not in self._layer_ptrs_on:
            self._layer_ptrs_on[key] = self.layer_ptrs.to(device)
        return self._layer_ptrs_on[key]

    def get_contiguous_buf_infos(self) -> Tuple[List[int], List[int], List[int]]:
        """``(data_ptrs, data_lens, item_lens)`` per layer, in the format of the
        device pool's ``get_contiguous_buf_infos`` (one item = one page of rows),
        for registering the host memory as a PD transfer target."""
        data_ptrs = [int(p) for p in self.layer_ptrs.tolist()]
        data_lens = [x.nbytes for x in self.data_refs]
        item_lens = [self.row_bytes * self.page_size] * self.layer_num
        return data_ptrs, data_lens, item_lens

    def get_buffer_infos(self) -> Tuple[List[int], List[int], List[int]]:
        return self.get_contiguous_buf_infos()

    def get_page_ptr(self, layer_id: int, page_index: int) -> int:
        """Host address of page ``page_index`` (token locs
        ``[page_index * page_size, (page_index + 1) * page_size)``) of a layer."""
        if not 0 <= page_index < self.page_num + 1:
            raise IndexError(f"page {page_index} outside [0, {self.page_num}]")
        base = int(self.layer_ptrs[self._local_layer(layer_id)])
        return base + page_index * self.page_size * self.row_bytes

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, "
            f"layers={self.layer_num}, row_bytes={self.row_bytes}, "
            f"{self.nbytes / 1e9:.2f} GB, pinned={self.pin_memory})"
        )
