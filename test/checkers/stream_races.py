"""A CUDA stream-ordering checker that runs on the CPU (test tooling).

On CUDA the offload runs work on three streams: the forward's, the early
swap's and the controller's side stream (backups, warm copies), ordered by
``wait_stream``, events and host syncs. On the CPU every stream is inline,
so a missing wait passes every test there. :func:`simulate_streams` gives
the coordinator and controller fake streams and events that keep vector
clocks instead (``torch.cuda.Stream``, ``Event``, ``current_stream``,
``stream``, ``synchronize`` patched), records what every interpreted Triton
launch (exact addresses, ``triton_hazards``) and every torch op (the elements
its views and index arguments reach, through ``TorchDispatchMode``) reads
and writes in the tracked buffers, and reports any two accesses of one
byte from different streams, one a write, that no wait orders: a race on
the GPU, whatever the timing.

The caching allocator is modelled too: a block belongs to the stream that
allocated it, and once freed it may serve that stream's next allocation at
once, on the GPU ahead of another stream's work that still reads or writes
it (unless ``record_stream`` named that stream). Every tensor an op creates
is followed (its Python wrappers, views included, through weak references);
when the last one dies the block is freed, and the owner's next allocation
that is not ordered after every other stream's use of it is reported
(:class:`EarlyReuse`).

CUDA-graph replays are modelled by :meth:`StreamSim.graph_replay` around a
decode forward: the kernels captured from a side stream are graph nodes,
ordered after the launch stream's earlier work and their captured edges
only, not after that stream's own earlier work outside the graph; the
launch stream's later work waits for the whole graph. Inside it, what
capture refuses or leaves out is reported (:class:`CaptureFault`): a kernel
on a stream not forked from the capture (it would run once, at capture, and
never at replay), a wait on an event recorded outside the graph, a host
sync, and side-stream work not joined back into the launch stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Dict, List, Optional, Tuple
from unittest import mock

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton_hazards import in_launch, record_hazards

MAX_STREAMS = 16


@dataclasses.dataclass(frozen=True)
class Race:
    buffer: str
    num_bytes: int
    first: str  # the earlier access: "write|read on STREAM by OP"
    second: str


@dataclasses.dataclass(frozen=True)
class EarlyReuse:
    """A freed block that its stream's next allocation could take while
    another stream's work on it was not ordered before that allocation."""

    num_bytes: int
    allocated_by: str  # "OP on STREAM"
    used_by: str  # the other stream's last use of it: "OP on STREAM"
    next_allocation: str


@dataclasses.dataclass(frozen=True)
class CaptureFault:
    """What CUDA-graph capture refuses or leaves out of the graph."""

    what: str


class _Capture:
    """One decode forward replayed from a CUDA graph launched on ``launch``:
    each other stream works as a graph lane with an identity of its own
    (its twin), starting from the launch stream's clock."""

    def __init__(self, sim: "StreamSim", launch: "FakeStream"):
        self.sim = sim
        self.launch = launch
        self.capturing = {launch}
        self.saved = {}  # stream -> (id, name, clock) outside the graph

    def enter(self) -> None:
        sim, launch = self.sim, self.launch
        for s in [s for s in sim.streams if s.twin_of is None and s is not launch]:
            twin = sim.twin(s)
            self.saved[s] = (s.id, s.name, s.clock)
            s.id, s.name = twin.id, twin.name
            s.clock = launch.clock.copy()

    def exit(self) -> None:
        launch = self.launch
        for s in self.capturing - {launch}:
            if launch.clock[s.id] < s.clock[s.id]:
                self.sim.capture_fault(
                    f"work on {s.name} not joined into {launch.name}"
                )
        # The launch stream's later work waits for every node of the graph;
        # each stream is itself again, untouched by the graph's work.
        for s, (sid, name, clock) in self.saved.items():
            np.maximum(launch.clock, s.clock, out=launch.clock)
            s.id, s.name, s.clock = sid, name, clock


class _Block:
    """A block the (modelled) caching allocator handed out: its stream, the
    op that allocated it, each stream's last use (its clock entry then), the
    streams ``record_stream`` named, and its live Python wrappers."""

    def __init__(self, base: int, nbytes: int, owner: int, op: int):
        self.base = base
        self.end = base + nbytes
        self.owner = owner
        self.op = op
        self.use_clock = np.zeros(MAX_STREAMS, np.int64)
        self.use_op = np.zeros(MAX_STREAMS, np.int32)
        self.recorded = set()
        self.wrappers = set()


