"""DP attention with the decode NSA KV offload: what other ranks force on a rank (CPU).

With ``--enable-dp-attention`` (dp = tp) every rank schedules its own requests
into its own pools, coordinator and host pool; the MoE layers' collectives
make every rank run each forward, so a rank also runs batches it did not ask
for (docs/MULTI_GPU.md):

* IDLE batches (no request on this rank): ``prepare_for_decode`` is not called
  (``ScheduleBatch.prepare_for_idle``); eager, sglang's attention backend
  returns before ``forward_decode``, so the offload's decode hook never runs;
  through a CUDA graph (captured as DECODE) every row is padding: the swap
  must change nothing (LRU state, host rows, counters), even with a live
  request's stale pool index in the padding rows;
* decode batches padded to the largest rank's batch (``DpPaddingMode.MAX_LEN``,
  ``ForwardBatch._pad_inputs_to_size``): the padding rows must be inert and the
  real rows exact;
* ``--max-running-requests`` counts all DP ranks: a rank sizes its decode
  regions for its share, as sglang's ``_resolve_max_num_reqs`` does.
"""

import os
import unittest
from types import SimpleNamespace
from unittest import mock

import offload_harness
import test_nsa_kv_offload_sizing as sizing_tests
import torch
from mtp_verify_sim import cpu_torch_paths
from offload_harness import DEVICE, PAGE, OffloadHarness
from sglang.srt.layers.attention import nsa_offload_hooks
from sglang.srt.mem_cache.lru_cache_state import LayerSwapPlan
from sglang.srt.mem_cache.nsa_kv_offload_sizing import NSAKVOffloadPoolConfigurator
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sparse_backend import SparseAttnBackend

# The offload refuses DP attention unless it is set (read through
# sglang.srt.environ.envs when the server args are handled).
ENV_UNPROVEN_PARALLEL = "SGLANG_NSA_KV_OFFLOAD_UNPROVEN_PARALLEL"
# On CPU: the torch swap, copies and KV rows (what is under test is which
# rows a forward touches; the kernels have their own tests).
_PATCHES = cpu_torch_paths()


def setUpModule():
    offload_harness.setUpModule()  # the CPU stand-in of alloc_extend's kernel
    for patch in _PATCHES:
        patch.start()


def tearDownModule():
    for patch in reversed(_PATCHES):
        patch.stop()
    offload_harness.tearDownModule()


class _ProbeBackend(SparseAttnBackend):
    """sglang's NSA backend with its per-mode entry points recorded (nothing
    else of it is built)."""

    def __init__(self):
        self.calls = []

    def forward_decode(self, *args, **kwargs):
        self.calls.append("decode")

    def forward_extend(self, *args, **kwargs):
        self.calls.append("extend")


def _state(h):
    """Everything a forward may change in the offload of ``h``."""
    lru = h.co.lru
    return dict(
        slot_loc=lru.slot_loc.clone(),
        lru_order=lru.lru_order.clone(),
        loc_to_slot=lru.loc_to_slot.clone(),
        region_base=lru.region_base.clone(),
        counters=h.controller.counters.clone(),
        lru_counters=lru.counters.clone(),
        host=h.controller.host_pool.kv_buffer.clone(),
        kv=[b.clone() for b in h.pool.kv_buffer],
    )


def _assert_same_state(t, before, after):
    for name, old in before.items():
        new = after[name]
        if isinstance(old, list):
            for i, (a, b) in enumerate(zip(old, new)):
                t.assertTrue(torch.equal(a, b), f"{name}[{i}] changed")
        else:
            t.assertTrue(torch.equal(old, new), f"{name} changed")


def _decode_forward_batch(reqs, out):
    seq = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(reqs),
        input_ids=torch.zeros(len(reqs), dtype=torch.int64, device=DEVICE),
        req_pool_indices=torch.tensor(
            [r.req_pool_idx for r in reqs], dtype=torch.int64, device=DEVICE
        ),
        seq_lens=seq.to(DEVICE),
        seq_lens_cpu=seq,
        out_cache_loc=out,
        seq_lens_sum=int(seq.sum()),
        positions=(seq - 1).to(DEVICE),
    )


