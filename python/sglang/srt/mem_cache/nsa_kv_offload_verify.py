"""The verify mode of the decode NSA KV offload (``--nsa-kv-offload-verify``).

After every decode and MTP-verify layer's swap, :meth:`NSAKVOffloadVerifier.check`
compares on the device the KV rows the page table hands attention with the
full pool's; :meth:`read` brings the counts to the host (docs/ENGINE.md,
"Verify mode").
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from sglang.srt.mem_cache.nsa_kv_offload_copy import as_rows

# Packing of the first mismatch's key (the smallest wins): step, layer, page
# table row, top-k index. 23 + 8 + 16 + 16 bits.
_STEP_SHIFT, _LAYER_SHIFT, _ROW_SHIFT = 40, 32, 16
_NO_MISMATCH = torch.iinfo(torch.int64).max


class _Done:
    """A completed event (poll's copy on CPU is synchronous)."""

    @staticmethod
    def query() -> bool:
        return True


_DONE = _Done()


def _as_words(buf: torch.Tensor, row_bytes: int) -> torch.Tensor:
    rows = as_rows(buf, row_bytes)
    return rows.view(torch.int32) if row_bytes % 4 == 0 else rows


class NSAKVOffloadVerifier:
    """Checks the KV rows attention reads against the full pool; ``mode``:
    "fail" raises at the first mismatch :meth:`read` sees, "count" counts."""

    def __init__(self, kv_pool, req_to_token: torch.Tensor, mode: str):
        if kv_pool.verify_kv_buffer is None:
            raise ValueError("the verify mode needs a KV pool built with verify=True")
        self.mode = mode
        self.req_to_token = req_to_token
        self.start_layer = kv_pool.start_layer
        dev = self.device = kv_pool.device
        row_bytes = kv_pool.kv_row_bytes
        self._rows = [_as_words(b, row_bytes) for b in kv_pool.kv_buffer]
        self._truth_rows = [as_rows(b, row_bytes) for b in kv_pool.verify_kv_buffer]
        self._truth = [_as_words(t, row_bytes) for t in self._truth_rows]
        # (checked, mismatches), forwards seen, the first mismatch's key and
        # (position, token loc, GPU row read).
        self.counts = torch.zeros(2, dtype=torch.int64, device=dev)
        self.step = torch.zeros(1, dtype=torch.int64, device=dev)
        self.first_key = torch.full((1,), _NO_MISMATCH, dtype=torch.int64, device=dev)
        self.first_detail = torch.full((3,), -1, dtype=torch.int64, device=dev)
        self._reported = (0, 0)  # (checked, mismatches) at the last stats_delta
        # poll(): the counts' copy in host memory and the event it waits for.
        self._host = torch.zeros(
            2, dtype=torch.int64, pin_memory=torch.device(dev).type == "cuda"
        )
        self._copied = None

    def fill_from_host(self, host_pool, locs: torch.Tensor) -> None:
        """A PD prompt's truth: what the transfer put in its host slots ``locs``."""
        host_locs = locs.cpu()
        for layer, truth in enumerate(self._truth_rows):
            truth[locs] = host_pool.data_refs[layer][host_locs].to(self.device)

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
        wrong = valid & ((gpu_row < 0) | differs)
        mismatch = wrong | (real[:, None] & ~valid & (gpu_row >= 0))
        self.counts[0] += valid.sum()
        self.counts[1] += mismatch.sum()
        if layer == 0:
            self.step += 1
        entry = (row[:, None] << _ROW_SHIFT) + torch.arange(k, device=dev)
        stamp = (self.step << _STEP_SHIFT) + (layer << _LAYER_SHIFT)
        key = torch.where(mismatch, stamp + entry, _NO_MISMATCH).reshape(-1)
        # Tensor indices only: no host sync (CUDA-graph capture).
        at = key.argmin().view(1)
        detail = torch.cat(
            [t.reshape(-1).index_select(0, at) for t in (pos, loc, gpu_row)]
        )
        best = key.index_select(0, at)
        first = best < self.first_key
        self.first_detail.copy_(torch.where(first, detail, self.first_detail))
        torch.minimum(self.first_key, best, out=self.first_key)

    def first_mismatch(self) -> Optional[Dict[str, int]]:
        """The first mismatch's step, layer, row, top-k index, position, loc and GPU
        row read, or None (syncs)."""
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

    def poll(self) -> None:
        """Mode "fail" between forwards, without a host sync: raises once the
        mismatch count copied after an earlier forward is non-zero, then
        copies the current one (it lands while later work runs)."""
        if self.mode != "fail":
            return
        if self._copied is not None and self._copied.query() and self._host[1]:
            self.read()
        self._host.copy_(self.counts, non_blocking=True)
        if self.counts.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._copied = _DONE

    def read(self) -> Dict[str, int]:
        """Totals since startup (syncs); raises in mode "fail" after a mismatch."""
        checked, mismatches = (int(x) for x in self.counts.tolist())
        if mismatches and self.mode == "fail":
            raise RuntimeError(
                f"NSA KV offload verify: {mismatches} of {checked} KV rows read by "
                f"attention differ from the full KV pool; first: "
                f"{self.first_mismatch()}. (--nsa-kv-offload-verify count only counts.)"
            )
        return dict(verify_checked_rows=checked, verify_mismatches=mismatches)

    def stats_delta(self) -> Dict[str, int]:
        """The counts since the last call and since startup (syncs; may raise)."""
        totals = self.read()
        checked, mismatches = totals["verify_checked_rows"], totals["verify_mismatches"]
        last_checked, last_mismatches = self._reported
        self._reported = (checked, mismatches)
        return dict(
            verify_checked_rows=checked - last_checked,
            verify_mismatches=mismatches - last_mismatches,
            verify_checked_total=checked,
            verify_mismatches_total=mismatches,
        )
