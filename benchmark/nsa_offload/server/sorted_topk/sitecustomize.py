"""Benchmark-only: a deterministic NSA top-k in every sglang process.

sglang's unfused top-k (``sgl_kernel.fast_topk_v2``, taken with
``SGLANG_DSA_FUSE_TOPK=0``) returns the selected positions in an order that
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
spawned scheduler included), ``DSAIndexerMetadata.topk_transform`` runs
sglang's kernel, takes the smallest score it picked as the row's k-th
largest (checked by counting; where the kernel was wrong, which it is on
some long rows, from a full selection: ``_pick_topk_inplace``), keeps every
score above it and, of those equal to it, the lower columns, so that the set
is the top-k on a total order (score, then the lower column); then hands the
kernel the logits rewritten as 1 for those columns and 0 for the others (it
keeps exactly them, in its own output format) and sorts each returned row
(``-1`` padding last), so that the same set always comes in the same order,
in prefill and in decode.
The offload keeps whatever positions and order it is given, so the check
still compares the offload's page tables with the no-offload server's.
"""

import importlib.abc
import importlib.machinery
import os
import sys

# The module defining the indexer metadata class (sglang 0.5.17 and 0.5.23).
TARGET = "sglang.srt.layers.attention.dsa.dsa_indexer_metadata"


def _sorted_rows(out):
    import torch

    big = torch.iinfo(out.dtype).max
    key = torch.where(out < 0, torch.full_like(out, big), out).sort(dim=-1).values
    return torch.where(key == big, torch.full_like(key, -1), key)


# Rows of logits handled at once: bounds the work tensors (~512 MB).
_CHUNK_ELEMS = 1 << 26


def _exact_kth(part, valid, topk):
    """Each row's k-th largest valid score (-inf where fewer are valid), by
    a full selection: the fallback for rows the kernel got wrong."""
    import torch

    k = min(topk, part.shape[1])
    masked = torch.where(valid, part, float("-inf"))
    return masked.topk(k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)


def _in_graph_capture(t) -> bool:
    import torch

    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _pick_topk_inplace(logits, topk, lengths, starts, picked):
    """Rewrite ``logits`` [rows, cols] (fp32) in place as 1 at each row's
    deterministic top-k among columns ``[start, start + length)`` and 0
    elsewhere, given ``picked`` [rows, topk], the positions (relative to the
    row's start, -1 padding) sglang's kernel returned.

    Where the kernel is exact, its smallest picked score is the row's k-th
    largest ``v`` (``#(> v) < k <= #(>= v)``): every valid score above it is
    in any top-k, and of the scores equal to it the lower columns fill the
    rest, a few elementwise passes. It is not always exact: its refining
    passes keep at most 16384 candidates of the coarse (fp16, 8-bit) bin at
    the cut and drop the rest in atomic order, so on long rows (seen from
    ~30K columns) it can miss larger scores, run to run differently. Rows
    failing the test above get ``v`` from a full selection instead: in
    eager mode (prefill) only those rows, after one host sync; inside a CUDA
    graph capture (decode, few rows) every row, unconditionally."""
    import torch

    rows, cols = logits.shape
    if rows == 0 or cols == 0:
        return logits
    col = torch.arange(cols, device=logits.device, dtype=torch.int64)
    capturing = _in_graph_capture(logits)
    step = max(1, _CHUNK_ELEMS // cols)
    for r0 in range(0, rows, step):
        part = logits[r0 : r0 + step]
        start = starts[r0 : r0 + step].to(torch.int64).unsqueeze(1)
        end = start + lengths[r0 : r0 + step].to(torch.int64).unsqueeze(1)
        pos = picked[r0 : r0 + step].to(torch.int64)
        at = (start + pos.clamp(min=0)).clamp(max=cols - 1)
        vals = torch.where(pos >= 0, part.gather(1, at), float("inf"))
        kth = vals.amin(dim=1, keepdim=True)
        valid = (col >= start) & (col < end)
        k_row = (end - start).clamp(min=0, max=topk)
        n_above = (valid & (part > kth)).sum(dim=1, keepdim=True)
        n_at_least = (valid & (part >= kth)).sum(dim=1, keepdim=True)
        exact = (n_above < k_row) & (n_at_least >= k_row) | (k_row == 0)
        if capturing:
            kth = torch.where(exact, kth, _exact_kth(part, valid, topk))
        else:
            wrong = torch.nonzero(~exact.squeeze(1)).squeeze(1)
            if wrong.numel():
                _count_refined(int(wrong.numel()))
                kth[wrong] = _exact_kth(part[wrong], valid[wrong], topk)
        above = valid & (part > kth)
        tied = valid & (part == kth)
        need = topk - above.sum(dim=1, keepdim=True)
        keep = above | (tied & (tied.cumsum(dim=1, dtype=torch.int32) <= need))
        part.copy_(keep.to(part.dtype))
    return logits


# Rows whose k-th score the kernel got wrong (eager calls only), for the log.
_stats = {"rows_refined": 0, "logged_at": 0}


def _count_refined(n: int) -> None:
    _stats["rows_refined"] += n
    total = _stats["rows_refined"]
    if total >= 2 * _stats["logged_at"]:  # first time, then at each doubling
        _stats["logged_at"] = total
        print(
            f"[sorted_topk] rows whose k-th score sglang's top-k got wrong, "
            f"refined so far: {total}",
            file=sys.stderr,
            flush=True,
        )


def _patch(module, fuse_flag) -> None:
    """Wrap ``module.DSAIndexerMetadata.topk_transform``; ``fuse_flag()``
    tells whether sglang's fused top-k is on."""
    import inspect

    import torch

    cls = module.DSAIndexerMetadata
    original = cls.topk_transform
    signature = inspect.signature(original)

    def topk_transform(self, logits, *args, **kwargs):
        if fuse_flag() and not self.force_unfused_topk:
            # fused: a page table comes back, not ours to touch
            return original(self, logits, *args, **kwargs)
        if logits.dtype != torch.float32:
            return _sorted_rows(original(self, logits, *args, **kwargs))
        bound = signature.bind(self, logits, *args, **kwargs).arguments
        lengths = bound.get("ke_offset")
        if lengths is None:
            lengths = self.get_seqlens_expanded()
        starts = bound.get("ks")
        if starts is None:
            starts = torch.zeros_like(lengths)
        picked = original(self, logits, *args, **kwargs)
        _pick_topk_inplace(logits, bound["topk"], lengths, starts, picked)
        # The kernel keeps exactly the columns set to 1; sorted, in the same
        # order in every run.
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
            from sglang.srt.environ import envs

            _patch(module, envs.SGLANG_DSA_FUSE_TOPK.get)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("SGLANG_NSA_TOPK_SORTED") == "1":
    sys.meta_path.insert(0, _PatchOnImport())