def _pad_like_dp_max_len(fb, num_tokens):
    """sglang's padding of a DP-attention batch to ``num_tokens`` rows (decode:
    one token per request), with the NSA backend's fill value."""
    fill = SparseAttnBackend.get_cuda_graph_seq_len_fill_value(None)
    mr = SimpleNamespace(
        attn_backend=SimpleNamespace(get_cuda_graph_seq_len_fill_value=lambda: fill)
    )
    fb.lora_ids = [None] * fb.batch_size
    fb._pad_inputs_to_size(mr, num_tokens, num_tokens)
    fb.batch_size = num_tokens  # as prepare_mlp_sync_batch sets it
    return fb


# The defaults on a rank of its own (DP attention): units, and with them warm
# units and direct slots (A's 150 tokens fit its 2 units). Without ({}): one
# fixed buffer a request (direct slots too; A's context outgrows it).
ELASTIC_SETTINGS = dict(max_units=2, num_regions=3)


class TestIdleBatches(unittest.TestCase):
    def _running_harness(self, **kwargs):
        """One request A prefilled, admitted and two steps into decode."""
        h = OffloadHarness(self, max_reqs=3, **kwargs)
        self.assertTrue(h.options.direct_slots)
        self.assertEqual(h.options.warm_units, bool(kwargs))
        a = h.new_req()
        h.prefill([(a, 150)])
        h.decode_step([a], first_step_of=(a,))
        h.decode_step([a])
        direct = int(h.controller.lru.direct[a.req_pool_idx])
        self.assertEqual(direct, 1 if kwargs else 0)
        return h, a

    def test_eager_idle_never_reaches_the_decode_hook(self):
        # ForwardMode.IDLE, unpadded (0 rows) or padded to another rank's
        # batch (MAX_LEN): sglang's backend returns an empty output.
        backend = _ProbeBackend()
        layer = SimpleNamespace(tp_q_head_num=4, v_head_dim=8, layer_id=0)
        for rows in (0, 3):
            fb = SimpleNamespace(forward_mode=ForwardMode.IDLE, batch_size=rows)
            q = torch.zeros(rows, 4 * 24)
            out = backend.forward(q, q, q, layer, fb)
            self.assertEqual(tuple(out.shape), (rows, 32))
        self.assertEqual(backend.calls, [])
        decode = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=1)
        backend.forward(torch.zeros(1, 96), None, None, layer, decode)
        self.assertEqual(backend.calls, ["decode"])

    def test_eager_idle_forward_changes_nothing(self):
        for kwargs in ({}, ELASTIC_SETTINGS):
            with self.subTest(default_on=bool(kwargs)):
                self._eager_idle_forward_changes_nothing(**kwargs)

    def _eager_idle_forward_changes_nothing(self, **kwargs):
        h, a = self._running_harness(**kwargs)
        before = _state(h)
        empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
        idle = SimpleNamespace(
            forward_mode=ForwardMode.IDLE,
            batch_size=0,
            out_cache_loc=empty,
            req_pool_indices=empty,
            seq_lens=empty,
        )
        h.co.before_forward(idle)
        # The indexer's top-k stays positional on IDLE, as on DECODE.
        self.assertTrue(nsa_offload_hooks.use_positional_topk(h.co, idle))
        _assert_same_state(self, before, _state(h))
        h.decode_step([a])
        h.finish(a)
        h.check_no_leaks()

    def test_idle_cuda_graph_replay_is_inert(self):
        # A CUDA graph captured for DECODE replayed for an IDLE batch
        # (raw_bs 0, padded to bs 4): seq_lens 1, out_cache_loc 0, and stale
        # req_pool_indices, here the live request's (in direct mode too).
        for kwargs in ({}, ELASTIC_SETTINGS):
            with self.subTest(default_on=bool(kwargs)):
                self._idle_cuda_graph_replay_is_inert(**kwargs)

    def _idle_cuda_graph_replay_is_inert(self, **kwargs):
        h, a = self._running_harness(**kwargs)
        before = _state(h)
        bs = 4
        fb = SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            out_cache_loc=torch.zeros(bs, dtype=torch.int64, device=DEVICE),
            req_pool_indices=torch.full(
                (bs,), a.req_pool_idx, dtype=torch.int64, device=DEVICE
            ),
            seq_lens=torch.ones(bs, dtype=torch.int64, device=DEVICE),
        )
        h.co.before_forward(fb)
        for layer in range(h.L):
            # Position 0 < seq_len 1: a real row would map it to a window row.
            topk = torch.full((bs, h.K), -1, dtype=torch.int32, device=DEVICE)
            topk[:, 0] = 0
            topk[:, 1] = 100  # would be a miss of A's were the row real
            page_table = nsa_offload_hooks.decode_page_table(h.co, fb, layer, topk)
            self.assertEqual(int(h.co.num_real_reqs[0]), 0)
            self.assertTrue(bool((page_table == -1).all()))
            plan = LayerSwapPlan(*(t[:bs] for t in h.co._plan_buffers))
            self.assertEqual(int(plan.miss_count.sum()), 0)
        _assert_same_state(self, before, _state(h))
        # A decodes on, exact.
        h.decode_step([a])
        h.decode_step([a])
        h.finish(a)
        h.check_no_leaks()

    def test_dp_max_len_padded_decode(self):
        # This rank runs 2 requests while the largest rank runs 5: sglang pads
        # the batch to 5 rows. The harness's CUDA-graph padding (pool index 0,
        # seq_len 1, out_cache_loc 0) is the same as that padding, so its
        # decode step with 3 padding rows runs what the padded batch runs.
        for kwargs in ({}, ELASTIC_SETTINGS):
            with self.subTest(default_on=bool(kwargs)):
                self._dp_max_len_padded_decode(**kwargs)

    def _dp_max_len_padded_decode(self, **kwargs):
        h = OffloadHarness(self, max_reqs=6, **kwargs)
        a, b = h.new_req(), h.new_req()
        h.prefill([(a, 90), (b, 130)])
        out = torch.tensor([11, 12], dtype=torch.int64, device=DEVICE)
        padded = _pad_like_dp_max_len(_decode_forward_batch([a, b], out), 5)
        self.assertEqual(padded.batch_size, 5)
        self.assertEqual(padded.req_pool_indices[2:].tolist(), [0, 0, 0])
        self.assertEqual(padded.seq_lens[2:].tolist(), [1, 1, 1])
        self.assertEqual(padded.out_cache_loc[2:].tolist(), [0, 0, 0])
        self.assertEqual(padded.out_cache_loc[:2].tolist(), [11, 12])
        # Within the coordinator's swap buffers (max_batch_size rows).
        self.assertGreaterEqual(h.co._plan_buffers.page_table.shape[0], 5)
        for _ in range(4):
            h.decode_step([a, b], pad_rows=3)
        h.finish(a)
        h.decode_step([b], pad_rows=4)
        h.finish(b)
        h.check_no_leaks()