class FakeStream:
    def __init__(
        self, sim: "StreamSim", name: str, twin_of: Optional["FakeStream"] = None
    ):
        if len(sim.streams) == MAX_STREAMS:
            raise RuntimeError("too many simulated streams")
        self.sim = sim
        self.name = name
        self.id = len(sim.streams)
        self.clock = np.zeros(MAX_STREAMS, np.int64)
        # A graph lane's identity (the stream it stands for while a graph
        # replays), never issued on itself.
        self.twin_of = twin_of
        sim.streams.append(self)

    def issue(self) -> np.ndarray:
        """A new op on this stream: after every earlier op on it, and after
        whatever the host has waited for."""
        capture = self.sim.capture
        if capture is not None and self not in capture.capturing:
            self.sim.capture_fault(
                f"{self.name} runs work outside the graph (not forked from "
                f"{capture.launch.name}): at replay it would not run"
            )
        np.maximum(self.clock, self.sim.host_clock, out=self.clock)
        self.clock[self.id] += 1
        return self.clock.copy()

    def wait_stream(self, other: "FakeStream") -> None:
        capture = self.sim.capture
        if capture is not None:
            if other in capture.capturing:
                capture.capturing.add(self)  # a fork of the capture
            elif self in capture.capturing:
                self.sim.capture_fault(
                    f"{self.name} waits inside the graph on {other.name}, "
                    "which is not captured"
                )
        np.maximum(self.clock, other.clock, out=self.clock)

    def wait_event(self, event: "FakeEvent") -> None:
        capture = self.sim.capture
        if capture is not None and event.clock is not None:
            if event.capture is capture:
                capture.capturing.add(self)
            elif self in capture.capturing:
                self.sim.capture_fault(
                    f"{self.name} waits inside the graph on an event recorded "
                    "outside it: the replay would not wait"
                )
        if event.clock is not None:
            np.maximum(self.clock, event.clock, out=self.clock)

    def synchronize(self) -> None:
        self.sim.host_sync(f"{self.name}.synchronize()")
        np.maximum(self.sim.host_clock, self.clock, out=self.sim.host_clock)


class FakeEvent:
    def __init__(self, sim: "StreamSim"):
        self.sim = sim
        self.clock: Optional[np.ndarray] = None
        self.capture: Optional[_Capture] = None  # recorded inside this graph

    def record(self, stream: Optional[FakeStream] = None) -> None:
        stream = stream or self.sim.current
        self.clock = stream.clock.copy()
        capture = self.sim.capture
        self.capture = (
            capture if capture is not None and stream in capture.capturing else None
        )

    def synchronize(self) -> None:
        self.sim.host_sync("event.synchronize()")
        if self.clock is not None:
            np.maximum(self.sim.host_clock, self.clock, out=self.sim.host_clock)


class _Shadow:
    """Per byte of one tracked buffer: its last write (stream, op count)
    and each stream's last read since."""

    def __init__(self, name: str, nbytes: int):
        self.name = name
        self.write_stream = np.full(nbytes, -1, np.int8)
        self.write_count = np.zeros(nbytes, np.int64)
        self.write_op = np.zeros(nbytes, np.int32)
        self.read_count = np.zeros((MAX_STREAMS, nbytes), np.int64)
        self.read_op = np.zeros((MAX_STREAMS, nbytes), np.int32)


