"""Registers and stack (spills) of the LRU swap kernels, compiled for the
H200 (sm_90) on any machine: Triton compiles ahead of time with the ptxas it
ships, no GPU needed.

A spill in a swap kernel costs every decode layer. Prints one JSON line per
kernel and unit count:

    python benchmark/nsa_offload/engine/kernel_resources.py --units 1,2,4

``--query-tokens 2,4 --buffer-size 8192`` compiles the multi-token swap (MTP
target verify, docs/MTP.md) instead.

Run it without TRITON_INTERPRET (the kernels must be JIT functions).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# Argument dtypes of the swap kernels (LRUCacheState's buffers); every other
# runtime argument is an int32 scalar (strides, sink row).
POINTER_TYPES = {
    "topk_ptr": "*i32",
    "req_pool_ptr": "*i64",
    "seq_lens_ptr": "*i32",
    "req_to_token_ptr": "*i32",
    "num_real_ptr": "*i32",
    "loc_to_slot_ptr": "*i16",
    "slot_loc_ptr": "*i32",
    "lru_ptr": "*i16",
    "unit_base_ptr": "*i32",
    "unit_index_ptr": "*i32",
    "capacity_ptr": "*i32",
    "counters_ptr": "*i64",
    "page_table_ptr": "*i32",
    "miss_src_ptr": "*i64",
    "miss_dst_ptr": "*i32",
    "miss_count_ptr": "*i32",
    "hit_flags_ptr": "*i8",
    "victims_ptr": "*i32",
    "cur_ptr": "*i32",
    "ev_count_ptr": "*i32",
    "new_lru_ptr": "*i16",
    "direct_ptr": "*i8",
    "row_direct_ptr": "*i8",
}


def resources(kernel, constexprs: dict, num_warps: int, arch: int = 90) -> dict:
    """Compile ``kernel`` for ``sm_<arch>``; its registers and stack bytes."""
    sig = inspect.signature(kernel.fn).parameters
    params = list(sig)
    # Constexprs not given compile at their defaults (e.g. DIRECT=False).
    constexprs = {
        **{
            p: v.default
            for p, v in sig.items()
            if v.default is not inspect.Parameter.empty
        },
        **constexprs,
    }
    signature = {
        p: "constexpr" if p in constexprs else POINTER_TYPES.get(p, "i32")
        for p in params
    }
    src = ASTSource(
        kernel,
        signature,
        constexprs={(params.index(k),): v for k, v in constexprs.items()},
    )
    compiled = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}
    )
    tool = os.path.join(
        os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [tool, "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return {
        "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "num_warps": num_warps,
    }


def swap_kernels(
    units: int, buffer_size: int, top_k: int, window: int, query_tokens: int = 1
):
    """(name, kernel, constexprs, num_warps) as ``TritonLRUSwap`` launches
    them: one query token, the select kernel and the reorder's count, rank
    and copy-order kernels (each also with the direct-slots path compiled in,
    ``*_direct``); several (MTP target verify), :func:`multi_token_swap_kernels`."""
    from sglang.srt.mem_cache import nsa_kv_offload_lru_kernels as lru
    from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import (
        TritonLRUSwap,
        default_num_warps,
    )

    C0, C = buffer_size, buffer_size * units
    num_warps = default_num_warps(C)
    block_k = triton.next_power_of_2(top_k)
    shape = dict(C=C, C0=C0, U=units)
    chunk = dict(shape, BLOCK_C0=triton.next_power_of_2(C0))
    if query_tokens > 1:
        return multi_token_swap_kernels(
            units, buffer_size, top_k, window, query_tokens, num_warps
        )
    out = [
        (
            "select",
            lru._swap_select_kernel,
            dict(
                shape,
                K=top_k,
                W=window,
                BLOCK_K=block_k,
                BLOCK_S=min(TritonLRUSwap.SELECT_BLOCK, triton.next_power_of_2(C)),
            ),
        ),
        ("count", lru._swap_count_kernel, chunk),
        (
            "reorder_rank",
            lru._swap_rank_kernel,
            dict(
                chunk,
                K=top_k,
                BLOCK_U=triton.next_power_of_2(units),
                REORDER_ONLY=True,
            ),
        ),
        ("copy_order", lru._swap_copy_order_kernel, chunk),
    ]
    # The same kernels with the direct-slots path compiled in.
    out += [
        (name + "_direct", k, dict(c, DIRECT=True))
        for name, k, c in out
        if "DIRECT" in inspect.signature(k.fn).parameters
    ]
    return [(name, k, c, num_warps) for name, k, c in out]


def multi_token_swap_kernels(units, buffer_size, top_k, window, q, num_warps):
    """The kernels of a swap with ``q`` query tokens per request: classify,
    count, rank (with eviction), assign."""
    from sglang.srt.mem_cache import nsa_kv_offload_lru_kernels as lru
    from sglang.srt.mem_cache import nsa_kv_offload_lru_multi_kernels as multi

    C0, C = buffer_size, buffer_size * units
    entries = dict(
        K=top_k,
        Q=q,
        W=window,
        WR=window - q + 1,
        BLOCK_K=triton.next_power_of_2(top_k),
        C=C,
        C0=C0,
    )
    chunk = dict(C=C, C0=C0, U=units, BLOCK_C0=triton.next_power_of_2(C0))
    out = [
        (
            "multi_classify",
            multi._swap_multi_classify_kernel,
            dict(entries, U=units, BLOCK_C0=chunk["BLOCK_C0"]),
        ),
        ("count", lru._swap_count_kernel, chunk),
        (
            "rank",
            lru._swap_rank_kernel,
            dict(chunk, K=q * top_k, BLOCK_U=triton.next_power_of_2(units)),
        ),
        (
            "multi_assign",
            multi._swap_multi_assign_kernel,
            dict(entries, U=units, BLOCK_C0=chunk["BLOCK_C0"]),
        ),
    ]
    return [(name, k, c, num_warps) for name, k, c in out]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--units", default="1,2,4", help="comma-separated LRU units per request"
    )
    p.add_argument(
        "--buffer-size",
        type=int,
        default=4096,
        help="LRU rows per request and layer (C)",
    )
    p.add_argument("--top-k", type=int, default=2048, help="indexer top-k width K")
    p.add_argument(
        "--window", type=int, default=64, help="recent-window rows per request (W)"
    )
    p.add_argument(
        "--query-tokens",
        default="1",
        help="comma-separated query tokens per request (> 1: MTP target verify)",
    )
    p.add_argument(
        "--arch",
        type=int,
        default=90,
        help="CUDA compute capability to compile for (90 = H100/H200)",
    )
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_resources.py: unset TRITON_INTERPRET (needs JIT kernels)")
    for q in (int(x) for x in args.query_tokens.split(",")):
        for units in (int(u) for u in args.units.split(",")):
            for name, kernel, constexprs, num_warps in swap_kernels(
                units, args.buffer_size, args.top_k, args.window, q
            ):
                row = {"kernel": name, "units": units}
                if q > 1:
                    row["query_tokens"] = q
                row.update(resources(kernel, constexprs, num_warps, args.arch))
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
