"""Every GPU access of the offload is ordered across its CUDA streams.

On CUDA the coordinator runs the early swap (and the cross-layer prefetch)
on a stream of its own and the controller its backups and warm copies on a
side stream, ordered by ``wait_stream``, events and ``wait_backup``. On the
CPU all of it runs inline, so a missing wait passes every other CPU test.
Here lifecycle tests run again under ``stream_races.simulate_streams``: fake
streams and events with vector clocks, every Triton launch's and torch op's
reads and writes of the offload's buffers recorded, and any two accesses of
one byte from different streams, one a write, that no wait orders fail the
test. The harness's own host syncs (``check_host``) do not count: a server
has none. Two controls remove a wait and must show races.

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

import test_nsa_kv_offload_integration as integration
import test_nsa_kv_offload_mtp_v2 as mtp_v2
import test_nsa_kv_offload_mtp_verify as mtp_verify
import torch
from lru_shadow import STATE_BUFFERS
from sglang.srt.managers.nsa_kv_offload_coordinator import (
    NSAKVOffloadCoordinator,
    _pad_rows,
)
from sglang.srt.mem_cache import lru_cache_state as lru_mod
from sglang.srt.mem_cache.sparse_cache_controller import SparseCacheController
from stream_races import FakeEvent, FakeStream, StreamSim, simulate_streams
from test_nsa_kv_offload_integration import (  # noqa: F401 (module fixtures)
    _Harness,
    _OneRequestAtATime,
    setUpModule,
    tearDownModule,
)

SKIP = "CPU only: on CUDA the streams are real"
ON_CPU = not torch.cuda.is_available() and lru_mod.default_use_triton(
    torch.device("cpu")
)


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
    if h.co.cross_layer_prefetch:
        for field, t in zip(h.co._prefetch_plan._fields, h.co._prefetch_plan):
            sim.track(f"prefetch plan.{field}", t)
        sim.track("prefetch top-k", h.co._prefetch_topk)
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


class _StreamOrdered:
    """Runs each test under simulated streams; no unordered access."""

    def setUp(self):
        super().setUp()
        self.sim = self.enterContext(simulate_streams())
        init, sim = _Harness.__init__, self.sim

        self.harnesses = 0

        def tracked(h, *args, **kwargs):
            init(h, *args, **kwargs)
            track_harness(sim, h)
            self.harnesses += 1

        self.enterContext(mock.patch.object(_Harness, "__init__", tracked))
        self.addCleanup(self.assert_ordered)

    # Whether the run must free blocks another stream used (the caching
    # allocator's check has something to check).
    SHARES_BLOCKS = False

    def assert_ordered(self):
        if self.harnesses:  # tests of other parts build none
            self.assertGreater(self.sim.accesses, 0)
        if self.SHARES_BLOCKS:
            self.assertGreater(self.sim.blocks_shared, 0)
        self.assertEqual(self.sim.num_races, 0, self.sim.report())
        self.assertEqual(self.sim.num_reuses, 0, self.sim.report())


@unittest.skipUnless(ON_CPU, SKIP)
class TestLifecycleStreams(_StreamOrdered, integration.TestOffloadLifecycleDefaults):
    """Units, lent staging, the early swap: admission, decode, retraction."""


@unittest.skipUnless(ON_CPU, SKIP)
class TestPrefetchStreams(_StreamOrdered, integration.TestCrossLayerPrefetchEarlySwap):
    """The cross-layer prefetch on the early swap's stream."""


@unittest.skipUnless(ON_CPU, SKIP)
class TestPDDecodeStreams(_StreamOrdered, integration.TestPDDecodeLifecycleDefaults):
    """PD decode: KV arrives in host slots, retraction syncs."""


@unittest.skipUnless(ON_CPU, SKIP)
class TestMTPVerifyStreams(_StreamOrdered, mtp_verify.TestMTPVerify):
    """MTP target verify (spec v1), its swap early on the coordinator stream."""

    # Argument checks: no forward runs.
    test_indexer_topk_positional_in_verify = None
    test_query_tokens_checked = None


