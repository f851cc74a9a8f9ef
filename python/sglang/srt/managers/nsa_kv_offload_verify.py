"""MTP target verify with the decode NSA KV offload (docs/MTP.md).

EAGLE / NextN with one draft chain: each step the target model runs one
``TARGET_VERIFY`` forward over ``q = --speculative-num-draft-tokens`` query
tokens per request (the bonus token at position ``n = seq_lens`` and the
``q - 1`` drafts after it). The coordinator serves it with the same pieces as
a decode step, for ``q`` tokens per request:

* verify preparation (``EagleVerifyInput.prepare_for_verify``, after the
  draft locs are in ``req_to_token``): admit requests the prefill hook
  missed, rebalance units, map the ``q`` locs of every request to their window
  ring rows. The locs come from ``alloc_extend`` without staging pages
  (``NSAKVOffloadTokenToKVPoolAllocator`` sees that they continue admitted
  requests), so the drafts' KV is written into the ring, never into staging;
* inside the forward (CUDA-graph safe): the first layer counts the real
  tokens, every layer swaps its ``bs * q`` top-k rows at once (one copy list
  per request, each missing loc loaded once), the last layer writes all
  ``q`` tokens of every real request back to host slots (acceptance is not
  known inside the graph; a rejected draft's host slot is rewritten before
  anything reads it).

Nothing is rolled back after ``verify()``: drafts never enter the LRU and
the swap reads only the newest ``W - (q - 1)`` positions from the ring.

Order of the rejected locs' free against the write-back (spec v1, the only
speculative path the offload starts with): ``EagleVerifyInput.verify`` reads
the accept indices on the host (``accept_index.tolist()``) before it frees
the rejected locs of wholly empty pages, and that read waits for the verify
forward, write-back included, on the one stream v1 runs on. A freed loc's next
owner writes its host slot only after that (prompt backup: side stream after
the caller's stream; write-back: same stream; PD transfer: a later scheduler
iteration). Spec v2 (overlap scheduler) is refused at startup.
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

    def prepare_verify(self, batch: ScheduleBatch, num_draft_tokens: int) -> None:
        """After ``prepare_for_verify`` allocated ``out_cache_loc`` (``q`` locs
        per request, request-major) and wrote them to ``req_to_token``;
        ``batch.seq_lens`` is still the committed length ``n``."""
        q = num_draft_tokens
        if q != self.max_query_tokens:
            raise ValueError(
                f"NSA KV offload: a verify of {q} query tokens per request, but "
                f"the LRU state was built for {self.max_query_tokens}"
            )
        # Positions < n hold KV (the bonus token at n is a query).
        self.admit_running(batch)
        if self.controller.wants_rebalance():
            self._wait_producer()
            self.controller.rebalance()
        idx, lens = self.lru.expand_query_tokens(
            batch.req_pool_indices, batch.seq_lens + q, q
        )
        self.lru.map_new_tokens(idx, lens, batch.out_cache_loc, self.kv_pool.loc_to_row)

    def swap_verify_layer(
        self, layer_id: int, topk_positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """``(bs * q, K)`` top-k positions (request-major) -> GPU rows, one row
        per query token, after loading this layer's misses."""
        q = self.max_query_tokens
        first, last = self._layer_range
        if layer_id == first:
            self._count_real_tokens(forward_batch.out_cache_loc, q)
            # The swap's length counts all q query tokens (the backend's
            # cache_seqlens); computed once per forward, inside the graph.
            self._verify_seq_lens = forward_batch.seq_lens + q
        page_table = self.controller.swap_one_layer(
            layer_id,
            topk_positions,
            forward_batch.req_pool_indices,
            self._verify_seq_lens,
            self.req_to_token,
            self.num_real_reqs,
            out=self._plan_buffers,
            num_query_tokens=q,
        )
        if layer_id == last:
            rows = self.kv_pool.loc_to_row[forward_batch.out_cache_loc]
            self.controller.write_back_new_tokens(
                rows, forward_batch.out_cache_loc, self.num_real_tokens
            )
        return page_table

    def _count_real_tokens(self, out_cache_loc: torch.Tensor, q: int) -> None:
        # Padding requests of a CUDA graph have out_cache_loc 0 for all their
        # q tokens; real ones never (loc 0 is nobody's).
        self._count_real_rows(out_cache_loc, out=self.num_real_tokens)
        torch.floor_divide(self.num_real_tokens, q, out=self.num_real_reqs)
