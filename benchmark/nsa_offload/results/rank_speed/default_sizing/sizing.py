"""Pool sizing and unit shares (CPU) of the default offload server since
f418aa2 at the rank bench's points: run from the repo root with the CI venv,
PYTHONPATH=python:test/srt .venv/bin/python <this file> > sizing.json.

The sizing is the offload's own (compute_offload_pool_sizes, with the swap's
scratch for one row per request slot); the shares are what the real
SparseCacheController hands out to a burst of PD admissions of that many
requests (small rows, the same region counts), after its rebalance.

With flags, another point: e.g. the 14 GiB budget of ../run_h100_reported_32k_x8/
(13 request slots, host pools of 64 down to 12 GiB), written to sizing_14gib.json:
  --avail-gib 13.96 --request-slots 13 --host-gib 64,24,16,12 --units 4,40 --points 8x32768
"""

import argparse
import json
import sys

import torch
from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import TritonLRUSwap
from sglang.srt.mem_cache.nsa_kv_offload_sizing import (
    compute_offload_pool_sizes,
    lru_slot_id_bytes,
    offload_bytes_per_region,
)
from sglang.srt.mem_cache.nsa_kv_only_host_pool import NSAKVOnlyTokenToKVPoolHost
from sglang.srt.mem_cache.sparse_cache_controller import SparseCacheController

GIB = 1 << 30
# Rank model (61 layers, fp8 FlashMLA rows 656 B, indexer 132 B), page 64,
# window 64, host pool 84 GiB, PD decode (no staging), spare regions on.
L, ROW, IDX, PAGE, WINDOW = 61, 656, 132, 64, 64
TOP_K, CONTEXT_LEN, NEW_TOKENS = 2048, 163840, 160
# The configurator's rule without --max-running-requests: 40% of the
# budget in regions, at most 256.
REGION_SHARE, MAX_REGIONS = 0.4, 256


def default_units(buffer_size):
    # nsa_kv_offload_units.units_for_context
    return -(-(CONTEXT_LEN - WINDOW) // buffer_size)


def sizes(buffer_size, units, avail_gib, host_gib, request_slots=None):
    per_region = offload_bytes_per_region(L, ROW, buffer_size, WINDOW, units)
    regions = request_slots or min(
        MAX_REGIONS, int(REGION_SHARE * avail_gib * GIB) // per_region
    )
    scratch = TritonLRUSwap.scratch_bytes(
        regions, TOP_K, buffer_size, units, lru_slot_id_bytes(buffer_size, units)
    )
    s = compute_offload_pool_sizes(
        int(avail_gib * GIB), L, ROW, IDX, PAGE, buffer_size, WINDOW, regions,
        0, int(host_gib * GIB), None, units, 0, scratch,
    )  # fmt: skip
    return dict(
        host_gib=host_gib,
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
        units_moved=ctrl.get_stats()["units_moved"],
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--avail-gib",
        type=float,
        default=93.95,
        help="GPU bytes the offload's pools get (default: the budget of "
        "run_direct_flat_64/, calibrated at 4354e87)",
    )
    p.add_argument(
        "--request-slots",
        type=int,
        help="--max-running-requests (default: the configurator's rule)",
    )
    p.add_argument(
        "--host-gib", default="84", help="host pool sizes in GiB, comma-separated"
    )
    p.add_argument(
        "--units",
        help="max units per request at 4,096 rows, comma-separated (default: "
        "the model's context, 8, and 7 units of 4,416 rows)",
    )
    p.add_argument(
        "--points",
        default="64x30720,32x30720,8x131072,1x131072",
        help="REQUESTSxPROMPT, comma-separated",
    )
    args = p.parse_args(argv)
    settings = ((4096, default_units(4096)), (4096, 8), (4416, 7))
    if args.units:
        settings = tuple((4096, int(u)) for u in args.units.split(","))
    points = [tuple(map(int, x.split("x"))) for x in args.points.split(",")]
    out = {"avail_gib": args.avail_gib, "context_len": CONTEXT_LEN, "points": []}
    for host_gib in (float(h) for h in args.host_gib.split(",")):
        for buffer_size, units in settings:
            pool = sizes(
                buffer_size, units, args.avail_gib, host_gib, args.request_slots
            )
            for reqs, prompt in points:
                share = shares(
                    pool["units_total"],
                    pool["request_slots"],
                    units,
                    buffer_size,
                    reqs,
                    prompt,
                )
                out["points"].append({**pool, **share})
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
