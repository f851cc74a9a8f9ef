"""Pool sizing (CPU) for every request direct at rank 30K x 64: run from the
repo root with the CI venv, PYTHONPATH=python .venv/bin/python <this file>."""

import json
import sys

from sglang.srt.mem_cache.nsa_kv_offload_pool import compute_offload_pool_sizes

GIB = 1 << 30
# Rank model (61 layers, fp8 FlashMLA rows 656 B, indexer 132 B), page 64,
# window 64, host pool 84 GiB, PD decode (no staging), spare regions on.
L, ROW, IDX, PAGE, WINDOW, HOST = 61, 656, 132, 64, 64, int(84 * GIB)


def sizes(avail_gib, regions, buffer_size, units):
    s = compute_offload_pool_sizes(
        int(avail_gib * GIB), L, ROW, IDX, PAGE, buffer_size, WINDOW, regions,
        0, HOST, None, units, 0, True,
    )  # fmt: skip
    return {"locs": s.num_locs, "regions": s.num_regions, "spare": s.num_spare_regions}


# The budget that reproduces run_direct_flat_64/'s 221 decode + 251 spare regions.
avail = 90.0
while sizes(avail, 221, 4096, 8)["spare"] < 251:
    avail = round(avail + 0.05, 2)
out = {"calibrated_avail_gib": avail, "measured_config": sizes(avail, 221, 4096, 8)}
for buf, units in ((4416, 7), (4096, 8)):
    s = sizes(avail, 64, buf, units)
    s.update(units_total=s["regions"] + s["spare"], units_needed=64 * units)
    s["slots_per_request"] = units * buf
    out[f"64_slots_{units}x{buf}"] = s
json.dump(out, sys.stdout, indent=1)
