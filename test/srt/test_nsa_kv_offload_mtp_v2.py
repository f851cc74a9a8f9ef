"""MTP target verify with the decode NSA KV offload under spec v2 (the overlap
scheduler), driven through the real sglang code (CPU integration,
docs/MTP.md "Spec v2"): ``spec_prepare_for_decode`` / ``eagle_prepare_for_decode``
(allocation ahead page-aligned, the bonus slot committed when the result is
processed) and ``eagle_utils.eagle_prepare_for_verify`` on the ScheduleBatch,
with ``seq_lens_cpu`` None (no verify sync).

The real pools, allocator and coordinator of ``test_nsa_kv_offload_mtp_verify``
(on CPU with its torch paths for the swap, the copies and the KV rows);
the test plays the scheduler and the model around sglang's own spec v2 code:

* ``ScheduleBatch.prepare_for_decode`` (the patched method, on a stand-in
  batch): the offload's ``prepare_speculative_decode`` admits requests the
  prefill hook missed, then ``eagle_prepare_for_decode``
  allocates ahead up to ``kv_committed_len + 2 * alloc_len_per_decode`` with
  ``alloc_paged_token_slots_extend`` and writes ``req_to_token`` (Triton
  kernel, interpreted): no staging page;
* ``eagle_prepare_for_verify`` (the patched function):
  ``assign_extend_cache_locs`` (Triton, interpreted) reads the ``q`` locs at
  ``seq_lens``, the offload's hook maps them to their ring rows;
* the ``TARGET_VERIFY`` forward, padded like a CUDA-graph replay, through the
  patched ``forward_extend`` or the hook: each query token's rows checked
  against a full-KV reference, all ``q`` tokens written back to host memory;
* the result as spec v2 processes it (``kv_committed_len += accept - 1``
  after the pre-claimed bonus slot, ``seq_lens += accept``, no loc freed),
  and finish through ``release_kv_cache`` one batch late (the request's next
  verify already ran), which frees the locs allocated ahead too.
"""

import random
import unittest
from types import SimpleNamespace
from unittest import mock

import torch
from offload_harness import DEVICE, PAGE, RELEASE_ARGS, REQ_KV_RECORD, FakeReq
from sglang.kernels.ops.speculative import cache_locs
from sglang.srt.managers import schedule_batch as schedule_batch_module
from sglang.srt.managers import utils as managers_utils
from sglang.srt.mem_cache import allocation
from sglang.srt.mem_cache import common as common_module
from sglang.srt.mem_cache.allocation import get_last_loc_torch
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.model_executor import forward_batch_info
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative import eagle_utils, spec_utils
from test_nsa_kv_offload_mtp_verify import (  # noqa: F401 (module fixtures)
    _MTPHarness,
    setUpModule,
    tearDownModule,
)


class _TorchAssignKernel:
    """Torch transcription of the two Triton kernels of spec v2's loc
    bookkeeping (same grid call and arguments), for CPU runs: their loops over
    a loaded bound do not run under the interpreter. Per request ``b`` (its
    row of ``req_to_token``, ``[start, end)``; outputs packed request-major):
    ``assign_req_to_token_pool`` writes ``req_to_token[row, start:end] =
    out_cache_loc[...]`` and ``assign_extend_cache_locs`` reads the same
    range into ``out_cache_loc``."""

    def __init__(self, write_req_to_token):
        self.write = write_req_to_token

    def __getitem__(self, grid):
        def launch(req_pool_indices, req_to_token, start, end, out, pool_len, bs):
            at = 0
            for r, s, e in zip(req_pool_indices.tolist(), start.tolist(), end.tolist()):
                if self.write:
                    req_to_token[r, s:e] = out[at : at + e - s].to(req_to_token.dtype)
                else:
                    out[at : at + e - s] = req_to_token[r, s:e].to(out.dtype)
                at += e - s

        return launch


def _torch_assign(write):
    """0.5.17's ``assign_req_to_token_pool_func`` (``write``) or
    ``assign_extend_cache_locs_uniform_func``, in torch (their kernels do
    not run under the interpreter): see ``_TorchAssignKernel``."""
    launch = _TorchAssignKernel(write)[None]
    if write:
        return lambda idx, r2t, start, end, out, bs: launch(
            idx, r2t, start, end, out, 0, bs
        )

    def read(
        req_pool_indices,
        req_to_token,
        start_offset,
        batch_size,
        draft_token_num,
        device,
    ):
        out = torch.empty(
            batch_size * draft_token_num, dtype=torch.int64, device=device
        )
        end = start_offset + draft_token_num
        launch(req_pool_indices, req_to_token, start_offset, end, out, 0, batch_size)
        return out

    return read


