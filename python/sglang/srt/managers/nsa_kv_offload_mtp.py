"""MTP target verify with the decode NSA KV offload (docs/MTP.md).

Each ``TARGET_VERIFY`` forward (EAGLE / NextN, one draft chain) has ``q`` query
tokens per request, served like a decode step of ``q`` tokens: admit and
rebalance before the step's locs exist, map the ``q`` locs to ring rows, swap
all ``bs * q`` top-k rows at once and write all ``q`` tokens back at the last
layer. Nothing is rolled back (docs/MTP.md, "New KV, rollback and what the
host holds").
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.nsa_kv_offload_compat import kv_committed_len


class NSAKVOffloadMTPMixin:
    """Target-verify part of ``NSAKVOffloadCoordinator``."""

    def admit_running(self, batch) -> None:
        """Admit what the prefill hook missed, with its committed KV."""
        for req in batch.reqs:
            if not self.is_admitted(req):
                self.admit(req, kv_committed_len(req))

    def prepare_speculative_decode(self, batch) -> None:
        """Speculative ``prepare_for_decode``, before the step's locs exist:
        admit what the prefill hook missed, then rebalance."""
        self._check_verify()
        self.admit_running(batch)
        self._rebalance_if_wanted()

    def prepare_v2_verify(self, batch, num_draft_tokens: int) -> None:
        """Worker side: map the ``q`` locs per request (request-major) in
        ``batch.out_cache_loc`` to ring rows on the current stream (no host sync)."""
        self._check_query_tokens(num_draft_tokens)
        self._map_verify_tokens(batch)

    def _check_query_tokens(self, q: int) -> None:
        if q != self.options.query_tokens:
            raise ValueError(
                f"NSA KV offload: a verify of {q} query tokens per request, but the "
                f"LRU state was built for {self.options.query_tokens}"
            )

    def _map_verify_tokens(self, batch) -> None:
        # Query token j of a request sits at position seq_lens + j.
        q = self.options.query_tokens
        idx, lens = self.lru.expand_query_tokens(
            batch.req_pool_indices, batch.seq_lens + q, q
        )
        self.lru.map_new_tokens(idx, lens, batch.out_cache_loc, self.kv_pool.loc_to_row)

    def swap_verify_layer(self, layer_id: int, topk_positions, forward_batch):
        """``(bs * q, K)`` top-k positions (request-major) -> GPU rows, one row per
        query token, the misses of all ``q`` loaded once."""
        page_table = self._take_early_page_table(layer_id, topk_positions.shape[0])
        if page_table is None:
            page_table = self._verify_swap_into_plan(
                layer_id, topk_positions, forward_batch
            )
        self._verify_layer(layer_id, topk_positions, page_table, forward_batch)
        if layer_id == self._layer_range[1]:
            rows = self.kv_pool.loc_to_row[forward_batch.out_cache_loc]
            self.controller.write_back_new_tokens(
                rows, forward_batch.out_cache_loc, self.num_real_tokens
            )
        return page_table

    def _verify_swap_into_plan(self, layer_id: int, topk_positions, forward_batch):
        q = self.options.query_tokens
        if layer_id == self._layer_range[0]:
            # Padding requests have out_cache_loc 0 for all their q tokens.
            self._count_real_rows(forward_batch.out_cache_loc, out=self.num_real_tokens)
            torch.floor_divide(self.num_real_tokens, q, out=self.num_real_reqs)
            # The swap's length counts all q query tokens (cache_seqlens).
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
