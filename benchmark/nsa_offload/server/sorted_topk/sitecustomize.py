"""Benchmark-only: a deterministic NSA top-k in every sglang process.

sglang's unfused top-k (``sgl_kernel.fast_topk_v2``, taken with
``SGLANG_NSA_FUSE_TOPK=0``) returns the selected positions in an order that
changes from run to run, and FlashMLA's output depends on that order (about
1e-3 when the same set is permuted). The set can change too: the indexer's
scores come from fp8 keys and queries, equal scores are common, and which of
the tied positions at the cut the radix select keeps is up to its atomics.
With weights that make attention matter, two identical requests to one
server then give different greedy tokens once a prompt is longer than the
top-k (2048). That is sglang's own behaviour, with or without the offload,
and it would hide what an exactness check is for.

With ``SGLANG_NSA_TOPK_SORTED=1`` and this directory first on ``PYTHONPATH``
(Python imports ``sitecustomize`` at every interpreter start, sglang's
spawned scheduler included), ``NSAIndexerMetadata.topk_transform`` first
picks each row's top-k itself, on a total order (score, then the lower
column), so that the set no longer depends on the kernel's tie handling;
then hands sglang's kernel the logits rewritten as 1 for the picked columns
and 0 for the others (the kernel keeps exactly the picked ones and keeps its
own output format); then sorts each returned row (``-1`` padding last), so
that the same set always comes in the same order, in prefill and in decode.
The offload keeps whatever positions and order it is given, so the check
still compares the offload's page tables with the no-offload server's.
"""

import importlib.abc
import importlib.machinery
import os
import sys

TARGET = "sglang.srt.layers.attention.nsa_backend"


def _sorted_rows(out):
    import torch

    big = torch.iinfo(out.dtype).max
    key = torch.where(out < 0, torch.full_like(out, big), out).sort(dim=-1).values
    return torch.where(key == big, torch.full_like(key, -1), key)


# Rows of logits keyed at once: bounds the int64 work tensors (~256 MB).
_KEY_ELEMS = 1 << 25


def _pick_topk_inplace(logits, topk, lengths, starts):
    """Rewrite ``logits`` [rows, cols] (fp32) in place as 1 at each row's
    ``topk`` largest scores among columns ``[start, start + length)`` and 0
    elsewhere. Ties go to the lower column: each key is (the score's bits in
    an order-preserving int32, then the inverted column), all distinct. Only
    shape-static torch ops: it runs inside sglang's CUDA graph captures."""
    import torch

    rows, cols = logits.shape
    if rows == 0 or cols == 0:
        return logits
    low = torch.iinfo(torch.int64).min
    col = torch.arange(cols, device=logits.device, dtype=torch.int64)
    inv_col = 0xFFFFFFFF - col
    k = min(topk, cols)
    step = max(1, _KEY_ELEMS // cols)
    for r0 in range(0, rows, step):
        part = logits[r0 : r0 + step]
        bits = part.contiguous().view(torch.int32).to(torch.int64)
        # IEEE floats order like their bits for >= 0; negative ones flip.
        key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        key = (key << 32) | inv_col
        start = starts[r0 : r0 + step].to(torch.int64).unsqueeze(1)
        end = start + lengths[r0 : r0 + step].to(torch.int64).unsqueeze(1)
        key = torch.where((col >= start) & (col < end), key, low)
        vals, idx = key.topk(k, dim=1)
        mask = torch.zeros_like(part)
        mask.scatter_(1, idx, (vals != low).to(part.dtype))
        part.copy_(mask)
    return logits


def _patch(module) -> None:
    import inspect

    import torch

    cls = module.NSAIndexerMetadata
    original = cls.topk_transform
    signature = inspect.signature(original)

    def topk_transform(self, logits, *args, **kwargs):
        if module.envs.SGLANG_NSA_FUSE_TOPK.get() and not self.force_unfused_topk:
            # fused: a page table comes back, not ours to touch
            return original(self, logits, *args, **kwargs)
        bound = signature.bind(self, logits, *args, **kwargs).arguments
        lengths = bound.get("ke_offset")
        if lengths is None:
            lengths = self.get_seqlens_expanded()
        starts = bound.get("ks")
        if starts is None:
            starts = torch.zeros_like(lengths)
        if logits.dtype == torch.float32:
            _pick_topk_inplace(logits, bound["topk"], lengths, starts)
        return _sorted_rows(original(self, logits, *args, **kwargs))

    cls.topk_transform = topk_transform


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("SGLANG_NSA_TOPK_SORTED") == "1":
    sys.meta_path.insert(0, _PatchOnImport())