class StreamSim:
    """The fake streams' clocks, the tracked buffers and the races found."""

    MAX_RACES = 20

    def __init__(self):
        self.streams: List[FakeStream] = []
        self.host_clock = np.zeros(MAX_STREAMS, np.int64)
        self.current = FakeStream(self, "forward")
        self.races: List[Race] = []
        self.num_races = 0
        self.ops: List[str] = [""]  # op id -> description
        self.accesses = 0
        self._buffers: Dict[int, Tuple[int, _Shadow]] = {}  # base -> (end, shadow)
        self._bases = np.zeros(0, np.int64)
        self._ends = np.zeros(0, np.int64)
        self._shadows: List[_Shadow] = []
        self._arange: Dict[int, torch.Tensor] = {}
        self._paused = 0
        # The caching allocator's blocks: live ones by base address, and the
        # freed ones each stream's next allocation checks.
        self._blocks: Dict[int, _Block] = {}
        self._block_index = None  # (bases, ends, blocks), rebuilt when None
        self._freed: Dict[int, List[_Block]] = {}
        self.reuses: List[EarlyReuse] = []
        self.num_reuses = 0
        self.blocks_allocated = 0
        # Blocks freed after another stream used them (recorded or not): the
        # ones the check is about.
        self.blocks_shared = 0
        # CUDA-graph replays (graph_replay) and what capture would refuse.
        self.capture: Optional[_Capture] = None
        self.graph_replays = 0
        self.capture_faults: List[CaptureFault] = []
        self.num_capture_faults = 0
        self._twins: Dict[int, FakeStream] = {}

    # ------------------------------------------------------------- buffers

    def track(self, name: str, tensor: torch.Tensor) -> None:
        """Check every access of ``tensor``'s storage (a buffer that lives
        as long as the run). A storage at the address of one tracked before
        starts afresh: the old one is gone (a test's earlier harness)."""
        storage = tensor.untyped_storage()
        base = storage.data_ptr()
        if storage.nbytes() == 0:
            return
        for old in [
            b
            for b, (end, _) in self._buffers.items()
            if b < base + storage.nbytes() and base < end
        ]:
            del self._buffers[old]
        shadow = _Shadow(name, storage.nbytes())
        self._buffers[base] = (base + storage.nbytes(), shadow)
        order = sorted(self._buffers)
        self._bases = np.array(order, np.int64)
        self._ends = np.array([self._buffers[b][0] for b in order], np.int64)
        self._shadows = [self._buffers[b][1] for b in order]

    def synchronize(self) -> None:
        self.host_sync("torch.cuda.synchronize()")
        for s in self.streams:
            np.maximum(self.host_clock, s.clock, out=self.host_clock)

    # ------------------------------------------------------- CUDA graphs

    @contextlib.contextmanager
    def graph_replay(self):
        """The block is a forward replayed from a CUDA graph launched on the
        current stream (see the module docstring)."""
        if self.capture is not None:
            raise RuntimeError("graph replays do not nest")
        capture = _Capture(self, self.current)
        capture.enter()
        self.capture = capture
        self.graph_replays += 1
        try:
            yield
        finally:
            self.capture = None
            capture.exit()

    def twin(self, stream: FakeStream) -> FakeStream:
        """The graph-lane identity of ``stream`` (made once, reused by every
        replay: its clock entry keeps counting up)."""
        if stream.id not in self._twins:
            self._twins[stream.id] = FakeStream(
                self, f"{stream.name} (graph)", twin_of=stream
            )
        return self._twins[stream.id]

    def host_sync(self, what: str) -> None:
        if self.capture is not None and not self._paused:
            self.capture_fault(f"{what} inside the graph (a host sync)")

    def capture_fault(self, what: str) -> None:
        self.num_capture_faults += 1
        if len(self.capture_faults) < self.MAX_RACES:
            self.capture_faults.append(CaptureFault(what))

    @contextlib.contextmanager
    def paused(self):
        """Nothing in the block is recorded (a test's own host checks)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # ------------------------------------------------------------ accesses

    def access(self, op_name: str, reads, writes, blocks=()) -> None:
        """One op on the current stream; ``reads`` / ``writes``: arrays of
        byte addresses; ``blocks``: the allocator's blocks it uses."""
        if self._paused:
            return
        stream = self.current
        clock = stream.issue()
        self.ops.append(f"{op_name} on {stream.name}")
        op = len(self.ops) - 1
        for block in blocks:
            block.use_clock[stream.id] = clock[stream.id]
            block.use_op[stream.id] = op
        for addrs, is_write in ((reads, False), (writes, True)):
            if addrs is None or len(addrs) == 0:
                continue
            addrs = np.unique(np.asarray(addrs, np.int64))
            slot = np.searchsorted(self._bases, addrs, side="right") - 1
            inside = (slot >= 0) & (addrs < self._ends[np.maximum(slot, 0)])
            for i in np.unique(slot[inside]):
                mine = addrs[inside & (slot == i)] - self._bases[i]
                self._check(self._shadows[i], mine, stream.id, clock, op, is_write)

    def _check(self, sh: _Shadow, off, sid, clock, op, is_write) -> None:
        self.accesses += 1
        ws = sh.write_stream[off].astype(np.int64)
        unordered = (ws >= 0) & (ws != sid)
        unordered &= clock[np.maximum(ws, 0)] < sh.write_count[off]
        if unordered.any():
            self._race(sh, off, unordered, sh.write_op[off], "write", op, is_write)
        if is_write:
            for s in range(len(self.streams)):
                if s == sid:
                    continue
                late = sh.read_count[s, off] > clock[s]
                if late.any():
                    self._race(sh, off, late, sh.read_op[s, off], "read", op, True)
            sh.write_stream[off] = sid
            sh.write_count[off] = clock[sid]
            sh.write_op[off] = op
            sh.read_count[:, off] = 0
        else:
            sh.read_count[sid, off] = clock[sid]
            sh.read_op[sid, off] = op

    def _race(self, sh, off, mask, prev_ops, prev_kind, op, is_write) -> None:
        self.num_races += 1
        if len(self.races) < self.MAX_RACES:
            first = int(prev_ops[mask][0])
            self.races.append(
                Race(
                    sh.name,
                    int(mask.sum()),
                    f"{prev_kind} by {self.ops[first]}",
                    f"{'write' if is_write else 'read'} by {self.ops[op]}",
                )
            )

    def report(self) -> str:
        lines = [f"{self.num_races} unordered access(es) across streams"]
        lines += [f"  {r}" for r in self.races]
        lines.append(
            f"{self.num_reuses} freed block(s) reused too early (of "
            f"{self.blocks_allocated} allocated, {self.blocks_shared} freed "
            "after another stream used them)"
        )
        lines += [f"  {r}" for r in self.reuses]
        lines.append(
            f"{self.num_capture_faults} capture fault(s) in {self.graph_replays} "
            "graph replay(s)"
        )
        lines += [f"  {f.what}" for f in self.capture_faults]
        return "\n".join(lines)

    # ----------------------------------------------------------- allocator

    def allocated(self, op_name: str, t: torch.Tensor) -> None:
        """``t`` holds a block just allocated on the current stream. The
        stream's freed blocks are reusable from here: each must be free of
        other streams' unordered work."""
        stream = self.current
        self._check_freed(stream, f"{op_name} on {stream.name}")
        storage = t.untyped_storage()
        self.ops.append(f"{op_name} on {stream.name}")
        block = _Block(
            storage.data_ptr(), storage.nbytes(), stream.id, len(self.ops) - 1
        )
        self._blocks[block.base] = block
        self._block_index = None
        self.blocks_allocated += 1
        self.add_wrapper(block, t)

    def block_of(self, t) -> Optional[_Block]:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return None
        return self._blocks.get(t.untyped_storage().data_ptr())

    def add_wrapper(self, block: _Block, t: torch.Tensor) -> None:
        key = id(t)
        if key not in block.wrappers:
            block.wrappers.add(key)
            weakref.finalize(t, self._dropped, block, key)

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        block = self.block_of(t)
        if block is not None:
            block.recorded.add(stream.id)

    def blocks_at(self, addrs: np.ndarray) -> List[_Block]:
        """The live blocks that hold any of the byte addresses ``addrs``."""
        if self._block_index is None:
            order = sorted(self._blocks)
            self._block_index = (
                np.array(order, np.int64),
                np.array([self._blocks[b].end for b in order], np.int64),
                [self._blocks[b] for b in order],
            )
        bases, ends, blocks = self._block_index
        if not len(bases) or addrs is None or not len(addrs):
            return []
        slot = np.searchsorted(bases, addrs, side="right") - 1
        inside = (slot >= 0) & (addrs < ends[np.maximum(slot, 0)])
        return [blocks[i] for i in np.unique(slot[inside])]

    def _dropped(self, block: _Block, key: int) -> None:
        block.wrappers.discard(key)
        if block.wrappers:
            return
        if self._blocks.get(block.base) is block:
            del self._blocks[block.base]
            self._block_index = None
        others = block.use_clock.copy()
        others[block.owner] = 0
        self.blocks_shared += bool(others.any())
        others[list(block.recorded)] = 0
        if others.any():
            self._freed.setdefault(block.owner, []).append(block)

    def _check_freed(self, stream: FakeStream, allocation: str) -> None:
        freed = self._freed.pop(stream.id, [])
        ordered = np.maximum(stream.clock, self.host_clock)
        for block in freed:
            late = block.use_clock > ordered
            late[block.owner] = False
            late[list(block.recorded)] = False
            if not late.any():
                continue
            self.num_reuses += 1
            if len(self.reuses) < self.MAX_RACES:
                s = int(np.flatnonzero(late)[0])
                self.reuses.append(
                    EarlyReuse(
                        block.end - block.base,
                        self.ops[block.op],
                        self.ops[int(block.use_op[s])],
                        allocation,
                    )
                )

    # ------------------------------------------------------- op adapters

    def triton_launch(self, launch) -> None:
        reads, writes = [], []
        for a in launch.accesses:
            if a.addrs.size == 0:
                continue
            byte = (
                a.addrs.astype(np.int64)[:, None] + np.arange(a.elsize)[None, :]
            ).reshape(-1)
            (writes if a.is_store else reads).append(byte)
        reads = np.concatenate(reads) if reads else None
        writes = np.concatenate(writes) if writes else None
        blocks = {
            id(b): b
            for addrs in (reads, writes)
            if addrs is not None
            for b in self.blocks_at(addrs)
        }
        self.access(launch.kernel, reads, writes, list(blocks.values()))

    def element_addresses(self, t: torch.Tensor) -> torch.Tensor:
        """The byte address of each element of view ``t`` (its first byte),
        shaped like ``t``: indexing it as an op indexes ``t`` gives the
        elements the op reaches."""
        storage = t.untyped_storage()
        elsize = t.element_size()
        n = storage.nbytes() // elsize
        if n not in self._arange:
            self._arange[n] = torch.arange(n, dtype=torch.int64)
        idx = self._arange[n].as_strided(t.shape, t.stride(), t.storage_offset())
        return storage.data_ptr() + idx * elsize

    def is_tracked(self, t) -> bool:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return False
        base = t.untyped_storage().data_ptr()
        i = np.searchsorted(self._bases, base, side="right") - 1
        return i >= 0 and base < self._ends[i]

    def bytes_of(self, t: torch.Tensor, elems: torch.Tensor) -> np.ndarray:
        elsize = t.element_size()
        first = elems.reshape(-1).numpy()
        return (first[:, None] + np.arange(elsize)[None, :]).reshape(-1)


