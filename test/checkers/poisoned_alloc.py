"""Uninitialized memory: zeros on the CPU, leftovers on CUDA (test tooling).

A fresh ``torch.empty`` on the CPU is often zero (new pages); on CUDA the
caching allocator hands back whatever the last tensor left there. Code that
reads an element it never wrote passes the CPU tests by luck and may read
garbage on the GPU. :class:`PoisonedAlloc` fills every uninitialized
allocation (``empty``, ``empty_like``, ``new_empty``, ...) made while it is
active with a byte pattern (``0xFF``: -1 in every integer type, NaN in the
floats; ``0x5A``: large positives), so such a read changes what follows.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_UNINITIALIZED = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}


class PoisonedAlloc(TorchDispatchMode):
    """Every uninitialized allocation filled with ``byte`` (``allocations``
    counts them by dtype)."""

    def __init__(self, byte: int = 0xFF):
        super().__init__()
        if not 0 <= byte <= 0xFF:
            raise ValueError(f"byte {byte} is not a byte")
        self.byte = byte
        self.allocations = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _UNINITIALIZED and out.numel():
            self.allocations[str(out.dtype)] += 1
            if out.dtype == torch.bool:
                # Only 0 and 1 are bools: a stray True.
                out.fill_(True)
            else:
                storage = out.untyped_storage()
                raw = torch.empty(0, dtype=torch.uint8, device=out.device)
                raw.set_(storage, 0, (storage.nbytes(),))
                raw.fill_(self.byte)
        return out
