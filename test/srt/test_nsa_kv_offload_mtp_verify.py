"""MTP target verify with the decode NSA KV offload, driven through the real
sglang pools (CPU integration, docs/MTP.md).

The real ``NSAKVOffloadTokenToKVPool``, ``NSAKVOffloadTokenToKVPoolAllocator``
and ``NSAKVOffloadCoordinator`` (built for ``q`` query tokens) of
``offload_harness.OffloadHarness``; the test plays EAGLE's part of a
decode step with ``s`` draft steps (``q = s + 1``):

* ``prepare_for_decode`` (speculative): requests the prefill hook missed
  admitted before the step's locs exist;
* ``alloc_extend`` of ``q`` locs per request, written to ``req_to_token``,
  then ``prepare_speculative_decode`` and ``prepare_v2_verify``: every loc
  mapped to its window ring row, staging untouched;
* the ``TARGET_VERIFY`` forward, padded like a CUDA-graph replay: every layer
  hands its top-k over (the early swap starts), writes the ``q`` tokens' KV,
  then its page table comes from the sparse backend's ``forward_extend``
  (``DeepseekSparseAttnBackend``: the patched method, with the FlashMLA call captured) or the hook directly;
  each query token's row must hold exactly the KV of its top-k positions
  (full-KV reference), and the last layer writes all ``q`` tokens back to
  host memory;
* ``verify()``: ``a`` drafts accepted, the rejected locs of wholly empty pages
  freed; the next step verifies at the accepted length.

On CPU the swap, the copies and the KV row write take their torch paths
(``mtp_verify_sim.cpu_torch_paths``): what is under test is where the rows go
(the kernels have their own tests; on CUDA the same tests run them).
"""