@unittest.skipUnless(ON_CPU, SKIP)
class TestMTPVerifySpecV2Streams(_StreamOrdered, mtp_v2.TestMTPVerifySpecV2):
    """MTP target verify with spec v2's overlapped draft and verify."""

    test_prepare_v2_verify_checks_query_tokens = None  # no forward runs


@unittest.skipUnless(ON_CPU, SKIP)
class TestOneRequestAtATimeStreams(_StreamOrdered, _OneRequestAtATime):
    """The settings that read wrong KV on the H200 (section 6 of
    results/units/per_unit_gpu_gate/README.md), and the default's."""

    PROMPTS_IN_UNITS = (2.3, 0.7, 5.5, 1.95, 0.45)
    SHARES_BLOCKS = True

    def test_server_settings_two_units(self):
        self._run(2, early_swap=True, warm_units=True, direct_slots=True)

    def test_default(self):
        self._run(4, early_swap=True)

    def test_clock(self):
        self._run(4, early_swap=True, slot_policy="clock")


@unittest.skipUnless(ON_CPU, SKIP)
class TestOneRequestAtATimeTwoLayersStreams(_StreamOrdered, _OneRequestAtATime):
    """The same with two layers, as the H200 run had: the first layer's LRU
    reorder is deferred and runs beside the forward stream."""

    PROMPTS_IN_UNITS = (2.3, 0.7, 1.95)
    LAYERS = 2
    SHARES_BLOCKS = True

    def test_server_settings_two_units(self):
        finish = SparseCacheController.finish_lru_reorder
        with mock.patch.object(
            SparseCacheController, "finish_lru_reorder", autospec=True
        ) as deferred:
            deferred.side_effect = finish
            self._run(2, early_swap=True, warm_units=True, direct_slots=True)
        # The first layer's reorder ran deferred at every decode step: 3
        # prompts x 15 steps (W + 7 at 1/32 of the sizes).
        self.assertEqual(deferred.call_count, 45)


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


class _OverlapAndGraphs(_OneRequestAtATime):
    """The one-request runs under simulated streams, shaped as the server."""

    def setUp(self):
        super().setUp()
        # The harness's own checks read state from the scheduler's stream
        # with nothing ordering them: a server runs none of them.
        for target, name in (
            (_OneRequestAtATime, "check_lru_state"),
            (_Harness, "check_admitted"),
        ):
            check = getattr(target, name)
            self.enterContext(mock.patch.object(target, name, self._paused(check)))

    def _paused(self, check):
        def paused(*args, **kwargs):
            with self.sim.paused():
                return check(*args, **kwargs)

        return paused

    def _simulate(self, graphs=True, tweak=None, **run_kwargs):
        """``tweak(h)``: a change to the harness once built (the controls)."""
        with simulate_streams() as sim:
            self.sim = sim

            def ready(h):
                track_harness(sim, h)
                overlap_and_graphs(sim, h, graphs)
                if tweak is not None:
                    tweak(h)

            self.harness_ready = ready
            self._run(**run_kwargs)
        return sim


@unittest.skipUnless(ON_CPU, SKIP)
class TestOneRequestAtATimeOverlapGraphs(_OverlapAndGraphs):
    """The settings that read wrong KV on the H200, the default's and CLOCK's,
    in the server's shape: nothing unordered, nothing capture refuses."""

    # Walkers at 2 and at 4 units, and a prompt that fits.
    PROMPTS_IN_UNITS = (2.3, 0.7, 5.5)
    LAYERS = 2  # the first layer's reorder deferred beside the forward

    def _check(self, sim):
        self.assertGreater(sim.graph_replays, 0)
        self.assertGreater(sim.accesses, 0)
        self.assertEqual(sim.num_races, 0, sim.report())
        self.assertEqual(sim.num_reuses, 0, sim.report())
        self.assertEqual(sim.num_capture_faults, 0, sim.report())

    def test_server_settings_two_units(self):
        self._check(
            self._simulate(
                max_units=2, early_swap=True, warm_units=True, direct_slots=True
            )
        )

    def test_server_settings_two_units_flat_copy(self):
        self._check(
            self._simulate(
                max_units=2,
                early_swap=True,
                warm_units=True,
                direct_slots=True,
                copy_flat_programs=16,
            )
        )

    def test_default(self):
        self._check(self._simulate(max_units=4, early_swap=True))

    def test_clock(self):
        self._check(self._simulate(max_units=4, early_swap=True, slot_policy="clock"))


