"""Every GPU access of the offload is ordered across its CUDA streams.

On CUDA the coordinator runs the early swap on a stream of its own and the
controller its backups and warm copies on a side stream, ordered by
``wait_stream``, events and ``wait_backup``. On the CPU all of it runs
inline, so a missing wait passes every other CPU test. Here the offload's
workloads (``offload_scenarios``) run under ``stream_races.simulate_streams``:
fake streams and events with vector clocks, every Triton launch's and torch
op's reads and writes of the offload's buffers recorded, and any two accesses
of one byte from different streams, one a write, that no wait orders fail the
test. The harness's own host syncs (``check_host``) do not count: a server
has none. Controls remove a wait and must show races.

The server's shape runs too: the overlap scheduler's own stream (admission,
decode preparation, release) beside the forward stream, which waits for it
before each forward, and decode forwards replayed from CUDA graphs
(``StreamSim.graph_replay``: side-stream kernels ordered by the graph's
edges only, and what capture would refuse). Its controls: a wait that
holds on streams but not in a graph, the overlap scheduler without the
coordinator's waits for the forward stream, and a side stream the capture
never forked.
"""

import contextlib
import unittest
from unittest import mock

import pytest
import torch
from lru_shadow import STATE_BUFFERS
from offload_harness import OffloadHarness
from offload_scenarios import (  # noqa: F401 (module fixtures)
    OneRequestAtATime,
    colocated_lifecycle,
    mtp_verify_steps,
    pd_decode_lifecycle,
    setUpModule,
    tearDownModule,
)
from sglang.srt.managers.nsa_kv_offload_coordinator import NSAKVOffloadCoordinator
from sglang.srt.mem_cache.lru_cache_state import default_use_triton
from sglang.srt.mem_cache.sparse_cache_controller import SparseCacheController
from stream_races import FakeEvent, FakeStream, StreamSim, simulate_streams

SKIP = "CPU only: on CUDA the streams are real"
ON_CPU = not torch.cuda.is_available() and default_use_triton(torch.device("cpu"))


def track_harness(sim, h) -> None:
    """Give the harness's controller a side stream, track the buffers that
    live as long as it, and make its host check sync nothing."""
    h.controller.side_stream = FakeStream(sim, "side")
    lru = h.co.lru
    for name in STATE_BUFFERS:
        sim.track(f"lru.{name}", getattr(lru, name))
    backend = lru.swap_backend
    for name in ("_hit_flags", "_victims", "_evictable_counts", "_new_lru"):
        if hasattr(backend, name):
            sim.track(f"swap scratch {name}", getattr(backend, name))
    if hasattr(backend, "_row_direct"):
        sim.track("swap scratch _row_direct", backend._row_direct)
    for field, t in zip(h.co._plan_buffers._fields, h.co._plan_buffers):
        sim.track(f"plan.{field}", t)
    sim.track("num_real_reqs", h.co.num_real_reqs)
    for i, kv in enumerate(h.pool.kv_buffer):
        sim.track(f"kv_buffer[{i}]", kv)
    sim.track("loc_to_row", h.pool.loc_to_row)
    sim.track("host pool", h.controller._host_rows[0])
    sim.track("controller.counters", h.controller.counters)
    sim.track("req_to_token", h.req_to_token)

    def check_host(locs):
        with sim.paused():
            for layer in range(h.L):
                h.t.assertTrue(
                    torch.equal(h.host_bytes(layer, locs), h.ref[layer, locs])
                )

    h.check_host = check_host


class _StreamOrdered(unittest.TestCase):
    """Runs each test under simulated streams; no unordered access."""

    def setUp(self):
        super().setUp()
        self.sim = self.enterContext(simulate_streams())
        init, sim = OffloadHarness.__init__, self.sim

        self.harnesses = 0

        def tracked(h, *args, **kwargs):
            init(h, *args, **kwargs)
            track_harness(sim, h)
            self.harnesses += 1

        self.enterContext(mock.patch.object(OffloadHarness, "__init__", tracked))
        self.addCleanup(self.assert_ordered)

    def assert_ordered(self):
        self.assertGreater(self.harnesses, 0)
        self.assertGreater(self.sim.accesses, 0)
        self.assertEqual(self.sim.num_races, 0, self.sim.report())
        self.assertEqual(self.sim.num_reuses, 0, self.sim.report())


