"""Small offload workloads the checkers run (test tooling, no tests here).

The checkers (``triton_hazards``, ``stream_races``, ``duplicate_writes``,
``poisoned_alloc``) watch a run of the real pools and coordinator
(``offload_harness.OffloadHarness``); these are the runs, kept here so that
the checker tests depend on the harness only, not on the product tests. Each
is as small as still reaches the code it is for: the Triton interpreter runs
every kernel, and a checker's bookkeeping multiplies that.

* :class:`OneRequestAtATime`: the exactness servers' batch-1 pass (requests
  one after another in the same request slot: a long prompt that walks the
  LRU over its units, then a short one that fits them: direct slots), with
  the server's settings for ``max_units`` (warm units and direct slots with
  ``max_units > 1``; the early swap always);
* :func:`colocated_lifecycle`, :func:`pd_decode_lifecycle`: chunked prefill,
  admission by the prefill hook and by the decode preparation, units lent and
  taken back, padded decode steps, finish and reuse; PD decode's transfer;
* :func:`mtp_verify_steps`: MTP target verify forwards (``q`` query tokens per
  request through ``begin_layer_swap`` in ``TARGET_VERIFY``).

Every page table is checked against the KV written (the harness's
reference), and nothing may leak.
"""

from __future__ import annotations

import unittest
from types import SimpleNamespace
from unittest import mock

import torch
from offload_harness import (  # noqa: F401 (setUpModule: the tests' fixtures)
    DEVICE,
    PAGE,
    OffloadHarness,
    set_mla_kv_rows_torch,
    setUpModule,
    tearDownModule,
)
from sglang.srt.layers.attention import nsa_offload_hooks
from sglang.srt.mem_cache import memory_pool as memory_pool_module
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sparse_backend import forward_backend


def torch_kv_writes(test: unittest.TestCase) -> None:
    """The model's KV writes by a torch scatter for the rest of ``test``:
    under the interpreter sglang's write kernel runs one program per row and
    is no part of the offload (the rows still go through ``loc_to_row``)."""
    write = mock.patch.object(
        memory_pool_module, "set_mla_kv_buffer_triton", set_mla_kv_rows_torch
    )
    write.start()
    test.addCleanup(write.stop)


