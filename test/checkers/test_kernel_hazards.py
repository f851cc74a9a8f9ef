"""The offload's Triton kernels have no data race the interpreter could hide;
the diagnosis tools for GPU-only faults find what they are meant to.

Under ``TRITON_INTERPRET=1`` a launch's programs run one after another and
every memory op on a whole block at once, so a missing barrier or two
programs sharing an address pass every CPU test and may still fail on the
GPU. ``triton_hazards.record_hazards`` records the kernels' loads and stores
while the lockstep simulations and the one-request-at-a-time server run
drive them, and every swap, copy and mapping kernel must come out clean.
The checker's own tests show it finds such races (a kernel without its
barrier, programs that share stores), and so does the swap kernel with its
barriers ignored. CPU only: on CUDA the kernels are compiled.

``lru_shadow.shadow_reference`` (the torch reference swap beside every
Triton swap, for the GPU bisect) must name a wrong kernel output: a page
table entry or an ``lru_order`` entry changed behind the kernel's back.
"""

import unittest
from unittest import mock

import torch
import triton
import triton.language as tl
from lru_shadow import shadow_reference
from mtp_verify_sim import VerifyConfig, run_verify_sim
from offload_scenarios import (  # noqa: F401 (module fixtures)
    OneRequestAtATime,
    setUpModule,
    tearDownModule,
)
from sglang.srt.mem_cache.lru_cache_state import default_use_triton
from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import TritonLRUSwap
from test_lru_cache_state import SimConfig, new_state, run_sim, swap_request_0
from triton_hazards import record_hazards

INTERPRETED = not torch.cuda.is_available() and default_use_triton(torch.device("cpu"))
SKIP = "the checker hooks the Triton interpreter (TRITON_INTERPRET=1, CPU)"


@triton.jit
def _reversed_copy(x_ptr, y_ptr, BLOCK: tl.constexpr, BARRIER: tl.constexpr):
    # Writes a block, then reads it back in reverse: other threads' stores.
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, offs)
    if BARRIER:
        tl.debug_barrier()
    tl.store(y_ptr + offs, tl.load(x_ptr + BLOCK - 1 - offs))


@triton.jit
def _increment(x_ptr, BLOCK: tl.constexpr, BARRIER: tl.constexpr):
    # Reads a block and writes it back: each thread its own elements, unless
    # the block is smaller than the threads (every replica loads, one stores).
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    if BARRIER:
        tl.debug_barrier()
    tl.store(x_ptr + offs, x + 1)