@unittest.skipUnless(ON_CPU, SKIP)
class TestLifecycleStreams(_StreamOrdered):
    """Admission (prefill hook and decode preparation), units lent and taken
    back, padded decode steps, finish and reuse; PD decode's transfer; MTP
    target verify through the early swap."""

    @pytest.mark.full  # ~25 s: the one-request runs below cover the waits
    def test_colocated(self):
        colocated_lifecycle(self, layers=1)
        # The run freed blocks another stream used: the caching allocator's
        # check had something to check.
        self.assertGreater(self.sim.blocks_shared, 0)

    def test_pd_decode(self):
        pd_decode_lifecycle(self, layers=1)

    def test_mtp_verify(self):
        mtp_verify_steps(self, steps=1)


class TestGraphReplayModel(unittest.TestCase):
    """``StreamSim.graph_replay`` on a buffer touched by hand: what a graph
    orders, and what capture refuses."""

    def setUp(self):
        self.sim = StreamSim()
        self.launch = self.sim.current
        self.side = FakeStream(self.sim, "side")
        self.lane = FakeStream(self.sim, "lane")
        self.buf = torch.zeros(4, dtype=torch.uint8)
        self.sim.track("buf", self.buf)
        self.addr = [self.buf.data_ptr()]

    def on(self, stream, write):
        outer, self.sim.current = self.sim.current, stream
        try:
            self.sim.access(
                "op", None if write else self.addr, self.addr if write else None
            )
        finally:
            self.sim.current = outer

    def test_a_lane_does_not_inherit_its_stream_outside_the_graph(self):
        self.on(self.side, write=True)
        self.lane.wait_stream(self.side)  # outside the graph: the stream only
        with self.sim.graph_replay():
            self.lane.wait_stream(self.launch)  # the fork
            self.on(self.lane, write=False)
            self.launch.wait_stream(self.lane)
        self.assertEqual(self.sim.num_races, 1, self.sim.report())
        self.assertEqual(self.sim.num_capture_faults, 0, self.sim.report())

    def test_on_streams_the_same_reads_are_ordered(self):
        self.on(self.side, write=True)
        self.lane.wait_stream(self.side)
        self.lane.wait_stream(self.launch)
        self.on(self.lane, write=False)
        self.assertEqual(self.sim.num_races, 0, self.sim.report())

    def test_the_launch_stream_after_the_graph_waits_for_it(self):
        with self.sim.graph_replay():
            self.lane.wait_stream(self.launch)
            self.on(self.lane, write=True)
            self.launch.wait_stream(self.lane)
        self.on(self.launch, write=False)
        self.on(self.lane, write=False)  # the real stream: not ordered
        self.assertEqual(self.sim.num_races, 1, self.sim.report())
        self.assertIn("read by op on lane", self.sim.races[0].second)

    def test_what_capture_refuses(self):
        outside = FakeEvent(self.sim)
        outside.record(self.side)
        with self.sim.graph_replay():
            self.on(self.side, write=False)  # never forked
            self.launch.wait_event(outside)
            self.lane.wait_stream(self.launch)
            self.on(self.lane, write=False)  # never joined
            self.sim.synchronize()
        faults = " | ".join(f.what for f in self.sim.capture_faults)
        self.assertEqual(self.sim.num_capture_faults, 4, faults)
        for what in ("outside the graph", "recorded outside", "host sync", "joined"):
            self.assertIn(what, faults)


