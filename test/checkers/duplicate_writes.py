"""Which of several writes to one element wins: CPU vs CUDA (test tooling).

``x[idx] = v``, ``scatter_`` and ``index_copy_`` with a repeated destination
write it once per entry. On the CPU the entries are applied in order, so the
last one wins every time; on CUDA the winner is unspecified. Code that relies
on the CPU's order passes every CPU test and reads wrong state on the GPU.

:class:`DuplicateWriteOrder` intercepts those ops (``TorchDispatchMode``),
resolves every repeated destination itself with another winner (the first
entry, or one picked at random), and counts the destinations whose entries
disagree (``conflicts``, per op and caller). Running a test under it shows
whether anything depends on the CPU's order: the test fails where it does,
and ``conflicts`` names the op.
"""

from __future__ import annotations

import collections
import traceback
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# op -> (in place, kind)
_OPS = {
    aten.index_put_.default: (True, "index_put"),
    aten._index_put_impl_.default: (True, "index_put"),
    aten.index_put.default: (False, "index_put"),
    aten.scatter_.src: (True, "scatter"),
    aten.scatter_.value: (True, "scatter"),
    aten.scatter.src: (False, "scatter"),
    aten.scatter.value: (False, "scatter"),
    aten.index_copy_.default: (True, "index_copy"),
    aten.index_copy.default: (False, "index_copy"),
}


def _destinations(kind: str, self: torch.Tensor, args) -> tuple:
    """``(dest, values)``: the flat element of ``self`` each entry writes and
    its value, both shaped like the entries; None for an accumulating write
    (its order does not matter)."""
    ids = torch.arange(self.numel(), device=self.device).view(self.shape)
    if kind == "index_put":
        indices, values = args[1], args[2]
        accumulate = args[3] if len(args) > 3 else False
        if accumulate:
            return None
        key = tuple(slice(None) if i is None else i for i in indices)
        dest = ids[key]
        return dest, values.expand(dest.shape)
    dim, index = args[1], args[2]
    if kind == "scatter":
        dest = ids.gather(dim, index)
        src = args[3]
        if isinstance(src, torch.Tensor):
            values = src[tuple(slice(0, s) for s in index.shape)]
        else:
            values = torch.full(index.shape, src, dtype=self.dtype, device=self.device)
        return dest, values
    # index_copy
    dest = ids.index_select(dim, index)
    return dest, args[3].expand(dest.shape)


class DuplicateWriteOrder(TorchDispatchMode):
    """Repeated destinations of indexed writes get another winner than the
    CPU's last entry: ``winner="first"``, or ``"random"`` (``seed``)."""

    def __init__(self, winner: str = "first", seed: int = 0):
        super().__init__()
        if winner not in ("first", "random"):
            raise ValueError(f"winner must be 'first' or 'random', not {winner!r}")
        self.winner = winner
        self.gen = torch.Generator().manual_seed(seed)
        # (op, caller) -> destinations whose entries disagree
        self.conflicts = collections.Counter()
        # op -> writes seen with a repeated destination
        self.repeated = collections.Counter()
        self.writes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _OPS:
            return func(*args, **(kwargs or {}))
        # Positional from here on, defaults filled in.
        args = list(args) + [
            (kwargs or {}).get(a.name, a.default_value)
            for a in func._schema.arguments[len(args) :]
        ]
        in_place, kind = _OPS[func]
        self_t = args[0]
        found = _destinations(kind, self_t, args)
        if found is None:
            return func(*args)
        self.writes[kind] += 1
        dest, values = (t.reshape(-1) for t in found)
        values = values.to(self_t.dtype)
        unique, inverse, counts = torch.unique(
            dest, return_inverse=True, return_counts=True
        )
        out = self_t if in_place else self_t.clone()
        if bool((counts > 1).any()):
            self.repeated[kind] += 1
            self._count_conflicts(kind, unique, inverse, values)
            dest, values = unique, values[self._winners(inverse, unique.numel())]
        # One entry per destination now: the order of the writes is moot.
        tmp = out if out.is_contiguous() else out.contiguous()
        tmp.view(-1).index_copy_(0, dest, values)
        if tmp is not out:
            out.copy_(tmp)
        return out

    def _winners(self, inverse: torch.Tensor, num_unique: int) -> torch.Tensor:
        # The entry that wins each destination: the one of highest rank, a
        # permutation of the entries (reversed: the lowest index wins).
        n, device = inverse.numel(), inverse.device
        if self.winner == "first":
            rank = torch.arange(n - 1, -1, -1)
        else:
            rank = torch.randperm(n, generator=self.gen)
        rank = rank.to(device)
        entry_of_rank = torch.empty(n, dtype=torch.int64, device=device)
        entry_of_rank[rank] = torch.arange(n, device=device)
        best = torch.full((num_unique,), -1, dtype=torch.int64, device=device)
        best = best.scatter_reduce(0, inverse, rank, "amax")
        return entry_of_rank[best]

    def _count_conflicts(self, kind, unique, inverse, values) -> None:
        # Destinations written more than once with different values.
        n, device = inverse.numel(), inverse.device
        first = torch.full((unique.numel(),), n, dtype=torch.int64, device=device)
        first = first.scatter_reduce(0, inverse, torch.arange(n, device=device), "amin")
        differs = values != values[first[inverse]]
        bad = torch.zeros(unique.numel(), dtype=torch.bool, device=device)
        bad[inverse[differs]] = True
        count = int(bad.sum())
        if count:
            self.conflicts[(kind, _caller())] += count


def _caller() -> str:
    # The first frame outside torch and this module: who wrote.
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename
        if "/torch/" not in name and not name.endswith("duplicate_writes.py"):
            return f"{name.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
    return "?"


def describe(mode: Optional[DuplicateWriteOrder]) -> str:
    """The conflicts a run saw, one line each (for a failing assertion)."""
    if mode is None or not mode.conflicts:
        return "no conflicting duplicate writes"
    return "\n".join(
        f"{n} x {kind} at {where}" for (kind, where), n in mode.conflicts.items()
    )
