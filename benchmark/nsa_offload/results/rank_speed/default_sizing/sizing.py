"""Pool sizing and unit shares (CPU) of the default offload server since
f418aa2 at the rank bench's points: run from the repo root with the CI venv,
PYTHONPATH=python:test/srt .venv/bin/python <this file> > sizing.json.

The sizing is the offload's own (compute_offload_pool_sizes, with the swap's
scratch for one row per request slot); the shares are what the real
SparseCacheController hands out to a burst of PD admissions of that many
requests (small rows, the same region counts), after its rebalance."""

import json
import sys

import torch
from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import TritonLRUSwap
from sglang.srt.mem_cache.nsa_kv_offload_pool import (
    compute_offload_pool_sizes,
    lru_slot_id_bytes,
    offload_bytes_per_region,
)
from sglang.srt.mem_cache.nsa_kv_only_host_pool import NSAKVOnlyTokenToKVPoolHost
from sglang.srt.mem_cache.sparse_cache_controller import SparseCacheController

GIB = 1 << 30
# Rank model (61 layers, fp8 FlashMLA rows 656 B, indexer 132 B), page 64,
# window 64, host pool 84 GiB, PD decode (no staging), spare regions on.
L, ROW, IDX, PAGE, WINDOW, HOST = 61, 656, 132, 64, 64, int(84 * GIB)
TOP_K, CONTEXT_LEN, NEW_TOKENS = 2048, 163840, 160
# The budget of run_direct_flat_64/ (93.95 GiB, calibrated at 4354e87).
AVAIL_GIB = 93.95
# The configurator's rule without --max-running-requests: 40% of the
# budget in regions, at most 256.
REGION_SHARE, MAX_REGIONS = 0.4, 256


def default_units(buffer_size):
    # nsa_kv_offload_default_max_units
    return -(-(CONTEXT_LEN - WINDOW) // buffer_size)


def sizes(buffer_size, units):
    per_region = offload_bytes_per_region(L, ROW, buffer_size, WINDOW, units)
    regions = min(MAX_REGIONS, int(REGION_SHARE * AVAIL_GIB * GIB) // per_region)
    scratch = TritonLRUSwap.scratch_bytes(
        regions, TOP_K, buffer_size, units, lru_slot_id_bytes(buffer_size, units)
    )
    s = compute_offload_pool_sizes(
        int(AVAIL_GIB * GIB), L, ROW, IDX, PAGE, buffer_size, WINDOW, regions,
        0, HOST, None, units, 0, True, scratch,
    )  # fmt: skip
    return dict(
        buffer_size=buffer_size,
        max_units=units,
        slot_id_bytes=lru_slot_id_bytes(buffer_size, units),
        scratch_mb=round(scratch / 1e6, 1),
        locs=s.num_locs,
        request_slots=s.num_regions,
        spare_regions=s.num_spare_regions,
        units_total=s.num_regions + s.num_spare_regions,
    )


def shares(units_total, request_slots, max_units, buffer_size, reqs, prompt):
    """Units each of ``reqs`` PD requests of ``prompt`` tokens holds after a
    burst admission and the rebalance (the controller's policy; 4-row units
    stand in for ``buffer_size`` rows: the counts are what matter)."""
    C = 4
    rows = (C + 1) * units_total + 1
    host = NSAKVOnlyTokenToKVPoolHost(size=64, page_size=16, layer_num=1, row_bytes=16)
    ctrl = SparseCacheController(
        [torch.zeros((rows, 16), dtype=torch.uint8)],
        host,
        max_num_reqs=request_slots,
        top_k=2,
        buffer_size=C,
        recent_window=1,
        region_start_row=1,
        num_regions=units_total,
        max_units=max_units,
        use_triton=False,
    )
    # The cap in real rows, scaled to the stand-in units.
    need = -(-(prompt + NEW_TOKENS - WINDOW) // buffer_size)
    for r in range(reqs):
        ctrl.admit_request(r, max_seq_len=1 + need * C)
    ctrl.rebalance()
    held = [ctrl.num_units(r) for r in range(reqs)]
    positions = prompt + NEW_TOKENS - WINDOW
    return dict(
        requests=reqs,
        prompt=prompt,
        units_needed_each=need,
        held_min=min(held),
        held_max=max(held),
        units_held=sum(held),
        requests_whole=sum(h * buffer_size >= positions for h in held),
        units_moved=ctrl.units_moved,
    )


out = {"avail_gib": AVAIL_GIB, "context_len": CONTEXT_LEN, "points": []}
for buffer_size, units in ((4096, default_units(4096)), (4096, 8), (4416, 7)):
    pool = sizes(buffer_size, units)
    for reqs, prompt in ((64, 30720), (32, 30720), (8, 131072), (1, 131072)):
        share = shares(
            pool["units_total"], pool["request_slots"], units, buffer_size, reqs, prompt
        )
        out["points"].append({**pool, **share})
json.dump(out, sys.stdout, indent=1)