@unittest.skipUnless(ON_CPU, SKIP)
class TestOverlapGraphControls(_OverlapAndGraphs):
    """What the server's shape adds to the checks, each shown failing."""

    PROMPTS_IN_UNITS = (2.3, 0.7)
    SETTINGS = dict(max_units=2, early_swap=True, warm_units=True, direct_slots=True)

    def test_wait_on_the_swap_stream_holds_on_streams_not_in_a_graph(self):
        # The controller's waits for its side stream (warm copies, backups)
        # put on the early swap's stream instead of the caller's: on streams
        # the swap's kernels, and the forward after them, still come after
        # the copies (stream order); in a graph the swap's kernels are nodes
        # ordered by the launch stream only.
        def wait_on_swap_stream(h):
            wait = h.controller.wait_backup
            h.controller.wait_backup = lambda stream=None: wait(h.co._swap_stream)

        on_streams = self._simulate(
            graphs=False, tweak=wait_on_swap_stream, **self.SETTINGS
        )
        in_graphs = self._simulate(tweak=wait_on_swap_stream, **self.SETTINGS)
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
            sim = self._simulate(graphs=False, **self.SETTINGS)
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
            sim = self._simulate(**self.SETTINGS)
        self.assertGreater(sim.num_capture_faults, 0)
        self.assertTrue(
            any("outside the graph" in f.what for f in sim.capture_faults),
            sim.report(),
        )


@unittest.skipUnless(ON_CPU, SKIP)
class TestMissingWaits(_OneRequestAtATime):
    """The controls: without one of the waits the checker finds races."""

    PROMPTS_IN_UNITS = (2.3, 0.7)

    def _races(self, target, name, replacement):
        with simulate_streams() as sim, mock.patch.object(target, name, replacement):
            self.harness_ready = lambda h: track_harness(sim, h)
            self._run(2, early_swap=True, warm_units=True, direct_slots=True)
        return {(r.buffer, r.first.split(" on ")[-1], r.second) for r in sim.races}

    def test_forward_not_waiting_for_the_early_swap(self):
        def take(co, layer_id, rows):
            page_table = co._early_page_tables.pop(layer_id, None)
            return None if page_table is None else _pad_rows(page_table, rows)

        races = self._races(NSAKVOffloadCoordinator, "_take_early_page_table", take)
        self.assertIn(
            (
                "plan.page_table",
                "coordinator stream 1",
                "read by aten::clone on forward",
            ),
            races,
        )

    def test_nothing_waiting_for_the_side_stream(self):
        races = self._races(SparseCacheController, "wait_backup", lambda *a, **k: None)
        self.assertTrue(
            any(buf == "host pool" and "gather" in second for buf, _, second in races),
            races,
        )


@unittest.skipUnless(ON_CPU, SKIP)
class TestEarlyReuse(_OneRequestAtATime):
    """The caching allocator's control: a block freed on one stream while
    another still uses it is reported at its stream's next allocation."""

    PROMPTS_IN_UNITS = (2.3, 0.7)

    def test_side_stream_not_recorded(self):
        with simulate_streams() as sim:
            sim.record_stream = lambda t, stream: None
            self.harness_ready = lambda h: track_harness(sim, h)
            self._run(2, early_swap=True, warm_units=True, direct_slots=True)
        # The prefill backup's index blocks (the forward stream's), read by
        # the side stream's copy: record_stream is what keeps them.
        self.assertEqual(sim.num_races, 0, sim.report())
        self.assertGreater(sim.num_reuses, 0)
        self.assertTrue(
            all(
                r.allocated_by.endswith("on forward")
                and r.used_by == "_copy_rows_all_layers_kernel on side"
                for r in sim.reuses
            ),
            sim.report(),
        )


if __name__ == "__main__":
    unittest.main()
