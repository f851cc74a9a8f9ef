"""Benchmark-only: a deterministic NSA top-k order in every sglang process.

sglang's unfused top-k (``sgl_kernel.fast_topk_v2``, taken with
``SGLANG_NSA_FUSE_TOPK=0``) returns the selected positions in an order that
changes from run to run, and FlashMLA's output depends on that order (about
1e-3 when the same set is permuted). With weights that make attention
matter, two identical requests to one server then give different greedy
tokens once a prompt is longer than the top-k (2048). That is sglang's own
behaviour, with or without the offload, and it would hide what an exactness
check is for. With ``SGLANG_NSA_TOPK_SORTED=1`` and this directory first on
``PYTHONPATH`` (Python imports ``sitecustomize`` at every interpreter start,
sglang's spawned scheduler included), ``NSAIndexerMetadata.topk_transform``
sorts each row of the positions it returns (``-1`` padding last): the same
set then always comes in the same order, in prefill and in decode. The set
itself can change too: the indexer's scores come from fp8 keys and queries,
equal scores are common, and which of the tied positions at the cut the
radix select keeps is up to its atomics. So the lowest 8 mantissa bits of
every finite score (2**-15 relative) are first replaced by a fixed function
of the column, which breaks every tie the same way in every run. The offload
keeps whatever positions and order it is given, so the check still compares
the offload's page tables with the no-offload server's.
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


def _ties_broken(logits):
    import torch

    if logits.dtype != torch.float32:
        return logits
    col = torch.arange(logits.shape[-1], device=logits.device, dtype=torch.int32)
    low = (col * 37) & 0xFF
    bits = (logits.contiguous().view(torch.int32) & ~0xFF) | low
    return torch.where(torch.isfinite(logits), bits.view(torch.float32), logits)


def _patch(module) -> None:
    cls = module.NSAIndexerMetadata
    original = cls.topk_transform

    def topk_transform(self, logits, *args, **kwargs):
        if module.envs.SGLANG_NSA_FUSE_TOPK.get() and not self.force_unfused_topk:
            # fused: a page table comes back, not ours to touch
            return original(self, logits, *args, **kwargs)
        return _sorted_rows(original(self, _ties_broken(logits), *args, **kwargs))

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
