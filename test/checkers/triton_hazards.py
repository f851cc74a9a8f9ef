"""A data-race checker for Triton kernels run under ``TRITON_INTERPRET=1``.

The interpreter runs a launch's programs one after another, and each memory
op on a whole block at once, so a kernel that lacks a barrier between a
store and another thread's access of the same address, or that lets two
programs of one launch touch the same address, gives the same results there
as a correct kernel. On the GPU it may not. :func:`record_hazards` records
every program's loads and stores between its barriers and reports:

* ``threads``: within a program and between two barriers, two different
  memory ops on one address, one of them a store, from different threads.
  Threads are approximated: element ``i`` of two ops is taken for one
  thread's only when both ops use the same pointer block (Triton picks each
  memory op's layout from its pointers); a scalar op is every thread's, and
  so is a load of a block smaller than the launch's threads (``32 *
  num_warps``): each element sits in several threads, all of which load it,
  while a store leaves it to one of them;
* ``scatter``: one store op writing different values to one address;
* ``programs``: an address one program of a launch stores and another
  program of the same launch loads or stores;
* ``bounds``: an address outside every storage the launch was given, and
  those registered with :meth:`HazardLog.reachable` (buffers that kernels
  reach through tables of pointers): on the GPU it reads or writes whatever
  lies next to it, silently.

Atomics are not recorded (the hardware orders them). Test tooling: the
product never imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Dict, List, Tuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class Hazard:
    kernel: str
    kind: str  # "threads", "scatter", "programs" or "bounds"
    program: Tuple[int, ...]
    num_addresses: int
    ops: str  # the memory ops involved: "file:line" of each


@dataclasses.dataclass
class _Access:
    program: int
    epoch: int
    op: int
    is_store: bool
    where: str  # the kernel source line of the op
    elsize: int  # bytes per element
    replicated: bool  # a load of a block smaller than the threads
    block: int  # elements in the op's block
    addrs: np.ndarray
    thread: np.ndarray  # -1: every thread (a scalar op)
    values: np.ndarray  # stores only


class HazardLog:
    """What :func:`record_hazards` found: ``hazards`` (first few per kernel
    and kind) and ``launches`` (kernel name -> launches checked)."""

    MAX_PER_KIND = 5

    def __init__(self):
        self.hazards: List[Hazard] = []
        self.launches: Dict[str, int] = {}
        self._counts: Dict[Tuple[str, str], int] = {}
        self.extra_storages: List[Tuple[int, int]] = []

    def reachable(self, *tensors) -> None:
        """Storages every launch may reach besides its arguments' (through a
        table of their addresses)."""
        for t in tensors:
            storage = t.untyped_storage()
            base = storage.data_ptr()
            self.extra_storages.append((base, base + storage.nbytes()))

    def add(self, hazard: Hazard) -> None:
        key = (hazard.kernel, hazard.kind)
        self._counts[key] = self._counts.get(key, 0) + 1
        if self._counts[key] <= self.MAX_PER_KIND:
            self.hazards.append(hazard)

    def counts(self) -> Dict[Tuple[str, str], int]:
        """(kernel, kind) -> hazards found (all of them, not only the kept)."""
        return dict(self._counts)

    def report(self) -> str:
        lines = [
            f"{kernel}: {n} {kind} hazard(s)"
            for (kernel, kind), n in sorted(self._counts.items())
        ]
        lines += [f"  {h}" for h in self.hazards]
        return "\n".join(lines)


class _Launch:
    """The accesses of one kernel launch, checked when it ends."""

    def __init__(self, kernel: str, log: HazardLog, num_warps: int = 4):
        self.kernel = kernel
        self.log = log
        self.threads = 32 * num_warps
        # The byte ranges [lo, hi) of the storages the launch was given.
        self.storages: List[Tuple[int, int]] = []
        self.accesses: List[_Access] = []
        self.program = -1
        self.program_ids: List[Tuple[int, ...]] = []
        self.epoch = 0
        self.op = 0
        # Pointer blocks seen in this launch -> a layout id.
        self._layouts: Dict[object, int] = {}

    def start_program(self, idx: Tuple[int, ...]) -> None:
        self.program += 1
        self.program_ids.append(idx)
        self.epoch = 0
        self.op = 0

    def barrier(self) -> None:
        self.epoch += 1

    def record(self, ptrs, mask, is_store: bool, values=None) -> None:
        self.op += 1
        where = _kernel_line()
        elsize = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        data = np.asarray(ptrs.data)
        mask = np.broadcast_to(np.asarray(mask, dtype=bool), data.shape)
        replicated = 1 < data.size < self.threads and not is_store
        if data.size <= 1 or replicated:
            # A scalar, or a replicated block's load (every replica loads;
            # a store is one replica's): no one thread's.
            thread = np.full(data.shape, -1, dtype=np.int64)
        else:
            # Element i of two ops is one thread's only when the ops use the
            # same pointer block: Triton picks each memory op's layout from
            # its pointers' contiguity (vectorized or not).
            key = (data.shape, data.tobytes())
            layout = self._layouts.setdefault(key, len(self._layouts))
            thread = (layout << 32) + np.arange(data.size, dtype=np.int64).reshape(
                data.shape
            )
        vals = np.zeros(0)
        if is_store:
            vals = np.broadcast_to(np.asarray(values), data.shape)[mask]
        self.accesses.append(
            _Access(
                self.program,
                self.epoch,
                self.op,
                is_store,
                where,
                elsize,
                replicated,
                data.size,
                data[mask].astype(np.uint64),
                thread[mask],
                vals,
            )
        )

    # ------------------------------------------------------------- checks

    def check(self) -> None:
        self.log.launches[self.kernel] = self.log.launches.get(self.kernel, 0) + 1
        if not self.accesses:
            return
        self._check_programs()
        self._check_bounds()
        groups: Dict[Tuple[int, int], List[_Access]] = {}
        for a in self.accesses:
            if a.addrs.size:
                groups.setdefault((a.program, a.epoch), []).append(a)
        for (program, _), accesses in groups.items():
            self._check_threads(program, accesses)

    def _hazard(self, kind, program, num, ops) -> None:
        self.log.add(
            Hazard(self.kernel, kind, self.program_ids[program], int(num), ops)
        )

    def _check_programs(self) -> None:
        if self.program < 1:
            return
        addr = np.concatenate([a.addrs for a in self.accesses])
        prog = np.concatenate(
            [np.full(a.addrs.size, a.program, np.int64) for a in self.accesses]
        )
        store = np.concatenate(
            [np.full(a.addrs.size, a.is_store) for a in self.accesses]
        )
        stored = np.unique(addr[store])
        if stored.size == 0:
            return
        touched = np.isin(addr, stored)
        pairs = np.unique(np.stack([addr[touched], prog[touched]]), axis=1)
        uniq, counts = np.unique(pairs[0], return_counts=True)
        shared = uniq[counts > 1]
        if shared.size:
            first = int(pairs[1][np.isin(pairs[0], shared)][0])
            ops = sorted(
                {
                    f"{'store' if a.is_store else 'load'} {a.where}"
                    for a in self.accesses
                    if np.isin(a.addrs, shared).any()
                }
            )
            self._hazard("programs", first, shared.size, "; ".join(ops))

    def _check_bounds(self) -> None:
        # One storage may come several times (views of it): merge overlaps.
        merged: List[List[int]] = []
        for lo_, hi_ in sorted(self.storages + self.log.extra_storages):
            if merged and lo_ < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi_)
            else:
                merged.append([lo_, hi_])
        lo = np.array([r[0] for r in merged], np.uint64)
        hi = np.array([r[1] for r in merged], np.uint64)
        for a in self.accesses:
            if not a.addrs.size:
                continue
            i = np.searchsorted(lo, a.addrs, side="right").astype(np.int64) - 1
            inside = (i >= 0) & (a.addrs + np.uint64(a.elsize) <= hi[np.maximum(i, 0)])
            num = int((~inside).sum())
            if num:
                kind = "store" if a.is_store else "load"
                self._hazard("bounds", a.program, num, f"{kind} {a.where}")

    def _check_threads(self, program: int, accesses: List[_Access]) -> None:
        for a in accesses:
            if a.is_store and a.addrs.size > 1:
                order = np.lexsort((a.values, a.addrs))
                addr, vals = a.addrs[order], a.values[order]
                same = addr[1:] == addr[:-1]
                if np.any(same & (vals[1:] != vals[:-1])):
                    self._hazard("scatter", program, same.sum(), a.where)
        if len(accesses) < 2 or not any(a.is_store for a in accesses):
            return
        addr = np.concatenate([a.addrs for a in accesses])
        op = np.concatenate([np.full(a.addrs.size, a.op) for a in accesses])
        store = np.concatenate([np.full(a.addrs.size, a.is_store) for a in accesses])
        thread = np.concatenate([a.thread for a in accesses])
        uniq, inv = np.unique(addr, return_inverse=True)
        n = uniq.size
        any_store = np.zeros(n, bool)
        np.logical_or.at(any_store, inv, store)
        op_lo = np.full(n, np.iinfo(np.int64).max)
        op_hi = np.full(n, -1)
        np.minimum.at(op_lo, inv, op)
        np.maximum.at(op_hi, inv, op)
        th_lo = np.full(n, np.iinfo(np.int64).max)
        th_hi = np.full(n, np.iinfo(np.int64).min)
        np.minimum.at(th_lo, inv, thread)
        np.maximum.at(th_hi, inv, thread)
        bad = any_store & (op_lo != op_hi) & ((th_lo != th_hi) | (th_lo == -1))
        if np.any(bad):
            ids = {int(o) for o in op[bad[inv]]}
            ops = [_op_name(a, self.threads) for a in accesses if a.op in ids]
            self._hazard("threads", program, bad.sum(), "; ".join(ops))


def _op_name(a: _Access, threads: int) -> str:
    if a.is_store:
        return f"store {a.where}"
    if a.replicated:
        return f"load of {a.block} elements by {threads} threads {a.where}"
    return f"load {a.where}"


_IN_LAUNCH = [0]


def in_launch() -> bool:
    """Whether an interpreted Triton launch is running (its argument copies
    to and from the host are no torch op of the program)."""
    return _IN_LAUNCH[0] > 0


_SKIP_DIRS = (os.sep + "triton" + os.sep, os.sep + "numpy" + os.sep)


def _kernel_line() -> str:
    # The innermost frame outside triton, numpy and this module: the
    # kernel's (or its jit helper's) tl.load / tl.store line.
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and not any(d in path for d in _SKIP_DIRS):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@contextlib.contextmanager
def record_hazards(ignore_barriers: bool = False, on_launch=None):
    """Record the hazards of every interpreted Triton launch in the block;
    yields the :class:`HazardLog`. ``ignore_barriers``: as if the kernels
    had none (the checker's own test: the hazards the barriers prevent must
    show). ``on_launch(launch)``: called after each launch with its ``kernel`` name and ``accesses`` (what
    ``stream_races`` orders between streams); launches run with
    ``in_launch()`` true."""
    from triton.runtime import interpreter

    builder_cls = interpreter.InterpreterBuilder
    log = HazardLog()
    state = {"launch": None}
    saved = {
        name: getattr(builder_cls, name)
        for name in (
            "create_masked_load",
            "create_masked_store",
            "create_barrier",
            "set_grid_idx",
        )
    }
    saved_call = interpreter.GridExecutor.__call__

    def masked_load(self, ptrs, mask, other, *args):
        if state["launch"] is not None:
            state["launch"].record(ptrs, mask.data, False)
        return saved["create_masked_load"](self, ptrs, mask, other, *args)

    def masked_store(self, ptrs, value, mask, *args):
        if state["launch"] is not None:
            state["launch"].record(ptrs, mask.data, True, value.data)
        return saved["create_masked_store"](self, ptrs, value, mask, *args)

    def barrier(self):
        if state["launch"] is not None and not ignore_barriers:
            state["launch"].barrier()
        return saved["create_barrier"](self)

    def set_grid_idx(self, *idx):
        if state["launch"] is not None:
            state["launch"].start_program(idx)
        return saved["set_grid_idx"](self, *idx)

    def call(self, *args, **kwargs):
        outer = state["launch"]
        state["launch"] = _Launch(
            getattr(self.fn, "__name__", str(self.fn)),
            log,
            num_warps=kwargs.get("num_warps", 4),
        )
        for arg in [*args, *kwargs.values()]:
            if hasattr(arg, "untyped_storage"):
                storage = arg.untyped_storage()
                base = storage.data_ptr()
                state["launch"].storages.append((base, base + storage.nbytes()))
        _IN_LAUNCH[0] += 1
        try:
            return saved_call(self, *args, **kwargs)
        finally:
            _IN_LAUNCH[0] -= 1
            launch, state["launch"] = state["launch"], outer
            launch.check()
            if on_launch is not None:
                on_launch(launch)

    builder_cls.create_masked_load = masked_load
    builder_cls.create_masked_store = masked_store
    builder_cls.create_barrier = barrier
    builder_cls.set_grid_idx = set_grid_idx
    interpreter.GridExecutor.__call__ = call
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(builder_cls, name, fn)
        interpreter.GridExecutor.__call__ = saved_call