def overlap_and_graphs(sim, h, graphs=True) -> None:
    """Run the harness as the server does: scheduling work on the scheduler's
    stream, each forward on the forward stream after it waits for that one,
    decode forwards as CUDA-graph replays (with ``graphs``). Once a forward
    is launched the scheduler processes the one before it: the host waits
    for that forward's event, then drops its batch's tensors."""
    schedule = sim.current
    schedule.name = "schedule"
    forward = FakeStream(sim, "forward")
    h.co.set_producer_stream(forward)
    in_flight = []  # (event after the forward, the batch's tensors)

    @contextlib.contextmanager
    def on_forward_stream(batch_tensors):
        with torch.cuda.stream(forward):
            forward.wait_stream(schedule)
            yield
            done = torch.cuda.Event()
            done.record()
        in_flight.append((done, batch_tensors))
        if len(in_flight) > 1:
            in_flight.pop(0)[0].synchronize()

    h.forward_context = on_forward_stream
    if graphs:
        h.decode_graph_context = sim.graph_replay


class _OverlapAndGraphs(OneRequestAtATime):
    """The one-request runs under simulated streams, shaped as the server."""

    def setUp(self):
        super().setUp()
        # The harness's own checks read state from the scheduler's stream
        # with nothing ordering them: a server runs none of them.
        check = OffloadHarness.check_admitted
        self.enterContext(
            mock.patch.object(OffloadHarness, "check_admitted", self._paused(check))
        )

    def _paused(self, check):
        def paused(*args, **kwargs):
            with self.sim.paused():
                return check(*args, **kwargs)

        return paused

    def _simulate(self, graphs=True, tweak=None, max_units=2):
        """``tweak(h)``: a change to the harness once built (the controls)."""
        with simulate_streams() as sim:
            self.sim = sim

            def ready(h):
                track_harness(sim, h)
                overlap_and_graphs(sim, h, graphs)
                if tweak is not None:
                    tweak(h)

            self.harness_ready = ready
            self._run(max_units)
        return sim


@unittest.skipUnless(ON_CPU, SKIP)
class TestOneRequestAtATimeOverlapGraphs(_OverlapAndGraphs):
    """The server's settings at 2 units (those that read wrong KV on the
    H200: a walker past 2 units, then a prompt that fits its slots) in the
    server's shape: nothing unordered, nothing capture refuses; the first
    layer's LRU reorder deferred beside the forward."""

    LAYERS = 2

    def test_server_settings_two_units(self):
        finish = SparseCacheController.finish_lru_reorder
        with mock.patch.object(
            SparseCacheController, "finish_lru_reorder", autospec=True
        ) as deferred:
            deferred.side_effect = finish
            sim = self._simulate()
        # The first layer's reorder ran deferred at every decode step: 2
        # prompts x (STEPS + 1) steps.
        self.assertEqual(deferred.call_count, 2 * (self.STEPS + 1))
        self.assertGreater(sim.graph_replays, 0)
        self.assertGreater(sim.accesses, 0)
        self.assertGreater(sim.blocks_shared, 0)
        self.assertEqual(sim.num_races, 0, sim.report())
        self.assertEqual(sim.num_reuses, 0, sim.report())
        self.assertEqual(sim.num_capture_faults, 0, sim.report())


class _Control(_OverlapAndGraphs):
    # The controls need only reach the waits they remove: one walker, two
    # decode steps.
    PROMPTS_IN_UNITS = (2.3,)
    STEPS = 2