class _V2Req(FakeReq):
    """A ``Req`` as spec v2 keeps it: committed and allocated KV lengths
    (0.5.17: the allocated one in ``req.kv``, held with the request slot)."""

    def __init__(self, rid):
        super().__init__(rid)
        self._kv = SimpleNamespace(kv_allocated_len=0)
        self.decode_batch_idx = 0

    kv = property(
        lambda self: None if self.req_pool_idx is None else self._kv,
        lambda self, value: None,  # release_kv_cache drops it with the slot
    )
    kv_allocated_len = property(
        lambda self: self._kv.kv_allocated_len,
        lambda self, n: setattr(self._kv, "kv_allocated_len", n),
    )

    def effective_kv_committed_len(self):
        return self.kv_committed_len

    def pop_overallocated_kv_cache(self):
        return self.kv_committed_len, self.kv_allocated_len


if REQ_KV_RECORD:  # 0.5.23: the request's KV record holds both lengths

    class _V2Req(FakeReq):  # noqa: F811
        def __init__(self, rid):
            super().__init__(rid)
            self.decode_batch_idx = 0


class _V2Harness(_MTPHarness):
    def __init__(self, test, steps, **kw):
        super().__init__(test, steps, **kw)
        q = self.q
        self.server_args = SimpleNamespace(
            speculative_algorithm="EAGLE",
            speculative_num_steps=steps,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=q,
            max_speculative_num_draft_tokens=q,
            page_size=PAGE,
            attention_backend="nsa",
            strip_thinking_cache=False,
            enable_mamba_extra_buffer=lambda: False,
        )
        self.alloc_len = q  # get_alloc_len_per_decode: max(steps, q)
        self.mapped = 0  # verify forwards whose locs the hook mapped

    def new_req(self):
        req = _V2Req(f"r{self.next_rid}")
        self.next_rid += 1
        self.t.assertIsNotNone(self.req_to_token_pool.alloc([req]))
        return req

    def prefill(self, chunks, chunked_req=None, admit=True):
        super().prefill(chunks, chunked_req=chunked_req, admit=admit)
        for req, _ in chunks:
            req.kv_allocated_len = req.kv_committed_len = req.seq_len

    def _patches(self):
        sa = self.server_args
        from sglang.srt.mem_cache import allocation_sizing

        no_mamba = SimpleNamespace(
            enable_mamba_extra_buffer=lambda: False,
            enable_mamba_extra_buffer_lazy=lambda: False,
        )
        init_new = SimpleNamespace(init_new=lambda batch, runner, **kw: batch)
        if REQ_KV_RECORD:  # 0.5.23 reads the config bags
            from sglang.srt import runtime_context

            bags = [
                (allocation_sizing, "get_spec", lambda: sa),
                (runtime_context, "get_spec", lambda: sa),
                (allocation_sizing, "get_schedule", lambda: sa),
                (
                    spec_utils,
                    "get_exec",
                    lambda: SimpleNamespace(
                        mamba=SimpleNamespace(
                            enable_mamba_extra_buffer=False,
                            enable_mamba_extra_buffer_lazy=False,
                        )
                    ),
                ),
            ]
        else:
            bags = [
                (schedule_batch_module, "get_server_args", lambda: sa),
                (spec_utils, "get_server_args", lambda: no_mamba),
                (
                    eagle_utils,
                    "get_alloc_reserve_per_decode",
                    lambda: allocation_sizing.get_alloc_reserve_per_decode(sa),
                ),
            ]
        return [mock.patch.object(*bag) for bag in bags] + [
            mock.patch.object(eagle_utils, "get_spec", lambda: sa),
            mock.patch.object(allocation, "get_last_loc", get_last_loc_torch),
            mock.patch.object(
                allocation, "assign_req_to_token_pool_func", _torch_assign(True)
            ),
            mock.patch.object(
                cache_locs,
                "assign_extend_cache_locs_uniform_func",
                _torch_assign(False),
            ),
            mock.patch.object(forward_batch_info, "ForwardBatch", init_new),
        ]

    def prepare_for_decode(self, reqs, seq_lens):
        """The patched ``ScheduleBatch.prepare_for_decode`` with spec v2 on;
        returns the ``out_cache_loc`` of the allocation ahead."""
        batch = SimpleNamespace(
            forward_mode=None,
            reqs=reqs,
            input_embeds=None,
            is_spec_v2=True,
            spec_algorithm=SimpleNamespace(
                is_none=lambda: False,
                is_dflash_family=lambda: False,
                is_uno=lambda: False,
            ),
            token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.tree_cache,
            req_to_token_pool=self.req_to_token_pool,
            req_pool_indices=torch.tensor(
                [r.req_pool_idx for r in reqs], device=DEVICE
            ),
            seq_lens=seq_lens,
            # What the last prepare left: stale for requests that have decoded.
            seq_lens_cpu=torch.tensor(
                [-1 if r.admit_len is None else r.admit_len for r in reqs]
            ),
            device=DEVICE,
            sampling_info=SimpleNamespace(
                penalizer_orchestrator=SimpleNamespace(is_required=False)
            ),
            maybe_evict_swa=lambda: None,
            hisparse_coordinator=None,
            maybe_wait_verify_done=lambda: None,
            batch_size=lambda: len(reqs),
        )
        alloc = self.allocator
        # Stragglers give their prompt's staging pages back at admission.
        released = 0
        for r in reqs:
            if not self.co.is_admitted(r):
                locs = self.req_to_token[r.req_pool_idx, : r.seq_len].long()
                pages = torch.unique(locs // PAGE)
                released += int((alloc.page_to_staging_row[pages] >= 0).sum())
        staging_before = alloc.staging.available_pages() + released
        before = [(r.kv_allocated_len, r.kv_committed_len) for r in reqs]
        free_before = alloc.available_size()
        schedule_batch_module.ScheduleBatch.prepare_for_decode(batch)
        self.t.assertEqual(batch.forward_mode, ForwardMode.DECODE)
        self.t.assertTrue(all(self.co.is_admitted(r) for r in reqs))
        # Allocated ahead: kv_committed_len + 2 alloc_len, locs only.
        taken = 0
        for r, (allocated, committed) in zip(reqs, before):
            ahead = committed + 2 * self.alloc_len
            # The bonus slot is committed with the result; whole pages.
            self.t.assertEqual(r.kv_committed_len, committed)
            ahead = -(-ahead // PAGE) * PAGE
            self.t.assertEqual(r.kv_allocated_len, max(allocated, ahead))
            new_pages = -(-r.kv_allocated_len // PAGE) - (-(-allocated // PAGE))
            taken += new_pages * PAGE
        self.t.assertEqual(alloc.available_size(), free_before - taken)
        self.t.assertEqual(alloc.staging.available_pages(), staging_before)
        for r in reqs:
            locs = self.req_to_token[r.req_pool_idx, : r.kv_allocated_len].long()
            self.t.assertTrue(bool((locs > 0).all()))
            self.t.assertTrue(
                bool((alloc.page_to_staging_row[locs // PAGE] == -1).all())
            )
            r.admit_len = None  # admitted: never read again
        return batch

    def prepare_for_v2_verify(self, reqs, seq_lens):
        """The patched ``eagle_utils.eagle_prepare_for_verify`` on the
        ScheduleBatch (``seq_lens`` on the device only, no verify sync)."""
        q, bs = self.q, len(reqs)
        idx = torch.tensor([r.req_pool_idx for r in reqs], device=DEVICE)
        batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            req_pool_indices=idx,
            seq_lens=seq_lens,
            seq_lens_cpu=None,  # no verify sync
            reqs=reqs,
            device=DEVICE,
            model_config=SimpleNamespace(vocab_size=1 << 16),
            req_to_token_pool=self.req_to_token_pool,
            hisparse_coordinator=None,
        )
        verify_input = SimpleNamespace(
            draft_token=torch.zeros(bs * q, dtype=torch.int64, device=DEVICE),
            draft_token_num=q,
            prepared_out_cache_loc=None,
            prepared_mrope_positions=None,
            kv_loc_plan=None,
        )
        runner = SimpleNamespace(
            nsa_kv_offload=self.co,  # create_nsa_kv_offload_coordinator's
            spec_algorithm=SimpleNamespace(is_standalone=lambda: False),
            decode_cuda_graph_runner=None,
        )
        fb, can_graph = eagle_utils.eagle_prepare_for_verify(
            verify_input,
            self.req_to_token_pool,
            batch,
            SimpleNamespace(model_runner=runner),
        )
        return self._checked_verify_locs(fb, can_graph, reqs, seq_lens, idx)

    def _checked_verify_locs(self, fb, can_graph, reqs, seq_lens, idx):
        # The verify forward writes each request's q new tokens at its next locs.
        self.t.assertFalse(can_graph)
        self.t.assertEqual(fb.forward_mode, ForwardMode.TARGET_VERIFY)
        out, pre = fb.out_cache_loc, seq_lens.cpu()
        expect = torch.cat(
            [
                self.req_to_token[r.req_pool_idx, int(n) : int(n) + self.q]
                for r, n in zip(reqs, pre)
            ]
        ).long()
        self.t.assertTrue(torch.equal(out.long(), expect))
        return out, pre, idx

    def check_ring_rows(self, out, pre, idx):
        q = self.q
        base = self.co.lru.region_base[idx].long().repeat_interleave(q)
        pos = (pre[:, None] + torch.arange(q)).reshape(-1).to(DEVICE)
        return torch.equal(self.pool.loc_to_row[out], base + self.C + pos % self.W)

    def spec_step(self, reqs, accepts, pad_reqs=0, backend_layers=(), hook=True):
        """One spec v2 decode step: scheduler prepare, worker verify, result."""
        seq_lens = torch.tensor([r.seq_len for r in reqs], device=DEVICE)
        with contextlib_exit_stack(self._patches()):
            self.prepare_for_decode(reqs, seq_lens)
            if hook:
                out, pre, idx = self.prepare_for_v2_verify(reqs, seq_lens)
            else:
                with mock.patch.object(self.co, "prepare_v2_verify"):
                    out, pre, idx = self.prepare_for_v2_verify(reqs, seq_lens)
        if hook:
            self.t.assertTrue(self.check_ring_rows(out, pre, idx))
        self.verify_forward(reqs, out, pre, pad_reqs, backend_layers)
        # The result, as spec v2 processes it: nothing freed.
        free_before = self.allocator.available_size()
        for r, a in zip(reqs, accepts):
            # a drafts and the bonus token.
            r.kv_committed_len += a + 1
            r.seq_len += a + 1
            self.t.assertEqual(r.kv_committed_len, r.seq_len)
            self.t.assertLessEqual(r.seq_len, r.kv_allocated_len)
        self.t.assertEqual(self.allocator.available_size(), free_before)
        return out

    def finish_late(self, req):
        """Spec v2 sees a finish one batch late: the finished request's next
        verify has run; ``release_kv_cache`` then frees all its locs, the
        ones allocated ahead included."""
        req.kv_committed_len += 1  # the in-flight batch's pre-claimed bonus slot
        r = req.req_pool_idx
        free_before = self.allocator.available_size()
        allocated = req.kv_allocated_len
        names = ("get_global_server_args", "get_spec", "get_serving")
        args = [
            mock.patch.object(common_module, name, lambda: self.server_args)
            for name in names
            if hasattr(common_module, name)  # 0.5.17: get_spec, get_serving
        ]
        with contextlib_exit_stack(args):
            release_kv_cache(req, self.tree_cache, **RELEASE_ARGS)
        self.t.assertIsNone(req.req_pool_idx)
        self.t.assertFalse(self.co.controller.is_admitted(r))
        pages = -(-allocated // PAGE)
        self.t.assertEqual(self.allocator.available_size(), free_before + pages * PAGE)


class contextlib_exit_stack:
    """Enter a list of ``mock.patch`` objects at once."""

    def __init__(self, patches):
        self.patches = patches

    def __enter__(self):
        for p in self.patches:
            p.start()

    def __exit__(self, *exc):
        for p in reversed(self.patches):
            p.stop()


class TestMTPVerifySpecV2(unittest.TestCase):
    def _harness(self, steps, **kw):
        top_k = 32
        kw.setdefault("num_locs", 24 * PAGE)
        return _V2Harness(
            self,
            steps,
            top_k=top_k,
            buffer_size=(steps + 2) * top_k,
            window=2 * (steps + 1) + 2,
            num_regions=3,
            max_reqs=4,
            **kw,
        )

    def _prefill(self, h, items, admit=True):
        h.prefill(items, admit=admit)
        for r, n in items:
            r.admit_len = n

    def test_verify_steps(self):
        for steps in (1, 3):
            with self.subTest(steps=steps):
                h = self._harness(steps, seed=steps)
                rng = random.Random(steps)
                a, b = h.new_req(), h.new_req()
                # Prompts ending just before a page boundary: drafts and the
                # allocation ahead cross it.
                self._prefill(h, [(a, PAGE - 2), (b, 40)])
                straggler = h.new_req()
                self._prefill(h, [(straggler, 70)], admit=False)
                reqs = [a, b, straggler]
                for step in range(6):
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
                # The LRU never holds a draft: its slots hold committed locs.
                for r in reqs:
                    held = h.co.lru.slot_loc[:, r.req_pool_idx]
                    held = held[held >= 0].long()
                    committed = h.req_to_token[r.req_pool_idx, : r.seq_len].long()
                    self.assertTrue(bool(torch.isin(held, committed).all()))
                # Finishes seen one batch late: the in-flight verify ran.
                h.spec_step(reqs, [0] * 3)
                for r in reqs:
                    h.finish_late(r)
                h.check_no_leaks()

    def test_freed_locs_next_owner(self):
        """A request finishes while its next verify is in flight (spec v2):
        that verify writes back its drafts' host slots, then its locs are freed
        and a new prompt takes them; the new owner's backup rewrites those host
        slots and its own verifies read exactly its KV."""
        h = self._harness(3, num_locs=12 * PAGE)
        a, b = h.new_req(), h.new_req()
        self._prefill(h, [(a, 2 * PAGE - 3), (b, 30)])
        for _ in range(3):
            h.spec_step([a, b], [1, 3])
        inflight = h.spec_step([a, b], [2, 0])  # launched before a's finish is seen
        q = h.q
        a_locs = h.req_to_token[a.req_pool_idx, : a.kv_allocated_len].long().clone()
        order = []
        release_request = h.controller.release_request
        with mock.patch.object(
            h.co, "_wait_producer", side_effect=lambda: order.append("wait")
        ), mock.patch.object(
            h.controller,
            "release_request",
            side_effect=lambda r: (order.append("release"), release_request(r))[1],
        ):
            h.finish_late(a)
        # The scheduler's stream waits for the forward stream before any state
        # of a is dropped (and before its locs go back to the allocator).
        self.assertEqual(order[:2], ["wait", "release"])
        self.assertTrue(bool(torch.isin(inflight[:q], a_locs).all()))
        c = h.new_req()
        # Takes all but two free pages: a's pages among them.
        self._prefill(h, [(c, h.allocator.available_size() - 2 * PAGE)])
        c_locs = h.req_to_token[c.req_pool_idx, : c.seq_len].long()
        self.assertTrue(bool(torch.isin(c_locs, a_locs).any()), "a's locs reused")
        h.check_host(c_locs)
        for step in range(3):
            h.spec_step([b, c], [step % 4, 3 - step])
        for r in (b, c):
            h.finish_late(r)
        h.check_no_leaks()

    def test_without_hook_reads_wrong_kv(self):
        """Without the worker-side hook the verify locs allocated ahead keep
        whatever row they had: the drafts' KV lands elsewhere and a query
        token reads wrong KV (the harness's full-KV check fails)."""
        h = self._harness(2)
        a = h.new_req()
        self._prefill(h, [(a, 50)])
        h.spec_step([a], [2])
        with self.assertRaisesRegex(AssertionError, "read wrong KV"):
            h.spec_step([a], [1], hook=False)

    def test_prepare_v2_verify_checks_query_tokens(self):
        h = self._harness(2)
        batch = SimpleNamespace(
            req_pool_indices=torch.zeros(0, dtype=torch.int64),
            seq_lens=torch.zeros(0, dtype=torch.int64),
            out_cache_loc=torch.zeros(0, dtype=torch.int64),
        )
        with self.assertRaises(ValueError) as ctx:
            h.co.prepare_v2_verify(batch, 2)
        self.assertIn("built for 3", str(ctx.exception))
        h.co.prepare_v2_verify(batch, 3)  # empty: nothing to map


if __name__ == "__main__":
    unittest.main()
