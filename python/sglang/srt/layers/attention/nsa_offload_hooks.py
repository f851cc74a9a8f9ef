"""What the NSA attention backend calls when the decode KV offload is on.

The backend is handed the coordinator at construction
(``model_runner.nsa_kv_offload``, None when the offload is off: ModelRunner
builds it before its attention backends), so the backend needs no new
ForwardBatch field and CUDA-graph capture sees the same object as eager runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from sglang.srt.managers.nsa_kv_offload_coordinator import (
        NSAKVOffloadCoordinator,
    )
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def use_positional_topk(
    offload: Optional[NSAKVOffloadCoordinator], forward_batch: ForwardBatch
) -> bool:
    """Decode and MTP target verify need the indexer's top-k as sequence
    positions (not token locs): the offload maps positions to GPU rows itself."""
    if offload is None:
        return False
    mode = forward_batch.forward_mode
    return mode.is_decode_or_idle() or mode.is_target_verify()


def begin_layer_swap(
    forward_batch: ForwardBatch,
    layer_id: int,
    topk_positions: torch.Tensor,
    after_rope: bool = False,
) -> None:
    """The model, right after a layer's indexer and again after its query
    rope (``after_rope``): with the early swap (``SGLANG_NSA_KV_OFFLOAD_EARLY_SWAP``,
    on by default), start the layer's decode or verify swap at the one of the
    two the coordinator starts at (``swap_after_rope``);
    ``decode_page_table`` / ``verify_page_table`` collect it. Reached through
    the forward's attention backend (a draft model's has no offload)."""
    offload = getattr(forward_batch.attn_backend, "nsa_kv_offload", None)
    if offload is not None and offload.swap_after_rope == after_rope:
        offload.begin_layer_swap(layer_id, topk_positions, forward_batch)


def decode_page_table(
    offload: NSAKVOffloadCoordinator,
    forward_batch: ForwardBatch,
    layer_id: int,
    topk_positions: torch.Tensor,
) -> torch.Tensor:
    """Top-k positions -> GPU KV rows in top-k order, misses loaded."""
    return offload.swap_decode_layer(layer_id, topk_positions, forward_batch)


def verify_page_table(
    offload: NSAKVOffloadCoordinator,
    forward_batch: ForwardBatch,
    layer_id: int,
    topk_positions: torch.Tensor,
) -> torch.Tensor:
    """Target verify: ``q`` rows of top-k positions per request (request-major)
    -> GPU KV rows, one row per query token, misses of all ``q`` loaded once."""
    return offload.swap_verify_layer(layer_id, topk_positions, forward_batch)


def translate_locs_to_rows(
    offload: Optional[NSAKVOffloadCoordinator], locs: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """Prefill reads KV by token loc; with the offload the KV of a prompt lives
    in staging rows (``-1`` stays ``-1``)."""
    if offload is None or locs is None:
        return locs
    return offload.kv_pool.translate_loc_to_row(locs).to(locs.dtype)
