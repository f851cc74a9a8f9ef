"""Why HiSparse's pools hold more 128K requests than ours on sglang 0.5.17,
and what the offload's own sizing predicts with its fixed costs trimmed (CPU).
Run from the repo root with the CI venv:
PYTHONPATH=python:test/srt .venv/bin/python <this file> > sizing_128k.json

For each committed H100 run (rank model, 61 layers) the GPU bytes the
offload's pools got are found by bisection: the bytes at which the product's
``compute_offload_pool_sizes`` gives the locs the server logged, with its
logged regions and staging rows. At those bytes the same function then sizes
variants: request slots cut to what the 128K requests need (one more than
they fill), and prefill staging sized for a 131,392-token context
(``--context-length``) instead of the model's 163,840. And two designs not
built (``one_arena``): a long prompt's staging rows, then also the regions,
taking GPU bytes from the locs' share as they come. A prediction from the
product's arithmetic, not a measurement.
"""

import json
import sys

from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import TritonLRUSwap
from sglang.srt.mem_cache.nsa_kv_offload_sizing import (
    compute_offload_pool_sizes,
    lru_slot_id_bytes,
    lru_unit_state_bytes,
    offload_bytes_per_loc,
    prefill_staging_rows,
    staging_reserve_rows,
)

L, ROW, IDX, PAGE, BUFFER, WINDOW, UNITS, TOP_K = 61, 656, 132, 64, 4096, 64, 40, 2048
CONTEXT_LEN, PREFILL_BUDGET = 163840, 16384
# The bench's 128K point: prompt + 300 new tokens, in pages.
NEED = -(-(131072 + 300) // PAGE) * PAGE
HOST_BYTES = 64 << 30  # --host-pool-gb 64: GiB (host capacity 1,717,299 logged)
# (run folder, KV budget GiB, request slots, locs logged, staging rows logged,
# HiSparse's capacity at 128K from its pools in the same run).
RUNS = (
    ("../../rank_speed/run_h100_0517_hisparse_32k_x8/", 14, 9, 473600, 200704, 5),
    ("../../rank_speed/run_h100_0517_hisparse_8k_32k_x1/", 30, 65, 1385024, 200768, 12),
)


def locs(avail, slots, staging, regions=None, extra_fixed=0, host=HOST_BYTES):
    """Locs the product's sizing gives (0 where the fixed costs do not fit)."""
    scratch = TritonLRUSwap.scratch_bytes(
        slots, TOP_K, BUFFER, UNITS, lru_slot_id_bytes(BUFFER, UNITS)
    )
    regions = slots if regions is None else regions
    try:
        return compute_offload_pool_sizes(
            int(avail), L, ROW, IDX, PAGE, BUFFER, WINDOW, regions, staging,
            host, None, UNITS, 0, scratch + extra_fixed,
        ).num_locs  # fmt: skip
    except RuntimeError:
        return 0


def one_arena(avail, slots):
    """128K requests held if a prompt's staging rows (then also each region's
    rows) took their GPU bytes from the locs' share as prefills and admissions
    come, instead of being fixed at startup; the host pool caps token locs
    only. Fixed staging keeps two prefill batches; the last admitted prompt is
    staged while the others decode; every slot keeps its LRU state."""
    reserve = staging_reserve_rows(PREFILL_BUDGET, slots, PAGE)
    per_loc = offload_bytes_per_loc(L, IDX, lru_slot_id_bytes(BUFFER, UNITS))
    state = lru_unit_state_bytes(L, BUFFER, UNITS)
    staged, region = NEED * L * ROW, (BUFFER + WINDOW) * L * ROW
    host_locs = HOST_BYTES // (L * ROW)

    def held(arena_locs, per_request):
        arena = arena_locs * per_loc
        fits = [n for n in range(slots + 1) if n * per_request + staged <= arena]
        return min(max(fits), host_locs // NEED)

    no_cap = 1 << 50
    staging_only = locs(avail, slots, reserve, host=no_cap)
    with_regions = locs(avail, slots, reserve, 0, slots * state, host=no_cap)
    return {
        "staging": held(staging_only, NEED * per_loc),
        "staging_and_regions": held(with_regions, NEED * per_loc + region),
    }


def calibrate(slots, staging, logged):
    """The least GPU bytes at which the sizing gives the logged locs."""
    lo, hi = 1 << 30, 200 << 30
    while hi - lo > 1 << 16:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if locs(mid, slots, staging) < logged else (lo, mid)
    return hi


def main():
    out = {"need_per_request": NEED, "host_pool_bytes": HOST_BYTES, "runs": []}
    for folder, budget, slots, logged, staging, hisparse in RUNS:
        avail = calibrate(slots, staging, logged)
        assert locs(avail, slots, staging) == logged, folder
        short = prefill_staging_rows(131072 + 320, PREFILL_BUDGET, slots, PAGE)

        def variant(name, s, st):
            n = locs(avail, s, st)
            return dict(variant=name, slots=s, staging_rows=st, locs=n,
                        capacity_128k=min(s, n // NEED))  # fmt: skip

        def cut_slots(st):
            # Slots cut to the 128K requests the locs then hold, plus one.
            s = slots
            for _ in range(8):
                s_next = min(slots, locs(avail, s, st) // NEED + 1)
                if s_next == s:
                    break
                s = s_next
            return s

        rows = [
            variant("as run", slots, staging),
            variant("context 131,392", slots, short),
            variant("slots cut", cut_slots(staging), staging),
            variant("slots cut, context 131,392", cut_slots(short), short),
        ]
        out["runs"].append(dict(folder=folder, kv_budget_gib=budget,
                                pool_bytes=avail, hisparse_capacity_128k=hisparse,
                                variants=rows, one_arena=one_arena(avail, slots)))  # fmt: skip
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