@triton.jit
def _shifted_copy(x_ptr, y_ptr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    # y[i] = x[i + 1]: the last read is past x unless masked.
    offs = tl.arange(0, BLOCK)
    mask = offs + 1 < BLOCK if MASKED else offs < BLOCK
    tl.store(y_ptr + offs, tl.load(x_ptr + offs + 1, mask=mask, other=0))


@triton.jit
def _every_program_stores(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, offs + tl.program_id(0))


@triton.jit
def _scatter(x_ptr, idx_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + tl.load(idx_ptr + offs), offs)


@unittest.skipUnless(INTERPRETED, SKIP)
class TestHazardChecker(unittest.TestCase):
    def setUp(self):
        self.x = torch.zeros(16, dtype=torch.int32)
        self.y = torch.zeros(16, dtype=torch.int32)

    def test_missing_barrier(self):
        with record_hazards() as log:
            _reversed_copy[(1,)](self.x, self.y, BLOCK=16, BARRIER=False)
        self.assertEqual(log.counts(), {("_reversed_copy", "threads"): 1})
        # The interpreter itself computes the right answer all the same.
        self.assertEqual(self.y.tolist(), list(range(15, -1, -1)))

    def test_barrier(self):
        with record_hazards() as log:
            _reversed_copy[(1,)](self.x, self.y, BLOCK=16, BARRIER=True)
        self.assertEqual(log.counts(), {})
        self.assertEqual(log.launches, {"_reversed_copy": 1})
        with record_hazards(ignore_barriers=True) as log:
            _reversed_copy[(1,)](self.x, self.y, BLOCK=16, BARRIER=True)
        self.assertEqual(log.counts(), {("_reversed_copy", "threads"): 1})

    def test_replicated_block(self):
        x = torch.zeros(256, dtype=torch.int32)
        for block, barrier, found in (
            (256, False, {}),  # 128 threads, 2 elements each
            (64, False, {("_increment", "threads"): 1}),  # 2 threads each
            (64, True, {}),
        ):
            with record_hazards() as log:
                _increment[(1,)](x, BLOCK=block, BARRIER=barrier, num_warps=4)
            self.assertEqual(log.counts(), found, (block, barrier))
        self.assertEqual(x[:64].tolist(), [3] * 64)

    def test_out_of_bounds(self):
        # x is a view: the bound is its storage's end, not the view's.
        x = torch.arange(32, dtype=torch.int32)
        past_end = {("_shifted_copy", "bounds"): 1}
        for view, masked, found in (
            (x[:16], False, {}),
            (x[16:], True, {}),
            (x[16:], False, past_end),
            (x[:16].clone(), False, past_end),
        ):
            with record_hazards() as log:
                _shifted_copy[(1,)](view, self.y, BLOCK=16, MASKED=masked)
            self.assertEqual(log.counts(), found)
        self.assertIn("load", log.hazards[0].ops)

    def test_programs_sharing_stores(self):
        with record_hazards() as log:
            _every_program_stores[(1,)](self.x, BLOCK=16)
        self.assertEqual(log.counts(), {})
        with record_hazards() as log:
            _every_program_stores[(3,)](self.x, BLOCK=16)
        self.assertEqual(log.counts(), {("_every_program_stores", "programs"): 1})

    def test_conflicting_scatter(self):
        idx = torch.arange(16, dtype=torch.int32)
        with record_hazards() as log:
            _scatter[(1,)](self.x, idx, BLOCK=16)
        self.assertEqual(log.counts(), {})
        idx[3] = 5
        with record_hazards() as log:
            _scatter[(1,)](self.x, idx, BLOCK=16)
        self.assertEqual(log.counts(), {("_scatter", "scatter"): 1})


@unittest.skipUnless(INTERPRETED, SKIP)
class TestSwapKernels(unittest.TestCase):
    """The lockstep simulations of test_lru_cache_state and the multi-token
    tests, recorded: one-token swaps (one unit; units with the reorder
    deferred; direct slots) and verify swaps."""

    ONE_TOKEN = [
        "_swap_select_kernel",
        "_swap_count_kernel",
        "_swap_rank_kernel",
        "_swap_copy_order_kernel",
    ]

    def assert_clean(self, log, kernels):
        self.assertEqual(log.counts(), {}, log.report())
        for kernel in kernels:
            self.assertGreater(log.launches.get(kernel, 0), 0, kernel)

    def test_one_unit(self):
        cfg = SimConfig(C=48, K=32, W=7, max_batch=5, p_admit=0.6)
        with record_hazards() as log:
            run_sim(self, cfg, (True,), steps=6, seed=5)
        self.assert_clean(log, self.ONE_TOKEN)

    def test_units_deferred(self):
        cfg = SimConfig(C=48, K=32, W=5, units=3, max_batch=4, p_keep=0.4)
        with record_hazards() as log:
            run_sim(self, cfg, ("deferred",), steps=8, seed=9)
        self.assert_clean(log, self.ONE_TOKEN)

    def test_direct_slots(self):
        cfg = SimConfig(
            C=32, K=16, W=4, units=3, max_prompt=40, direct=True, p_keep=0.6
        )
        with record_hazards() as log:
            sim = run_sim(self, cfg, (True,), steps=25, seed=17)
        self.assertGreater(sim.direct_entered, 3)
        self.assertGreater(sim.model.direct_ended, 0)  # a row left direct mode
        self.assert_clean(log, self.ONE_TOKEN)

    def test_verify_swaps(self):
        cfg = VerifyConfig(layers=1, K=8, q_max=3, C=24, W=5, units=3, max_batch=4)
        with record_hazards() as log:
            run_verify_sim(self, cfg, ("triton",), 6, 4)
        self.assert_clean(
            log,
            [
                "_swap_multi_classify_kernel",
                "_swap_count_kernel",
                "_swap_rank_kernel",
                "_swap_multi_assign_kernel",
            ],
        )

    def test_barriers_ignored(self):
        # The control: without their barriers the swap kernels race, and the
        # checker sees it on the same run.
        cfg = SimConfig(C=48, K=32, W=5, units=3, max_batch=4, p_keep=0.4)
        with record_hazards(ignore_barriers=True) as log:
            run_sim(self, cfg, (True,), steps=4, seed=9)
        found = {kernel for kernel, kind in log.counts() if kind == "threads"}
        self.assertIn("_swap_select_kernel", found)


@unittest.skipUnless(INTERPRETED, SKIP)
class TestOneRequestAtATimeRecorded(OneRequestAtATime):
    """The server's kernels (swaps, miss copies, new-token backups, mapping)
    through the real coordinator, with the settings of ``ours_fp8_2units``
    that gave wrong tokens on the H200 (warm units and direct slots at 2
    units, the early swap): no race."""

    def test_server_settings_two_units(self):
        with record_hazards() as log:
            # The all-layer copies reach every layer's KV and host rows
            # through tables of their addresses.
            self.harness_ready = lambda h: log.reachable(
                *h.controller._device_rows, *h.controller._host_rows
            )
            self._run(2)
        self.assertEqual(log.counts(), {}, log.report())
        for kernel in (
            "_swap_select_kernel",
            "_swap_rank_kernel",
            "_gather_rows_kernel",
            "_copy_rows_all_layers_kernel",
            "_map_new_tokens_kernel",
        ):
            self.assertGreater(log.launches.get(kernel, 0), 0, kernel)


@unittest.skipUnless(default_use_triton(torch.device("cpu")), SKIP)
class TestShadowReference(unittest.TestCase):
    def _swaps(self):
        # Request 0 with two units, three swaps with misses and hits.
        cfg = SimConfig(layers=1, C=8, K=4, W=2, max_reqs=2, num_locs=64, units=2)
        state = new_state(cfg, True)
        state.admit_request(0, 100)
        state.grow_request(0, 1, 500)
        r2t = torch.arange(64, dtype=torch.int32).reshape(1, 64).repeat(2, 1)
        with shadow_reference(state) as compared:
            for positions in ([0, 1, 2, 3], [4, 5, 1, 9], [0, 9, 20, 21]):
                swap_request_0(state, positions, 40, r2t)
        return compared

    def test_agrees(self):
        compared = self._swaps()
        self.assertEqual((compared.swaps, compared.compared_orders), (3, 3))

    def test_wrong_page_table(self):
        swap_layer = TritonLRUSwap.swap_layer

        def wrong(self, *args, **kwargs):
            plan = swap_layer(self, *args, **kwargs)
            plan.page_table[0, 1] += 1  # the page table's second entry
            return plan

        with mock.patch.object(TritonLRUSwap, "swap_layer", wrong):
            with self.assertRaisesRegex(
                AssertionError, r"(?s)swap 1 \(layer 0\).*page_table differs"
            ):
                self._swaps()

    def test_wrong_order(self):
        finish = TritonLRUSwap.finish_reorder

        def wrong(self):
            pending = self._pending_reorder
            finish(self)
            if pending is not None:
                lru = pending[2][2]  # (state, batch, maps, plan): lru_order
                lru[0, :2] = lru[0, :2].flip(0)

        with mock.patch.object(TritonLRUSwap, "finish_reorder", wrong):
            with self.assertRaisesRegex(
                AssertionError, r"(?s)swap 1 .*after the reorder.*lru_order differs"
            ):
                self._swaps()


if __name__ == "__main__":
    unittest.main()