def _flat_tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat_tensors(y)


# Ops whose written (or read) elements follow their index arguments.
_INDEXED_WRITE = {
    "aten::index_put_": lambda e, a: e[tuple(a[1])],
    "aten::_index_put_impl_": lambda e, a: e[tuple(a[1])],
    "aten::scatter_": lambda e, a: e.gather(a[1], a[2]),
    "aten::scatter_add_": lambda e, a: e.gather(a[1], a[2]),
    "aten::index_copy_": lambda e, a: e.index_select(a[1], a[2]),
    "aten::index_fill_": lambda e, a: e.index_select(a[1], a[2]),
    "aten::masked_fill_": lambda e, a: e[a[1].expand_as(e)],
}
_INDEXED_READ = {
    "aten::index": lambda e, a: e[tuple(a[1])],
    "aten::gather": lambda e, a: e.gather(a[1], a[2]),
    "aten::index_select": lambda e, a: e.index_select(a[1], a[2]),
}


class _TorchOps(TorchDispatchMode):
    """Every torch op outside the Triton launches: what it reads and writes
    of the tracked buffers, on the current fake stream."""

    def __init__(self, sim: StreamSim):
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if in_launch():
            return func(*args, **kwargs)
        self._record(func, args, kwargs)
        out = func(*args, **kwargs)
        self._follow_blocks(func, args, kwargs, out)
        return out

    def _follow_blocks(self, func, args, kwargs, out) -> None:
        # A result on a storage no input has is a new block on the current
        # stream (torch.tensor(data) arrives through lift_fresh); a view or
        # an in-place result is one more wrapper of its input's block.
        sim = self.sim
        name = func._schema.name
        inputs = {
            t.untyped_storage().data_ptr()
            for t in _flat_tensors([*args, *kwargs.values()])
        }
        for t in _flat_tensors(out):
            storage = t.untyped_storage()
            if t.device.type != "cpu" or storage.nbytes() == 0:
                continue
            block = sim.block_of(t)
            if block is not None:
                sim.add_wrapper(block, t)
            elif (
                name == "aten::lift_fresh" or storage.data_ptr() not in inputs
            ) and not sim.is_tracked(t):
                sim.allocated(name, t)

    def _record(self, func, args, kwargs) -> None:
        sim = self.sim
        schema = func._schema
        name = schema.name
        writes, reads = [], []
        is_view = any(r.alias_info is not None for r in schema.returns) and not any(
            a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
        )
        if is_view:
            return  # views read nothing
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written = arg.alias_info is not None and arg.alias_info.is_write
            for t in _flat_tensors(value):
                if not sim.is_tracked(t):
                    continue
                elems = sim.element_addresses(t)
                if written and i == 0 and name in _INDEXED_WRITE:
                    try:
                        elems = _INDEXED_WRITE[name](elems, args)
                    except (IndexError, RuntimeError, TypeError):
                        pass  # an overload the lambda does not know: all of it
                elif not written and i == 0 and name in _INDEXED_READ:
                    try:
                        elems = _INDEXED_READ[name](elems, args)
                    except (IndexError, RuntimeError, TypeError):
                        pass
                (writes if written else reads).append(sim.bytes_of(t, elems))
        blocks = {}
        for t in _flat_tensors([*args, *kwargs.values()]):
            block = sim.block_of(t)
            if block is not None:
                blocks[id(block)] = block
        if reads or writes or blocks:
            sim.access(
                name,
                np.concatenate(reads) if reads else None,
                np.concatenate(writes) if writes else None,
                list(blocks.values()),
            )


