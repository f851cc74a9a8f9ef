"""What the NSA attention backend and the model call with the decode NSA KV
offload on; the backend holds the coordinator (``model_runner.nsa_kv_offload``,
None when off) from construction on (docs/INTEGRATION.md).
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.model_executor.forward_context import get_attn_backend


def use_positional_topk(offload, forward_batch) -> bool:
    """Decode and MTP target verify take the indexer's top-k as sequence
    positions (not token locs): the offload maps positions to GPU rows."""
    mode = forward_batch.forward_mode
    return offload is not None and (mode.is_decode_or_idle() or mode.is_target_verify())


def begin_layer_swap(forward_batch, layer_id: int, topk_positions: torch.Tensor):
    """The model, right after a layer's indexer: start the layer's decode or
    verify swap beside the query projection and rope (reached through the
    forward's attention backend: a draft model's has no offload)."""
    offload = getattr(get_attn_backend(), "nsa_kv_offload", None)
    if offload is not None:
        offload.begin_layer_swap(layer_id, topk_positions, forward_batch)


def decode_page_table(offload, forward_batch, layer_id: int, topk_positions):
    """Top-k positions -> GPU KV rows in top-k order, misses loaded."""
    return offload.swap_decode_layer(layer_id, topk_positions, forward_batch)


def verify_page_table(offload, forward_batch, layer_id: int, topk_positions):
    """Target verify: ``q`` rows of top-k positions per request (request-major)
    -> GPU KV rows, one row per query token, misses of all ``q`` loaded once."""
    return offload.swap_verify_layer(layer_id, topk_positions, forward_batch)


def translate_locs_to_rows(offload, locs: Optional[torch.Tensor]):
    """Prefill reads KV by token loc; with the offload a prompt's KV lives in
    staging rows (``-1`` stays ``-1``)."""
    if offload is None or locs is None:
        return locs
    return offload.kv_pool.translate_loc_to_row(locs).to(locs.dtype)