class TestDPAttentionRequestShare(unittest.TestCase):
    """--max-running-requests with DP attention: a rank's share."""

    _model_runner = sizing_tests.TestServerArgsToPools._model_runner

    @classmethod
    def setUpClass(cls):
        sizing_tests.TestServerArgsToPools.setUpClass.__func__(cls)

    @classmethod
    def tearDownClass(cls):
        sizing_tests.TestServerArgsToPools.tearDownClass.__func__(cls)

    def _server_args(self, **overrides):
        with mock.patch.dict(os.environ, {ENV_UNPROVEN_PARALLEL: "1"}):
            return sizing_tests.TestServerArgsToPools._server_args(self, **overrides)

    def test_regions_per_dp_rank(self):
        args = self._server_args(
            max_running_requests=16,
            tp_size=8,
            dp_size=8,
            enable_dp_attention=True,
        )
        mr = self._model_runner(args, 256 << 20)
        mr.dp_size = 8  # ModelRunner: dp_size with DP attention, else 1
        # The KVCacheConfigurator's attention-DP width (0.5.17: ps.attn_dp_size).
        mr.ps.attn_dp_size = mr.attn_dp_size = 8
        configurator = NSAKVOffloadPoolConfigurator(mr)
        self.assertEqual(configurator.user_max_running_requests, 2)
        config = mr._resolve_memory_pool_config(0)
        # The regions the configurator sized are the requests sglang runs.
        self.assertEqual(config.max_running_requests, 2)
        sizes = configurator.compute_sizes(256 << 20, PAGE)
        self.assertEqual(sizes.num_regions, 2)
        one_rank = self._model_runner(self._server_args(max_running_requests=2), 0)
        self.assertEqual(
            NSAKVOffloadPoolConfigurator(one_rank).compute_sizes(256 << 20, PAGE),
            sizes,
        )


if __name__ == "__main__":
    unittest.main()
