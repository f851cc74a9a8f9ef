"""The verify mode of the decode NSA KV offload (``--nsa-kv-offload-verify``).

The KV pool then also keeps the full KV pool sglang keeps without the offload
(one row per token loc, written by upstream's own KV write beside the
offload's rows). After every decode and MTP-verify layer's swap,
:meth:`NSAKVOffloadVerifier.check` compares byte for byte the KV row the
offloaded page table hands attention for each top-k entry with the full
pool's row of the same position: an entry the page table skips (-1) that
attention should read, or reads that it should skip, is a mismatch too. It
counts on the device (no host sync; CUDA-graph safe) and keeps the first
mismatch; :meth:`read` brings the counts to the host (a sync), raising at the
first mismatch in mode "fail" (docs/ENGINE.md, "Verify mode").
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from sglang.srt.mem_cache.nsa_kv_offload_copy import as_rows

# Packing of the first mismatch's key (the smallest wins): step, layer, page
# table row, top-k index. 23 + 8 + 16 + 16 bits.
_STEP_SHIFT, _LAYER_SHIFT, _ROW_SHIFT = 40, 32, 16
_NO_MISMATCH = torch.iinfo(torch.int64).max


def _as_words(buf: torch.Tensor, row_bytes: int) -> torch.Tensor:
    rows = as_rows(buf, row_bytes)
    return rows.view(torch.int32) if row_bytes % 4 == 0 else rows


class NSAKVOffloadVerifier:
    """Checks the KV rows attention reads against the full pool (module doc).
    ``mode``: "fail" raises at the first mismatch :meth:`read` sees, "count"
    only counts."""

    def __init__(self, kv_pool, req_to_token: torch.Tensor, mode: str):
        if kv_pool.verify_kv_buffer is None:
            raise ValueError("the verify mode needs a KV pool built with verify=True")
        self.mode = mode
        self.req_to_token = req_to_token
        self.start_layer = kv_pool.start_layer
        row_bytes = kv_pool.kv_row_bytes
        self._rows = [_as_words(b, row_bytes) for b in kv_pool.kv_buffer]
        self._truth = [_as_words(b, row_bytes) for b in kv_pool.verify_kv_buffer]
        dev = kv_pool.device
        # (checked entries, mismatches), the forwards seen, the first
        # mismatch's packed key and (position, token loc, GPU row read).
        self.counts = torch.zeros(2, dtype=torch.int64, device=dev)
        self.step = torch.zeros(1, dtype=torch.int64, device=dev)
        self.first_key = torch.full((1,), _NO_MISMATCH, dtype=torch.int64, device=dev)
        self.first_detail = torch.full((3,), -1, dtype=torch.int64, device=dev)
        self.checked_total = 0
        self.mismatches_total = 0

    def check(
        self,
        layer_id: int,
        topk_pos: torch.Tensor,
        page_table: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        num_real_reqs: torch.Tensor,
        num_query_tokens: int = 1,
    ) -> None:
        """Compare this layer's page table (``(bs * q, K)`` GPU rows) with the
        full pool at the top-k positions; ``seq_lens`` counts all ``q`` query
        tokens (query token ``j`` sees positions ``< seq_lens - q + 1 + j``)."""
        q = num_query_tokens
        layer = layer_id - self.start_layer
        rows_q, k = topk_pos.shape
        dev = topk_pos.device
        row = torch.arange(rows_q, device=dev)
        b = row // q
        real = b < num_real_reqs.reshape(-1)[:1]
        kv_len = seq_lens.long()[b] - q + 1 + row % q
        pos = topk_pos.long()
        valid = real[:, None] & (pos >= 0) & (pos < kv_len[:, None])
        req = torch.where(real, req_pool_indices.long()[b], 0)
        loc = self.req_to_token[req[:, None], torch.where(valid, pos, 0)].long()
        gpu_row = page_table[:rows_q].long()
        truth = self._truth[layer][torch.where(valid, loc, 0)]
        read = self._rows[layer][gpu_row.clamp(min=0)]
        differs = (truth != read).any(-1)
        mismatch = (valid & ((gpu_row < 0) | differs)) | (
            real[:, None] & ~valid & (gpu_row >= 0)
        )
        self.counts[0] += valid.sum()
        self.counts[1] += mismatch.sum()
        if layer == 0:
            self.step += 1
        entry = (row[:, None] << _ROW_SHIFT) + torch.arange(k, device=dev)
        key = torch.where(
            mismatch,
            (self.step << _STEP_SHIFT) + (layer << _LAYER_SHIFT) + entry,
            _NO_MISMATCH,
        ).reshape(-1)
        at = key.argmin()
        detail = torch.stack(
            [pos.reshape(-1)[at], loc.reshape(-1)[at], gpu_row.reshape(-1)[at]]
        )
        first = key[at] < self.first_key
        self.first_detail.copy_(torch.where(first, detail, self.first_detail))
        torch.minimum(self.first_key, key[at : at + 1], out=self.first_key)

    def first_mismatch(self) -> Optional[Dict[str, int]]:
        """Where the first mismatch was (step, layer, page-table row, top-k
        index, position, token loc, GPU row read), or None (syncs)."""
        key = int(self.first_key)
        if key == _NO_MISMATCH:
            return None
        pos, loc, row = (int(x) for x in self.first_detail.tolist())
        return dict(
            step=key >> _STEP_SHIFT,
            layer=self.start_layer + ((key >> _LAYER_SHIFT) & 0xFF),
            row=(key >> _ROW_SHIFT) & 0xFFFF,
            topk_index=key & 0xFFFF,
            position=pos,
            loc=loc,
            gpu_row=row,
        )

    def read(self) -> Dict[str, int]:
        """Totals since startup (syncs); raises in mode "fail" once any
        mismatch was counted."""
        checked, mismatches = (int(x) for x in self.counts.tolist())
        self.checked_total, self.mismatches_total = checked, mismatches
        if mismatches and self.mode == "fail":
            raise RuntimeError(
                f"NSA KV offload verify: {mismatches} of {checked} KV rows read by "
                f"attention differ from the full KV pool; first: "
                f"{self.first_mismatch()}. (--nsa-kv-offload-verify count only counts.)"
            )
        return dict(verify_checked_rows=checked, verify_mismatches=mismatches)
