"""MTP target verify with the decode NSA KV offload (docs/MTP.md).

EAGLE / NextN with one draft chain: each step the target model runs one
``TARGET_VERIFY`` forward over ``q = --speculative-num-draft-tokens`` query
tokens per request (the bonus token at position ``n = seq_lens`` and the
``q - 1`` drafts after it). The coordinator serves it with the same pieces as
a decode step, for ``q`` tokens per request:

* verify preparation (spec v1: ``EagleVerifyInput.prepare_for_verify``,
  after the draft locs are in ``req_to_token``; spec v2: below): admit
  requests the prefill hook missed, rebalance units, map the ``q`` locs of
  every request to their window ring rows. The locs come from
  ``alloc_extend`` without staging pages (``NSAKVOffloadTokenToKVPoolAllocator``
  sees that they continue admitted requests), so the drafts' KV is written
  into the ring, never into staging;
* inside the forward (CUDA-graph safe): the first layer counts the real
  tokens, every layer swaps its ``bs * q`` top-k rows at once (one copy list
  per request, each missing loc loaded once), the last layer writes all
  ``q`` tokens of every real request back to host slots (acceptance is not
  known inside the graph; a rejected draft's host slot is rewritten before
  anything reads it).

Nothing is rolled back after ``verify()``: drafts never enter the LRU and
the swap reads only the newest ``W - (q - 1)`` positions from the ring.

Spec v1 and spec v2 (the overlap scheduler) differ in where the verify locs
come from, not in the forward:

* spec v1: ``EagleVerifyInput.prepare_for_verify`` (scheduler side) allocates
  them; ``prepare_verify`` there admits, rebalances and maps them;
* spec v2: ``EagleDraftInput.prepare_for_decode`` (scheduler side) allocates
  ahead, up to ``kv_committed_len + 2 * alloc_len_per_decode``; before it,
  ``prepare_speculative_decode`` admits and rebalances, so that allocation
  continues admitted requests (no staging page). The worker's
  ``prepare_for_v2_verify`` reads the step's ``q`` locs from ``req_to_token``
  at the GPU's ``seq_lens``; ``prepare_v2_verify`` maps them to their ring
  rows right there, on the GPU (no host sync), on the stream that then runs or
  feeds the verify forward, outside the CUDA graph. Locs allocated ahead are
  mapped only by the verify that writes them.

Order of frees against the write-back. Spec v1: ``EagleVerifyInput.verify``
reads the accept indices on the host (``accept_index.tolist()``) before it
frees the rejected locs of wholly empty pages, and that read waits for the
verify forward, write-back included, on the one stream v1 runs on. Spec v2
frees a request's locs (finish, abort, retract: ``release_kv_cache``) while a
later forward of it may still be in flight (its finish is seen one batch
late); ``release`` first makes the scheduler's stream wait for the forward
stream on the GPU, so everything a freed loc's next owner writes to its host
slot (prompt backup: side stream after the scheduler's stream; write-back:
the forward stream, in order) lands after the in-flight write-back. A PD
transfer writes host slots from outside any stream: spec v2 on a PD decode
server is refused (docs/MTP.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class NSAKVOffloadVerifyMixin:
    """Target-verify part of ``NSAKVOffloadCoordinator`` (uses its pools,
    controller, plan buffers and real-row counters)."""

    def admit_running(self, batch: ScheduleBatch) -> None:
        """Speculative ``prepare_for_decode`` (before the draft pass takes its
        locs, which must continue admitted requests): admit anything the
        prefill hook missed; ``seq_lens`` is the committed length."""
        for i, req in enumerate(batch.reqs):
            if not self.is_admitted(req):
                self.admit(req, int(batch.seq_lens_cpu[i]))

    def prepare_speculative_decode(self, batch: ScheduleBatch, spec_v2: bool) -> None:
        """Speculative ``prepare_for_decode``, before spec v2 allocates the
        step's locs ahead there (and before spec v1's draft pass): admit what
        the prefill hook missed (a request not admitted has not decoded, so
        ``seq_lens_cpu`` is its prompt length, in spec v2 too). Spec v2 maps its
        verify locs on the worker (``prepare_v2_verify``), so units are
        rebalanced here, on the scheduler side, after the in-flight forward."""
        self.admit_running(batch)
        if spec_v2:
            self._rebalance_if_wanted()

    def prepare_verify(self, batch: ScheduleBatch, num_draft_tokens: int) -> None:
        """Spec v1: after ``prepare_for_verify`` allocated ``out_cache_loc``
        (``q`` locs per request, request-major) and wrote them to
        ``req_to_token``; ``batch.seq_lens`` is still the committed length ``n``."""
        self._check_query_tokens(num_draft_tokens)
        # Positions < n hold KV (the bonus token at n is a query).
        self.admit_running(batch)
        self._rebalance_if_wanted()
        self._map_verify_tokens(
            batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc
        )

    def prepare_v2_verify(self, batch, num_draft_tokens: int) -> None:
        """Spec v2: ``prepare_for_v2_verify`` (worker side) has read the ``q``
        locs per request from ``req_to_token[seq_lens : seq_lens + q]`` into
        ``batch.out_cache_loc`` (a ``ModelWorkerBatch``; ``seq_lens`` the
        committed length, on the GPU only). Maps them to their ring rows on
        the current stream: GPU ops only, no host sync; the verify forward
        that writes their KV runs after them on the same or a joined stream."""
        self._check_query_tokens(num_draft_tokens)
        self._map_verify_tokens(
            batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc
        )

    def _check_query_tokens(self, q: int) -> None:
        if q != self.max_query_tokens:
            raise ValueError(
                f"NSA KV offload: a verify of {q} query tokens per request, but "
                f"the LRU state was built for {self.max_query_tokens}"
            )

    def _map_verify_tokens(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
    ) -> None:
        # Query token j of a request sits at position seq_lens + j.
        q = self.max_query_tokens
        idx, lens = self.lru.expand_query_tokens(req_pool_indices, seq_lens + q, q)
        self.lru.map_new_tokens(idx, lens, out_cache_loc, self.kv_pool.loc_to_row)

    def swap_verify_layer(
        self, layer_id: int, topk_positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """``(bs * q, K)`` top-k positions (request-major) -> GPU rows, one row
        per query token, after loading this layer's misses."""
        last = self._layer_range[1]
        page_table = self._take_early_page_table(layer_id, topk_positions.shape[0])
        if page_table is None:
            page_table = self._verify_swap_into_plan(
                layer_id, topk_positions, forward_batch
            )
        if layer_id == last:
            rows = self.kv_pool.loc_to_row[forward_batch.out_cache_loc]
            self.controller.write_back_new_tokens(
                rows, forward_batch.out_cache_loc, self.num_real_tokens
            )
        return page_table

    def _verify_swap_into_plan(
        self, layer_id: int, topk_positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        q = self.max_query_tokens
        if layer_id == self._layer_range[0]:
            self._count_real_tokens(forward_batch.out_cache_loc, q)
            # The swap's length counts all q query tokens (the backend's
            # cache_seqlens); computed once per forward, inside the graph.
            self._verify_seq_lens = forward_batch.seq_lens + q
        return self.controller.swap_one_layer(
            layer_id,
            topk_positions,
            forward_batch.req_pool_indices,
            self._verify_seq_lens,
            self.req_to_token,
            self.num_real_reqs,
            out=self._plan_buffers,
            num_query_tokens=q,
        )

    def _count_real_tokens(self, out_cache_loc: torch.Tensor, q: int) -> None:
        # Padding requests of a CUDA graph have out_cache_loc 0 for all their
        # q tokens; real ones never (loc 0 is nobody's).
        self._count_real_rows(out_cache_loc, out=self.num_real_tokens)
        torch.floor_divide(self.num_real_tokens, q, out=self.num_real_reqs)