import importlib.util
import random
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import offload_harness
import test_nsa_kv_offload_sizing as sizing_tests
import torch
from mtp_verify_sim import cpu_torch_paths
from offload_harness import (
    DEVICE,
    KV_LORA_RANK,
    PAGE,
    ROPE_DIM,
    OffloadHarness,
)
from sglang.srt.layers.attention import nsa_offload_hooks
from sglang.srt.mem_cache.nsa_kv_offload_sizing import (
    NSA_KV_OFFLOAD_DRAFT_LAYERS,
    compute_offload_pool_sizes,
    lru_slot_id_bytes,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sparse_backend import IMPL, SparseAttnBackend, TopkTransformMethod, forward_backend

_PATCHES = cpu_torch_paths()


def setUpModule():
    # The allocator's Triton kernel replaced on CPU (the harness), then the
    # torch paths.
    offload_harness.setUpModule()
    for patch in _PATCHES:
        patch.start()


def tearDownModule():
    for patch in reversed(_PATCHES):
        patch.stop()
    offload_harness.tearDownModule()


def _backend(coordinator, captured, kv_pool=None):
    """The attributes of sglang's sparse backend (``SparseAttnBackend``) its
    ``forward_extend`` and ``get_indexer_metadata`` read on the TARGET_VERIFY
    path (fused top-k on, as by default), FlashMLA replaced by a capture."""

    def flashmla_kv(**kwargs):
        captured.append(kwargs["page_table_1"])
        return kwargs["q_all"]

    return SimpleNamespace(
        forward_metadata=SimpleNamespace(
            paged_mqa_schedule_metadata=None, paged_mqa_ctx_lens_2d=None
        ),
        **{
            f"{IMPL}_decode_impl": "flashmla_kv",
            f"{IMPL}_prefill_impl": "flashmla_sparse",
        },
        use_mha=False,
        use_fused_topk=True,
        hisparse_coordinator=None,
        token_to_kv_pool=kv_pool,
        dsa_topk_backend=None,
        nsa_kv_offload=coordinator,
        get_topk_transform_method=lambda mode=None: TopkTransformMethod.PAGED,
        _pad_topk_indices=lambda topk, rows: topk,
        _forward_flashmla_kv=flashmla_kv,
        # 0.5.23: the kpool tail (index_kpool 1: none).
        _resolve_kpool_tail_backend=lambda topk, impl: impl,
        _check_kpool_tail_backend=lambda topk, impl, phase: None,
    )


class _MTPHarness(OffloadHarness):
    def __init__(self, test, steps, **kw):
        self.s, self.q = steps, steps + 1
        super().__init__(test, query_tokens=steps + 1, **kw)
        # As create_nsa_kv_offload_allocator builds it with MTP on.
        test.assertTrue(self.allocator.speculative)

    def prepare_verify(self, reqs):
        """The verify's ``q`` locs per request + the patched hooks."""
        q, alloc = self.q, self.allocator
        idx = torch.tensor([r.req_pool_idx for r in reqs], device=DEVICE)
        pre = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
        seq = pre + q
        last = self.req_to_token[idx, pre.to(DEVICE) - 1].long()
        staging_before = alloc.staging.available_pages()
        staging_rows = alloc.page_to_staging_row.clone()
        out = alloc.alloc_extend(
            pre.to(DEVICE), pre, seq.to(DEVICE), seq, last, len(reqs) * q
        )
        self.t.assertIsNotNone(out)
        for b, r in enumerate(reqs):
            n = r.seq_len
            self.req_to_token[r.req_pool_idx, n : n + q] = out[
                b * q : (b + 1) * q
            ].int()
        batch = SimpleNamespace(
            reqs=reqs,
            seq_lens=pre.to(DEVICE),
            seq_lens_cpu=pre,
            req_pool_indices=idx,
            out_cache_loc=out,
        )
        self.co.prepare_speculative_decode(batch)
        self.co.prepare_v2_verify(batch, q)
        # Locs only: staging untouched (a prompt being chunked keeps its own).
        self.t.assertEqual(alloc.staging.available_pages(), staging_before)
        self.t.assertTrue(torch.equal(alloc.page_to_staging_row, staging_rows))
        self.t.assertTrue(bool((alloc.page_to_staging_row[out // PAGE] == -1).all()))
        # Every draft's KV goes to its window ring row.
        base = self.co.lru.region_base[idx].long().repeat_interleave(q)
        pos = (pre[:, None] + torch.arange(q)).reshape(-1).to(DEVICE)
        self.t.assertTrue(
            torch.equal(self.pool.loc_to_row[out], base + self.C + pos % self.W)
        )
        return out, pre

    def verify_forward(self, reqs, out, pre, pad_reqs=0, backend_layers=()):
        q, bs = self.q, len(reqs)
        idx = torch.tensor([r.req_pool_idx for r in reqs], device=DEVICE)
        # Padded like a CUDA-graph replay: pool index 0, seq_len 1, locs 0.
        fb = SimpleNamespace(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            out_cache_loc=torch.cat(
                [out, torch.zeros(pad_reqs * q, dtype=out.dtype, device=DEVICE)]
            ),
            req_pool_indices=torch.cat(
                [idx, torch.zeros(pad_reqs, dtype=idx.dtype, device=DEVICE)]
            ),
            seq_lens=torch.cat(
                [pre.to(DEVICE), torch.ones(pad_reqs, dtype=torch.int64, device=DEVICE)]
            ),
            token_to_kv_pool=self.pool,
            hisparse_coordinator=None,
            attn_backend=SimpleNamespace(nsa_kv_offload=self.co),
        )
        self.t.assertTrue(nsa_offload_hooks.use_positional_topk(self.co, fb))
        with forward_backend(fb.attn_backend):
            self._verify_layers(reqs, out, pre, pad_reqs, backend_layers, fb)
        # The last layer's hook wrote all q tokens of every layer back.
        self.check_host(out)

    def _verify_layers(self, reqs, out, pre, pad_reqs, backend_layers, fb):
        q, bs = self.q, len(reqs)
        self.co.before_forward(fb)
        self.co.num_real_reqs.fill_(-1)  # left over from another batch
        rows_total = (bs + pad_reqs) * q
        for layer in range(self.L):
            # Query j of a request at position n + j sees positions <= n + j.
            topk = torch.stack(
                [
                    self.pick_topk(int(pre[b]) + j + 1)
                    for b in range(bs)
                    for j in range(q)
                ]
                + [self.pick_topk(8) for _ in range(pad_reqs * q)]
            ).to(DEVICE, torch.int32)
            # The model hands the top-k over after its indexer (the early
            # swap starts), the layer writes the q tokens' KV, then attends.
            nsa_offload_hooks.begin_layer_swap(fb, layer, topk)
            self.t.assertIn(layer, self.co._early_page_tables)
            self.write_kvlayer_arg(layer, out)
            if layer in backend_layers:
                captured = []
                lyr = SimpleNamespace(
                    is_cross_attention=False,
                    layer_id=layer,
                    tp_q_head_num=1,
                    v_head_dim=KV_LORA_RANK,
                    head_dim=KV_LORA_RANK + ROPE_DIM,
                    scaling=1.0,
                )
                # bf16 as the model's: sglang 0.5.17's CUDA concat of q takes
                # bf16 only.
                q_nope = torch.zeros(
                    (rows_total, 1, KV_LORA_RANK), device=DEVICE, dtype=torch.bfloat16
                )
                q_rope = torch.zeros(
                    (rows_total, 1, ROPE_DIM), device=DEVICE, dtype=torch.bfloat16
                )
                SparseAttnBackend.forward_extend(
                    _backend(self.co, captured, self.pool),
                    q_nope,
                    None,
                    None,
                    lyr,
                    fb,
                    save_kv_cache=False,
                    q_rope=q_rope,
                    topk_indices=topk,
                )
                (page_table,) = captured
            else:
                page_table = nsa_offload_hooks.verify_page_table(
                    self.co, fb, layer, topk
                )
            self.t.assertEqual(int(self.co.num_real_reqs[0]), bs)
            self.t.assertEqual(int(self.co.num_real_tokens[0]), bs * q)
            self.check_verify_page_table(layer, reqs, pre, topk, page_table, pad_reqs)

    def check_verify_page_table(self, layer, reqs, pre, topk, page_table, pad_reqs):
        q, bs = self.q, len(reqs)
        self.t.assertEqual(page_table.shape, ((bs + pad_reqs) * q, self.K))
        self.t.assertEqual(page_table.dtype, torch.int32)
        self.t.assertTrue(bool((page_table[bs * q :] == -1).all()), "padding rows")
        for b, req in enumerate(reqs):
            r = req.req_pool_idx
            for j in range(q):
                row = b * q + j
                pos, rows = topk[row], page_table[row]
                valid = (pos >= 0) & (pos <= int(pre[b]) + j)
                self.t.assertTrue(bool((rows[~valid] == -1).all()))
                rows, pos = rows[valid].long(), pos[valid].long()
                locs = self.req_to_token[r, pos].long()
                bad = (self.rows_bytes(layer, rows) != self.ref[layer, locs]).any(1)
                self.t.assertFalse(
                    bool(bad.any()),
                    f"layer {layer} req {req.rid} query {j}: positions "
                    f"{pos[bad].tolist()} read wrong KV",
                )

    def accept(self, reqs, out, pre, accepts):
        """``verify()``: ``a`` drafts accepted; the rejected locs of wholly
        empty pages freed (the others stay in ``req_to_token``)."""
        q = self.q
        for b, (req, a) in enumerate(zip(reqs, accepts)):
            n = int(pre[b])
            new_len = n + a + 1
            freed = [
                out[b * q + j]
                for j in range(a + 1, q)
                if (n + j) // PAGE * PAGE >= new_len
            ]
            if freed:
                self.allocator.free(torch.stack(freed))
            req.seq_len = req.kv_committed_len = new_len

    def spec_step(self, reqs, accepts, pad_reqs=0, backend_layers=()):
        # ScheduleBatch.prepare_for_decode (speculative: the patched hook
        # admits requests the prefill hook missed, before the step's locs).
        seq = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
        self.co.admit_running(SimpleNamespace(reqs=reqs, seq_lens_cpu=seq))
        out, pre = self.prepare_verify(reqs)
        self.verify_forward(reqs, out, pre, pad_reqs, backend_layers)
        self.accept(reqs, out, pre, accepts)


# Verify steps per harness run of test_verify_steps.
STEPS = 5


class TestMTPVerify(unittest.TestCase):
    def _harness(self, steps, **kw):
        top_k = 32
        return _MTPHarness(
            self,
            steps,
            top_k=top_k,
            buffer_size=(steps + 2) * top_k,
            window=2 * (steps + 1) + 2,
            num_locs=16 * PAGE,
            num_regions=3,
            max_reqs=3,
            **kw,
        )

    def test_verify_steps(self):
        for steps in (1, 3):
            with self.subTest(steps=steps):
                h = self._harness(steps, seed=steps)
                rng = random.Random(steps)
                # Prompts ending just before a page boundary: the drafts cross it.
                a, b = h.new_req(), h.new_req()
                h.prefill([(a, PAGE - 2), (b, 40)])
                straggler = h.new_req()
                h.prefill([(straggler, 70)], admit=False)
                reqs = [a, b, straggler]
                for step in range(STEPS):
                    if step == 0:
                        accepts = [steps, 0, 1 % (steps + 1)]
                    else:
                        accepts = [rng.randint(0, steps) for _ in reqs]
                    h.spec_step(
                        reqs,
                        accepts,
                        pad_reqs=step % 2,
                        backend_layers=(0,) if step % 2 else (1,),
                    )
                    self.assertTrue(all(h.co.is_admitted(r) for r in reqs))
                # The LRU never holds a draft: its slots hold committed locs.
                for r in reqs:
                    held = h.co.lru.slot_loc[:, r.req_pool_idx]
                    held = held[held >= 0].long()
                    committed = h.req_to_token[r.req_pool_idx, : r.seq_len].long()
                    self.assertTrue(bool(torch.isin(held, committed).all()))
                # The verifies went through host reads.
                self.assertGreater(h.controller.get_stats()["misses"], 0)
                for r in reqs:
                    h.finish(r)
                self.assertEqual(h.snapshot(), h.initial)

    def test_prefill_next_to_verify_keeps_staging(self):
        """A prompt being chunked holds staging pages while the running
        requests verify: its next chunk still gets staging, the drafts not."""
        h = self._harness(2)
        a = h.new_req()
        h.prefill([(a, 50)])
        chunked = h.new_req()
        h.prefill([(chunked, PAGE + 10)], chunked_req=chunked)
        held = h.staging_room()
        h.spec_step([a], [2])
        self.assertEqual(h.staging_room(), held)
        h.prefill([(chunked, PAGE)])  # completes; one new staging page
        self.assertTrue(h.co.is_admitted(chunked))
        h.spec_step([a, chunked], [1, 0], pad_reqs=1)
        for r in (a, chunked):
            h.finish(r)
        self.assertEqual(h.snapshot(), h.initial)

    def test_prefill_without_speculative_skips_the_check(self):
        """Telling decoding requests from prompts syncs with the GPU: a server
        without MTP never pays it (its prefills keep the overlap scheduler)."""
        h = self._harness(1)
        h.allocator.speculative = False
        with mock.patch.object(
            h.allocator, "_extends_decoding_reqs", side_effect=AssertionError
        ):
            a = h.new_req()
            h.prefill([(a, PAGE + 5)])
        h.finish(a)
        self.assertEqual(h.snapshot(), h.initial)

    def test_indexer_topk_positional_in_verify(self):
        h = self._harness(1)
        backend = _backend(h.co, [])
        for mode, positional in (
            (ForwardMode.TARGET_VERIFY, True),
            (ForwardMode.DECODE, True),
            (ForwardMode.EXTEND, False),
        ):
            fb = SimpleNamespace(forward_mode=mode, hisparse_coordinator=None)
            meta = SparseAttnBackend.get_indexer_metadata(backend, 0, fb)
            self.assertEqual(meta.force_unfused_topk, positional, mode)
        backend.nsa_kv_offload = None
        fb = SimpleNamespace(
            forward_mode=ForwardMode.TARGET_VERIFY, hisparse_coordinator=None
        )
        meta = SparseAttnBackend.get_indexer_metadata(backend, 0, fb)
        self.assertFalse(meta.force_unfused_topk)

    def test_query_tokens_checked(self):
        h = self._harness(2)
        batch = SimpleNamespace(reqs=[])
        with self.assertRaises(ValueError) as ctx:
            h.co.prepare_v2_verify(batch, 2)
        self.assertIn("built for 3", str(ctx.exception))


class TestDraftWorkerPool(sizing_tests.TinyConfigDirCase):
    """The NextN layer's KV stays on the GPU in a plain NSA pool of the
    draft worker, one row per token loc: its bytes are counted per loc."""

    def _configurator(self, **overrides):
        from sglang.srt.model_executor.pool_configurator import (
            create_memory_pool_configurator,
        )

        cases = sizing_tests.TestServerArgsToPools
        args = cases._server_args(self, nsa_kv_offload_host_pool_gb=32.0, **overrides)
        return create_memory_pool_configurator(cases._model_runner(self, args, 1))

    def test_draft_bytes_per_loc(self):
        mtp = dict(
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=4,
            disable_overlap_schedule=True,
            max_running_requests=48,  # sglang's speculative default
        )
        # One unit a request: no idle-loc units, whose LRU state the locs
        # would also pay.
        one_unit = dict(nsa_kv_offload_max_units=1)
        plain = self._configurator(**one_unit)
        spec = self._configurator(**one_unit, **mtp)
        self.assertEqual(plain.extra_bytes_per_loc, 0)
        self.assertEqual(NSA_KV_OFFLOAD_DRAFT_LAYERS, 1)
        self.assertEqual(spec.extra_bytes_per_loc, 656 + 132)  # fp8 KV + keys
        o = spec.options
        self.assertEqual(o.buffer_size, 5 * 2048)  # (q + 1) x index_topk
        self.assertEqual(o.query_tokens, 4)
        self.assertEqual(spec._num_regions(1 << 40), 48)
        avail = 4 << 30
        sizes = spec.compute_sizes(avail, PAGE)
        self.assertEqual(sizes.idle_loc_units, 0)
        expect = compute_offload_pool_sizes(
            available_bytes=avail,
            num_layers=spec.num_layers,
            row_bytes=spec.row_bytes,
            indexer_bytes=spec.indexer_bytes,
            page_size=PAGE,
            buffer_size=o.buffer_size,
            recent_window=o.recent_window,
            num_regions=48,
            staging_rows=spec.staging_rows(48, PAGE),
            host_pool_bytes=spec.host_pool_bytes,
            max_units=o.max_units,
            # The swap's scratch is as wide as the verify's query tokens.
            swap_scratch_bytes=spec.swap_scratch_bytes(48),
        )
        # A loc's bytes: per layer its indexer keys and slot id, its row map.
        slot_id = lru_slot_id_bytes(o.buffer_size, o.max_units)
        fewer = (expect.num_locs * spec.extra_bytes_per_loc) // (
            3 * (132 + slot_id) + 8 + spec.extra_bytes_per_loc
        )
        self.assertLess(sizes.num_locs, expect.num_locs)
        self.assertLessEqual(abs(expect.num_locs - sizes.num_locs - fewer), 2 * PAGE)

    def test_draft_worker_builds_no_offload(self):
        # The draft worker's model runner builds neither the coordinator nor
        # the offload pool (its backend then reads its KV by token loc).
        def source(module):
            return Path(importlib.util.find_spec(module).origin).read_text()

        runner = source("sglang.srt.model_executor.model_runner")
        at = runner.index("create_nsa_kv_offload_coordinator(self)")
        self.assertIn("and not self.is_draft_worker", runner[at - 400 : at])
        mixin = source("sglang.srt.mem_cache.kv_cache_configurator")
        at = mixin.index("nsa_kv_offload_pool_kwargs,")
        self.assertIn("and not self.is_draft_worker", mixin[at - 300 : at])
        self._check_spec_v2_hooks(source)

    def _check_spec_v2_hooks(self, source):
        # Spec v2 only. Admitted before spec_prepare_for_decode
        # allocates ahead; the verify's q locs mapped once they are read
        # from req_to_token, before its ForwardBatch exists.
        batch = source("sglang.srt.managers.schedule_batch")
        admit = batch.index("offload.prepare_speculative_decode(self)")
        self.assertLess(admit, batch.index("spec_prepare_for_decode(self)\n"))
        verify = source("sglang.srt.speculative.eagle_utils")
        hook = verify.index(
            "offload.prepare_v2_verify(batch, verify_input.draft_token_num)"
        )
        self.assertLess(
            verify.index("= assign_extend_cache_locs_uniform_func(\n"), hook
        )
        self.assertLess(
            hook, verify.index("verify_forward_batch = ForwardBatch.init_new")
        )


if __name__ == "__main__":
    unittest.main()
