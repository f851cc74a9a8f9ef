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
"""

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
from stream_races import FakeStream, simulate_streams
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