class OneRequestAtATime(unittest.TestCase):
    """Requests one after another in one request slot (see the module
    docstring), at 1/64 of the served sizes: C = 64 LRU rows, window 4,
    top-k 32, 128-token prefill chunks. Subclasses set the prompts, the
    layers, the sizes and the decode steps, and watch the harness
    (``harness_ready``)."""

    # Prompt lengths in LRU units (C rows): a walker past 2 units, then a
    # prompt that fits (direct slots).
    PROMPTS_IN_UNITS = (2.3, 0.7)
    # With 2 or more layers every layer but the last defers its LRU reorder.
    LAYERS = 1
    # Decode steps after the first: past the window, the prompt's newest and
    # the first decode tokens leave it.
    STEPS = 6
    C, W, K = 64, 4, 32

    def harness_ready(self, h: OffloadHarness) -> None:
        """Called once the run's harness is built (subclasses watch it)."""

    def _run(self, max_units: int = 2) -> dict:
        torch_kv_writes(self)
        C, W, K, steps = self.C, self.W, self.K, self.STEPS
        chunk = 2 * C
        lens = [int(u * C) for u in self.PROMPTS_IN_UNITS]
        longest = max(lens) + steps + 2
        pages = -(-longest // PAGE) + 2
        h = OffloadHarness(
            self,
            kv_fp8=False,
            layers=self.LAYERS,
            top_k=K,
            buffer_size=C,
            window=W,
            num_locs=pages * PAGE,
            num_regions=2,
            staging_pages=pages,
            max_reqs=2,
            max_ctx=longest + PAGE,
            max_units=max_units,
            lend_staging_pages=pages - -(-chunk // PAGE),
            spare_regions=2,
        )
        self.harness_ready(h)
        seen = dict(walked=0, direct=0)
        for n in lens:
            req = h.new_req()
            req.origin_input_ids = [0] * n
            req.sampling_params.max_new_tokens = steps + 1
            done = 0
            while n - done > chunk:
                h.prefill([(req, chunk)], chunked_req=req)
                done += chunk
            h.prefill([(req, n - done)])
            h.decode_step([req], first_step_of=(req,))
            for _ in range(steps):
                h.decode_step([req])
            units = h.controller.num_units(req.req_pool_idx)
            in_slots = n + steps + 1 - W <= units * C
            seen["direct" if in_slots else "walked"] += 1
            h.finish(req)
        h.check_no_leaks()
        return seen


def colocated_lifecycle(test: unittest.TestCase, layers: int = 2) -> OffloadHarness:
    """A colocated server with the default's units (4, staging lent): A is
    prefilled in two chunks, then B beside A's last chunk (the prefill hook
    admits both; units are taken back), padded decode steps, A finishes, C
    (admitted by the decode preparation) takes its slot and region, and a
    request finishes at its prefill."""
    torch_kv_writes(test)
    h = OffloadHarness(
        test, layers=layers, num_regions=2, max_units=4, lend_staging_pages=4
    )
    a = h.new_req()
    h.prefill([(a, 200)], chunked_req=a)
    b = h.new_req()
    h.prefill([(a, 100), (b, 150)])
    h.decode_step([a, b], first_step_of=(a, b))
    for step in range(3):
        h.decode_step([a, b], pad_rows=step % 2)
    h.finish(a)
    c = h.new_req()
    h.prefill([(c, 260)], admit=False)
    h.decode_step([b, c], first_step_of=(c,), pad_rows=1)
    h.decode_step([b, c])
    h.finish(b)
    h.decode_step([c])  # alone: its units grow
    h.finish(c)
    d = h.new_req()
    h.prefill([(d, 140)])
    h.finish(d)  # finished at its prefill (max_new_tokens=1)
    h.check_no_leaks()
    return h


def pd_decode_lifecycle(test: unittest.TestCase, layers: int = 2) -> OffloadHarness:
    """PD decode: KV arrives in host slots (no staging), two units."""
    torch_kv_writes(test)
    h = OffloadHarness(
        test, layers=layers, kv_arrives_in_host=True, num_regions=2, max_units=2
    )
    a, b = h.new_req(), h.new_req()
    h.transfer(a, 300)
    h.transfer(b, 150)
    h.decode_step([a, b], first_step_of=(a, b))
    h.decode_step([a, b], pad_rows=1)
    h.replace_and_drain(a, b, prompt_len=200)
    return h


class _MTPHarness(OffloadHarness):
    """Target verify with ``q = query_tokens`` (the bonus token and ``q - 1``
    drafts), every draft accepted: the verify's locs + the coordinator's
    hooks, then the verify forward's layers through the early swap."""

    def verify_step(self, reqs):
        q, alloc = self.options.query_tokens, self.allocator
        bs = len(reqs)
        idx = torch.tensor([r.req_pool_idx for r in reqs], device=DEVICE)
        pre = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
        seq = pre + q
        self.co.admit_running(SimpleNamespace(reqs=reqs, seq_lens_cpu=pre))
        last = self.req_to_token[idx, pre.to(DEVICE) - 1].long()
        out = alloc.alloc_extend(pre.to(DEVICE), pre, seq.to(DEVICE), seq, last, bs * q)
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
        fb = SimpleNamespace(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            out_cache_loc=out,
            req_pool_indices=idx,
            seq_lens=pre.to(DEVICE),
            attn_backend=SimpleNamespace(nsa_kv_offload=self.co),
        )
        with self.forward_context((fb, batch, idx)), forward_backend(fb.attn_backend):
            self.co.before_forward(fb)
            with self.decode_graph_context():
                for layer in range(self.L):
                    # Query j of a request at position n + j sees <= n + j.
                    topk = torch.stack(
                        [
                            self.pick_topk(int(pre[b]) + j + 1)
                            for b in range(bs)
                            for j in range(q)
                        ]
                    ).to(DEVICE, torch.int32)
                    nsa_offload_hooks.begin_layer_swap(fb, layer, topk)
                    self.t.assertIn(layer, self.co._early_page_tables)
                    self.write_kvlayer_arg(layer, out)
                    page_table = nsa_offload_hooks.verify_page_table(
                        self.co, fb, layer, topk
                    )
                    self.check_verify_rows(layer, reqs, pre, topk, page_table)
        self.check_host(out)
        for r in reqs:  # every draft accepted
            r.seq_len += q
            r.kv_committed_len += q

    def check_verify_rows(self, layer, reqs, pre, topk, page_table):
        q = self.options.query_tokens
        self.t.assertEqual(page_table.shape, (len(reqs) * q, self.K))
        for b, req in enumerate(reqs):
            for j in range(q):
                pos, rows = topk[b * q + j], page_table[b * q + j]
                valid = (pos >= 0) & (pos <= int(pre[b]) + j)
                self.t.assertTrue(bool((rows[~valid] == -1).all()))
                rows, pos = rows[valid].long(), pos[valid].long()
                locs = self.req_to_token[req.req_pool_idx, pos].long()
                bad = (self.rows_bytes(layer, rows) != self.ref[layer, locs]).any(1)
                self.t.assertFalse(
                    bool(bad.any()),
                    f"layer {layer} {req.rid} query {j}: positions "
                    f"{pos[bad].tolist()} read wrong KV",
                )


def mtp_verify_steps(
    test: unittest.TestCase, q: int = 2, steps: int = 3, harness_ready=None
):
    """MTP (``q`` query tokens): two requests verify ``steps`` times, one of
    them admitted by the verify preparation; then they finish."""
    torch_kv_writes(test)
    top_k = 32
    h = _MTPHarness(
        test,
        layers=2,
        top_k=top_k,
        buffer_size=(q + 1) * top_k,
        window=2 * q + 2,
        num_regions=2,
        max_units=2,
        query_tokens=q,
    )
    if harness_ready is not None:
        harness_ready(h)
    a, b = h.new_req(), h.new_req()
    h.prefill([(a, PAGE - 1)])  # the drafts cross a page boundary
    h.prefill([(b, 90)], admit=False)
    for _ in range(steps):
        h.verify_step([a, b])
    h.finish(a)
    h.finish(b)
    h.check_no_leaks()
    return h
