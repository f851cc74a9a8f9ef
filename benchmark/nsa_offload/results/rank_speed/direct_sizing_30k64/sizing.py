"""Pool sizing (CPU) for every request direct at rank 30K x 64: run from the
repo root with the CI venv, PYTHONPATH=python .venv/bin/python <this file>."""

import json
import sys

from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import TritonLRUSwap
from sglang.srt.mem_cache.nsa_kv_offload_pool import (
    compute_offload_pool_sizes,
    lru_slot_id_bytes,
    offload_bytes_per_region,
)

GIB = 1 << 30
# Rank model (61 layers, fp8 FlashMLA rows 656 B, indexer 132 B), page 64,
# window 64, host pool 84 GiB, PD decode (no staging), spare regions on.
L, ROW, IDX, PAGE, WINDOW, HOST = 61, 656, 132, 64, 64, int(84 * GIB)
TOP_K = 2048
# The budget of run_direct_flat_64/ (221 decode + 251 spare regions there):
# calibrated at 4354e87, when the LRU state was held per request slot.
AVAIL_GIB = 93.95
# What the server picks without --max-running-requests (the configurator's
# rule: 40% of the budget in regions, at most 256).
REGION_SHARE, MAX_REGIONS = 0.4, 256


def sizes(regions, buffer_size, units, batch=64):
    # The swap's scratch for one row per request slot (CUDA graphs up to
    # the request slots).
    scratch = TritonLRUSwap.scratch_bytes(
        regions, TOP_K, buffer_size, units, lru_slot_id_bytes(buffer_size, units)
    )
    s = compute_offload_pool_sizes(
        int(AVAIL_GIB * GIB), L, ROW, IDX, PAGE, buffer_size, WINDOW, regions,
        0, HOST, None, units, 0, True, scratch,
    )  # fmt: skip
    out = {"locs": s.num_locs, "regions": s.num_regions, "spare": s.num_spare_regions}
    out.update(units_total=out["regions"] + out["spare"], units_needed=batch * units)
    out["slots_per_request"] = units * buffer_size
    return out


def default_regions(buffer_size, units):
    per_region = offload_bytes_per_region(L, ROW, buffer_size, WINDOW, units)
    return min(MAX_REGIONS, int(REGION_SHARE * AVAIL_GIB * GIB) // per_region)


out = {"avail_gib": AVAIL_GIB, "run_direct_flat_64_config": sizes(221, 4096, 8)}
for buf, units in ((4416, 7), (4096, 8)):
    out[f"64_slots_{units}x{buf}"] = sizes(64, buf, units)
    n = default_regions(buf, units)
    out[f"default_slots_{units}x{buf}"] = sizes(n, buf, units)
# 128K x 8 on 33 units of 4096 (int32 slot ids), the default request slots
# (run_all_direct_128k/ needed --max-running-requests 16).
n = default_regions(4096, 33)
out["128k_x8_default_slots_33x4096"] = sizes(n, 4096, 33, batch=8)
json.dump(out, sys.stdout, indent=1)