@unittest.skipUnless(ON_CPU, SKIP)
class TestOverlapGraphControls(_Control):
    """What the server's shape adds to the checks, each shown failing."""

    def test_wait_on_the_swap_stream_holds_on_streams_not_in_a_graph(self):
        # The controller's waits for its side stream (warm copies, backups)
        # put on the early swap's stream instead of the caller's: on streams
        # the swap's kernels, and the forward after them, still come after
        # the copies (stream order); in a graph the swap's kernels are nodes
        # ordered by the launch stream only.
        def wait_on_swap_stream(h):
            wait = h.controller.wait_backup
            h.controller.wait_backup = lambda stream=None: wait(h.co._swap_stream)

        on_streams = self._simulate(graphs=False, tweak=wait_on_swap_stream)
        in_graphs = self._simulate(tweak=wait_on_swap_stream)
        self.assertEqual(on_streams.num_races, 0, on_streams.report())
        self.assertGreater(in_graphs.num_races, 0)
        self.assertTrue(
            any(r.first.endswith("on side") for r in in_graphs.races),
            in_graphs.report(),
        )

    def test_overlap_without_waiting_for_the_forward(self):
        # The scheduler's stream admits and releases while the previous
        # forward still runs: without _wait_producer, unordered.
        with mock.patch.object(
            NSAKVOffloadCoordinator, "_wait_producer", lambda co: None
        ):
            sim = self._simulate(graphs=False)
        self.assertGreater(sim.num_races, 0)
        self.assertTrue(
            any(
                "on schedule" in r.first + r.second
                and "on forward" in r.first + r.second
                for r in sim.races
            ),
            sim.report(),
        )

    def test_swap_stream_not_forked_from_the_capture(self):
        # The early swap's stream starts without waiting for the forward
        # stream: in a graph its kernels are not captured at all.
        wait_stream = FakeStream.wait_stream

        def no_fork(stream, other):
            if not stream.name.startswith("coordinator"):
                wait_stream(stream, other)

        with mock.patch.object(FakeStream, "wait_stream", no_fork):
            sim = self._simulate()
        self.assertGreater(sim.num_capture_faults, 0)
        self.assertTrue(
            any("outside the graph" in f.what for f in sim.capture_faults),
            sim.report(),
        )


@unittest.skipUnless(ON_CPU, SKIP)
class TestMissingWaits(_Control):
    """The controls of the plain streams: without one of the waits the
    checker finds races; without record_stream the allocator's check finds
    an early reuse."""

    def _sim(self, target=None, name=None, replacement=None):
        with contextlib.ExitStack() as stack:
            if target is not None:
                stack.enter_context(mock.patch.object(target, name, replacement))
            return self._simulate(graphs=False)

    def test_forward_not_waiting_for_the_early_swap(self):
        def take(co, layer_id, rows):
            # _take_early_page_table without its wait for the swap's event.
            page_table = co._early_page_tables.pop(layer_id, None)
            if page_table is None:
                return None
            n, k = page_table.shape
            if n < rows:
                pad = page_table.new_full((rows - n, k), -1)
                page_table = torch.cat([page_table, pad])
            return page_table

        sim = self._sim(NSAKVOffloadCoordinator, "_take_early_page_table", take)
        self.assertTrue(
            any(
                r.buffer == "plan.page_table"
                and "coordinator stream" in r.first
                and r.second.endswith("on forward")
                for r in sim.races
            ),
            sim.report(),
        )

    def test_nothing_waiting_for_the_side_stream(self):
        sim = self._sim(SparseCacheController, "wait_backup", lambda *a, **k: None)
        self.assertTrue(
            any(r.buffer == "host pool" and "gather" in r.second for r in sim.races),
            sim.report(),
        )

    def test_side_stream_not_recorded(self):
        real = simulate_streams

        @contextlib.contextmanager
        def without_record_stream():
            with real() as sim:
                sim.record_stream = lambda t, stream: None
                yield sim

        with mock.patch(__name__ + ".simulate_streams", without_record_stream):
            sim = self._sim()
        # The prefill backup's index blocks (the forward stream's), read by
        # the side stream's copy: record_stream is what keeps them.
        self.assertEqual(sim.num_races, 0, sim.report())
        self.assertGreater(sim.num_reuses, 0)
        self.assertTrue(
            all(
                not r.allocated_by.endswith("on side")
                and r.used_by == "_copy_rows_all_layers_kernel on side"
                for r in sim.reuses
            ),
            sim.report(),
        )


if __name__ == "__main__":
    unittest.main()