@contextlib.contextmanager
def simulate_streams():
    """Fake CUDA streams and events for the offload on the CPU; yields the
    :class:`StreamSim` (track buffers with ``track``, read ``races``)."""
    from sglang.srt.managers.nsa_kv_offload_coordinator import (
        NSAKVOffloadCoordinator,
    )
    from sglang.srt.mem_cache.sparse_cache_controller import SparseCacheController

    sim = StreamSim()

    def new_stream(*args, **kwargs):
        return FakeStream(sim, f"stream{len(sim.streams)}")

    @contextlib.contextmanager
    def use_stream(stream):
        if stream is None:
            yield
            return
        outer, sim.current = sim.current, stream
        try:
            yield
        finally:
            sim.current = outer

    coordinator_init = NSAKVOffloadCoordinator.__init__

    def coordinator_with_swap_stream(coordinator, *args, **kwargs):
        # On CUDA the coordinator opens the early swap's stream and its
        # per-layer events; on the CPU it runs the swap inline: fake ones.
        coordinator_init(coordinator, *args, **kwargs)
        layers = coordinator.kv_pool.layer_num
        coordinator._swap_stream = FakeStream(
            sim, f"coordinator stream {len(sim.streams)}"
        )
        coordinator._swap_done = [FakeEvent(sim) for _ in range(layers)]

    launch_side = SparseCacheController._launch_side

    def launch_side_recorded(controller, fn, tensors=()):
        # What record_stream does on CUDA (the CPU skips it): the side
        # stream's use of ``tensors`` holds their blocks past their free.
        event = launch_side(controller, fn, tensors)
        if isinstance(controller.side_stream, FakeStream):
            for t in tensors:
                sim.record_stream(t, controller.side_stream)
        return event

    patches = [
        mock.patch.object(SparseCacheController, "_launch_side", launch_side_recorded),
        mock.patch.object(torch.cuda, "Stream", new_stream),
        mock.patch.object(torch.cuda, "Event", lambda *a, **k: FakeEvent(sim)),
        mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: sim.current),
        mock.patch.object(torch.cuda, "stream", use_stream),
        mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: sim.synchronize()),
        mock.patch.object(
            NSAKVOffloadCoordinator, "__init__", coordinator_with_swap_stream
        ),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(record_hazards(on_launch=sim.triton_launch))
        stack.enter_context(_TorchOps(sim))
        yield sim
