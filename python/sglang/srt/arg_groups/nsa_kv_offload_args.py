"""Server-argument defaults and validation for --enable-decode-nsa-kv-offload.

Decode-side NSA KV offload keeps the full MLA KV of every token in pinned host
memory and only a per-request working set of rows on the GPU (see
docs/ENGINE.md). The checks below reject configurations the offload path does
not handle, naming the offending flags, before any GPU memory is touched.
"""

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import psutil

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

GB = 1 << 30

NSA_KV_OFFLOAD_PAGE_SIZE = 64

# LRU slot ids of a request are int16 (loc_to_slot, lru_order) while its
# units x buffer slots fit, int32 beyond (lru_slot_dtype).
_MAX_INT16_LRU_SLOTS = 32767
# One unit's LRU rows: the one-unit swap walks them in one program.
_MAX_BUFFER_SIZE = 32767

# The NSA backends run on the GPU with the offload, the only ones accepted:
# decode reads KV through a per-token page table (by KV dtype); prefill must
# translate token locs to staging rows before it reads KV, which only the
# FlashMLA sparse prefill path is shown to do (flashmla_kv and flashmla_auto
# prefill, trtllm, fa3, tilelang were never run with the offload on; trtllm
# reads KV by token loc before the translation: silent wrong attention).
_OFFLOAD_DECODE_BACKENDS_BY_DTYPE = {
    "fp8_e4m3": "flashmla_kv",
    "bfloat16": "flashmla_sparse",
}
_OFFLOAD_PREFILL_BACKENDS = ("flashmla_sparse",)

# Host memory left to the OS, the scheduler and the tokenizer when sizing the
# pinned pool automatically: the larger of an absolute floor and a fraction.
_HOST_RESERVE_MIN_GB = 8.0
_HOST_RESERVE_FRACTION = 0.1


# Lets --tp-size > 1 and --enable-dp-attention start, for the GPU runs that
# prove them (docs/MULTI_GPU.md); refused without it.
ENV_UNPROVEN_PARALLEL = "SGLANG_NSA_KV_OFFLOAD_UNPROVEN_PARALLEL"
# Experimental cross-layer prefetch (read by the coordinator).
ENV_CROSS_LAYER_PREFETCH = "SGLANG_NSA_KV_OFFLOAD_CROSS_LAYER_PREFETCH"
# The early swap (early_swap_enabled): a decode or verify layer's swap and miss
# copy start on a side stream as soon as its top-k exists, beside the query
# projection and rope, instead of right before its attention.
ENV_EARLY_SWAP = "SGLANG_NSA_KV_OFFLOAD_EARLY_SWAP"
# Direct slots (on by default without MTP or CLOCK; "0" turns them off): a request
# whose context fits its LRU slots keeps position p in slot p and swaps
# without the LRU walk.
ENV_DIRECT_SLOTS = "SGLANG_NSA_KV_OFFLOAD_DIRECT_SLOTS"
# Spare regions (on by default; "0" turns them off; read by the pool
# configurator): GPU bytes the host pool leaves without locs become regions
# lent to requests as units.
ENV_SPARE_REGIONS = "SGLANG_NSA_KV_OFFLOAD_SPARE_REGIONS"
# Idle-loc units (on by default; "0" turns them off; read by the pool
# configurator): each layer's KV rows and indexer keys share one buffer, and
# the keys' bytes of free token locs are lent to requests as units
# (docs/ELASTIC_BUFFER.md, piece 2), taken back when locs are allocated.
ENV_IDLE_LOC_UNITS = "SGLANG_NSA_KV_OFFLOAD_IDLE_LOC_UNITS"
# Warm units (on by default where warm_units_refusal allows; "0" turns them
# off): a request is warmed after its units are granted, into every slot it
# holds, instead of one unit's top-k rows at admission.
ENV_WARM_UNITS = "SGLANG_NSA_KV_OFFLOAD_WARM_UNITS"
# Experimental flat miss copy (read by the coordinator): N programs share all
# requests' misses instead of a grid per request, so that the copy's waits on
# host reads hold at most N SMs beside the forward stream.
ENV_GATHER_PROGRAMS = "SGLANG_NSA_KV_OFFLOAD_GATHER_PROGRAMS"
# Experimental bounded direct warm-up (read by the coordinator): a request
# entering direct mode is warmed with at most N positions below its first
# window (the newest); the older ones are read in on demand, each into its own
# slot. Unset: all of them (a 128K request reads 5.2 GB of host memory before
# its first step, and its batch waits).
ENV_DIRECT_WARM_POSITIONS = "SGLANG_NSA_KV_OFFLOAD_DIRECT_WARM_POSITIONS"
# Experimental (read by the coordinator, early swap only): a layer's swap
# starts after its query rope instead of right after its indexer, so that the
# swap's kernels do not share the SMs with the query's absorb GEMM and rope.
ENV_SWAP_AFTER_ROPE = "SGLANG_NSA_KV_OFFLOAD_SWAP_AFTER_ROPE"
# Experimental slot replacement (read by the coordinator): "lru" (the
# default) or "clock" (nsa_kv_offload_clock: no recency update walks the LRU
# order every step; one query token, no direct slots).
ENV_SLOT_POLICY = "SGLANG_NSA_KV_OFFLOAD_POLICY"
# sglang's own: spec v2 prepares the verify on a second stream.
ENV_OVERLAP_PLAN_STREAM = "SGLANG_ENABLE_OVERLAP_PLAN_STREAM"
# Speculative decoding the offload's multi-token swap serves (docs/MTP.md):
# EAGLE / NextN MTP with one draft chain, target verify with the drafts and
# the bonus token as query tokens. NEXTN is EAGLE after sglang's alias step.
_OFFLOAD_SPECULATIVE_ALGORITHMS = ("EAGLE", "NEXTN")
# Steps the multi-token swap is tested with (query tokens = steps + 1).
_OFFLOAD_MAX_SPECULATIVE_STEPS = 3


def host_memory_reserve_gb(total_bytes: int) -> float:
    return max(_HOST_RESERVE_MIN_GB, _HOST_RESERVE_FRACTION * total_bytes / GB)


def swap_query_tokens(server_args) -> int:
    """Query tokens per request one offload swap serves: the target verify's
    draft tokens with MTP, else 1 (decode)."""
    if server_args.speculative_algorithm:
        return server_args.speculative_num_draft_tokens
    return 1


def swap_batch_rows(server_args, max_running_requests: int) -> int:
    """Batch rows the swap's plans and scratch are sized for: the request
    slots or the CUDA-graph batches, whichever is larger."""
    return max(max_running_requests, server_args.cuda_graph_max_bs or 0)


def env_default_on(env: str) -> bool:
    """A setting on by default: on unless its variable is set false ("0")."""
    from sglang.srt.utils import get_bool_env_var

    return os.environ.get(env, "") == "" or get_bool_env_var(env)


def early_swap_enabled() -> bool:
    """Whether decode and verify layers swap early (``ENV_EARLY_SWAP``): on
    unless the variable is "0" (every variant, MTP verify and the prefetch on
    the swap's stream included, ran exact on the H200)."""
    return env_default_on(ENV_EARLY_SWAP)


def direct_slots_enabled(speculative: bool) -> bool:
    """Whether requests whose context fits their slots swap in direct mode
    (``ENV_DIRECT_SLOTS``): on unless "0"; off with MTP (the verify swaps
    several query tokens per request) and with a slot policy other than LRU
    (CLOCK places every slot by its own policy); "1" with either is refused."""
    from sglang.srt.mem_cache.nsa_kv_offload_clock import LRU_POLICY

    return (
        env_default_on(ENV_DIRECT_SLOTS)
        and not speculative
        and slot_policy_from_env() == LRU_POLICY
    )


def slot_policy_from_env() -> str:
    """The slots' replacement policy (``ENV_SLOT_POLICY``): "lru" when unset."""
    from sglang.srt.mem_cache.nsa_kv_offload_clock import LRU_POLICY, POLICIES

    value = os.environ.get(ENV_SLOT_POLICY, "") or LRU_POLICY
    if value not in POLICIES:
        raise ValueError(
            f"{ENV_SLOT_POLICY}={value!r}: expected one of {', '.join(POLICIES)}"
        )
    return value


def spare_regions_enabled() -> bool:
    """Whether the GPU bytes the locs leave become spare regions
    (``ENV_SPARE_REGIONS``): on unless "0"."""
    return env_default_on(ENV_SPARE_REGIONS)


def idle_loc_units_enabled() -> bool:
    """Whether free locs' indexer keys are lent as units
    (``ENV_IDLE_LOC_UNITS``): on unless "0"."""
    return env_default_on(ENV_IDLE_LOC_UNITS)


def warm_units_enabled(
    max_units: int, speculative: bool, shared_host_pool: bool
) -> bool:
    """Whether admissions are warmed after their units are granted
    (``ENV_WARM_UNITS``): on unless "0", where ``warm_units_refusal`` allows
    (there "1" is refused at startup)."""
    return env_default_on(ENV_WARM_UNITS) and (
        warm_units_refusal(max_units, speculative, shared_host_pool) is None
    )


def int_from_env(env: str, minimum: int = 1) -> Optional[int]:
    """An integer setting's value (at least ``minimum``), None when unset."""
    value = os.environ.get(env, "")
    if value == "":
        return None
    if not value.isdigit() or int(value) < minimum:
        raise ValueError(f"{env}={value!r}: expected an integer >= {minimum}")
    return int(value)


def gather_programs_from_env() -> Optional[int]:
    """The flat miss copy's program count (``ENV_GATHER_PROGRAMS``), None
    when unset: the copy's default grid."""
    return int_from_env(ENV_GATHER_PROGRAMS)


def direct_warm_positions_from_env() -> Optional[int]:
    """Most positions a direct request is warmed with at admission
    (``ENV_DIRECT_WARM_POSITIONS``, 0 allowed), None when unset: all."""
    return int_from_env(ENV_DIRECT_WARM_POSITIONS, minimum=0)


def pinnable_host_memory_gb(num_host_pools: int) -> float:
    """Host memory one host pool may pin: the node's available RAM minus the
    reserve, split over the host pools pinned on this node."""
    mem = psutil.virtual_memory()
    usable = mem.available / GB - host_memory_reserve_gb(mem.total)
    return max(usable, 0.0) / max(num_host_pools, 1)


@dataclass(frozen=True)
class NSAKVOffloadRankLayout:
    """How the GPU processes of one server on one node hold the host KV.

    Ranks of one attention-TP group hold the same MLA KV (the latent is
    replicated, only the heads are split), so on a node they share one host
    pool; every other rank (a DP-attention rank, a plain DP replica) keeps its
    own requests in its own pool.
    """

    local_ranks: int  # GPU processes of this server on one node
    attn_tp_size: int  # ranks of one attention-TP group
    ranks_per_pool: int  # local ranks that share one host pool

    @property
    def host_pools_per_node(self) -> int:
        return max(self.local_ranks // self.ranks_per_pool, 1)

    @property
    def attn_tp_spans_nodes(self) -> bool:
        return self.attn_tp_size > self.ranks_per_pool

    @classmethod
    def from_server_args(cls, server_args: "ServerArgs") -> "NSAKVOffloadRankLayout":
        tp, dp = server_args.tp_size, max(server_args.dp_size, 1)
        if server_args.enable_dp_attention:
            replicas, attn_tp = 1, max(tp // dp, 1)
        else:
            replicas, attn_tp = dp, tp  # plain DP: dp replicas of tp ranks
        world = tp * server_args.pp_size * replicas
        local = max(world // max(server_args.nnodes, 1), 1)
        return cls(
            local_ranks=local,
            attn_tp_size=attn_tp,
            ranks_per_pool=min(attn_tp, local),
        )


def _fail(message: str) -> None:
    raise ValueError(f"--enable-decode-nsa-kv-offload: {message}")


def warm_units_refusal(
    max_units: int, speculative: bool, shared_host_pool: bool
) -> Optional[str]:
    """Why warm units cannot apply (None: they can): they warm each admitted
    request, after the rebalance, into every slot its units give it, one
    query token per request, from host memory. Where they cannot, they are
    off by default and ``ENV_WARM_UNITS=1`` is refused."""
    if max_units <= 1:
        return "needs --nsa-kv-offload-max-units above 1"
    if speculative:
        return "does not support MTP target verify (--speculative-algorithm)"
    if shared_host_pool:
        # Such a rank warms from its prefill staging rows, which are free
        # again by the time the units are granted.
        return (
            "does not combine with a host pool shared by attention-TP ranks "
            "(--tp-size above the DP-attention size)"
        )
    return None


def nsa_kv_offload_default_max_units(
    context_len: int, buffer_size: int, recent_window: int
) -> int:
    """Default units one request may hold: enough LRU slots for every
    position of the longest context below its recent window, so that any
    request whose context fits the idle GPU rows swaps in direct mode. Units
    are lent only while idle and each request only what its own context
    needs (``SparseCacheController.units_to_hold``)."""
    from sglang.srt.mem_cache.nsa_kv_offload_units import units_for_context

    return units_for_context(context_len, buffer_size, recent_window)


def nsa_kv_offload_default_buffer_size(index_topk: int, query_tokens: int) -> int:
    """Default LRU rows per request and layer: one top-k more than the union
    of a step's query tokens' top-k can need (``2 x index_topk`` for decode)."""
    return (query_tokens + 1) * index_topk


def check_nsa_kv_offload_speculative(server_args: "ServerArgs", index_topk: int) -> int:
    """Refuse the speculative-decoding settings the offload's MTP target
    verify does not serve (docs/MTP.md); returns the query tokens per request
    of a target-model forward (1 without speculative decoding). Call it after
    sglang's speculative-decoding step (NEXTN resolved to EAGLE, the
    draft-token count adjusted, spec v1 or v2 chosen: spec v2 is the overlap
    scheduler left on) and after the buffer size default is resolved."""
    from sglang.srt.utils import get_bool_env_var

    algorithm = server_args.speculative_algorithm
    if algorithm is None:
        return 1
    if algorithm.upper() not in _OFFLOAD_SPECULATIVE_ALGORITHMS:
        _fail(
            f"--speculative-algorithm {algorithm} is not supported; only EAGLE / "
            "NEXTN MTP is."
        )
    if server_args.tp_size > 1 or server_args.enable_dp_attention:
        # MTP has run with the offload on one GPU only; DP attention would
        # also pad verify's top-k rows, which the verify swap does not skip.
        _fail(
            f"--speculative-algorithm {algorithm} is not supported with "
            "--tp-size > 1 or --enable-dp-attention yet."
        )
    topk = server_args.speculative_eagle_topk
    if topk != 1:
        # A draft tree's query tokens see different prefixes: positions stop
        # being one chain, and a branch's KV is not the committed token's.
        _fail(
            f"--speculative-eagle-topk {topk} is not supported; only 1 (one "
            "draft chain) is."
        )
    steps = server_args.speculative_num_steps
    if steps is None or not 1 <= steps <= _OFFLOAD_MAX_SPECULATIVE_STEPS:
        _fail(
            f"--speculative-num-steps {steps} is not supported; 1 to "
            f"{_OFFLOAD_MAX_SPECULATIVE_STEPS} are."
        )
    query_tokens = server_args.speculative_num_draft_tokens
    if query_tokens != steps + 1:
        _fail(
            f"--speculative-num-draft-tokens ({query_tokens}) must be "
            f"--speculative-num-steps + 1 ({steps + 1}) with "
            "--speculative-eagle-topk 1."
        )
    if server_args.speculative_adaptive:
        # Adaptive steps change the verify's query tokens at runtime; the LRU
        # state and its kernels are built for one count.
        _fail(
            f"--speculative-adaptive is not supported with --speculative-algorithm "
            f"{algorithm}; the number of steps must stay fixed."
        )
    if server_args.enable_multi_layer_eagle:
        _fail(
            f"--enable-multi-layer-eagle is not supported with --speculative-algorithm "
            f"{algorithm}."
        )
    if not server_args.disable_overlap_schedule:
        # Spec v2: the verify locs are mapped to ring rows on the worker
        # (prepare_for_v2_verify). What it has not run with is refused.
        if server_args.disaggregation_mode == "decode":
            # The KV transfer writes host slots of locs freed while a forward
            # that may still write them back is in flight, outside any stream.
            _fail(
                "speculative decoding with the overlap scheduler (spec v2) on a PD "
                "decode server (--disaggregation-mode decode) is not supported; "
                "pass --disable-overlap-schedule (spec v1)."
            )
        if get_bool_env_var(ENV_OVERLAP_PLAN_STREAM):
            _fail(
                f"{ENV_OVERLAP_PLAN_STREAM}=1 (spec v2's plan stream) is not "
                "supported; unset it or pass --disable-overlap-schedule (spec v1)."
            )
    for env in (ENV_CROSS_LAYER_PREFETCH, ENV_DIRECT_SLOTS):
        if get_bool_env_var(env):
            # Both swap one top-k row per request, verify has q.
            _fail(f"{env}=1 is not supported with --speculative-algorithm {algorithm}.")
    buffer_size = server_args.nsa_kv_offload_gpu_buffer_size
    if buffer_size is not None and buffer_size < query_tokens * index_topk:
        # A verify step keeps the union of its query tokens' top-k resident.
        _fail(
            f"--nsa-kv-offload-gpu-buffer-size ({buffer_size}) must be at least "
            f"--speculative-num-draft-tokens ({query_tokens}) x the model's "
            f"index_topk ({index_topk}) = {query_tokens * index_topk}."
        )
    window = server_args.nsa_kv_offload_recent_window
    if window < 2 * query_tokens - 1:
        # Swaps read the newest window - (query tokens - 1) positions from the
        # ring, the drafts among them.
        _fail(
            f"--nsa-kv-offload-recent-window ({window}) must be at least 2 x "
            f"--speculative-num-draft-tokens - 1 ({2 * query_tokens - 1})."
        )
    return query_tokens


def apply_nsa_kv_offload_backend_defaults(
    server_args: "ServerArgs",
    user_set_prefill: bool,
    user_set_decode: bool,
    kv_cache_dtype: str,
) -> bool:
    """sglang's NSA backend defaults with the offload on: the backends it runs
    with, for whichever of the two flags the user left unset (an explicit
    choice is validated later). True when the defaults were handled here."""
    if not server_args.enable_decode_nsa_kv_offload:
        return False
    decode = _OFFLOAD_DECODE_BACKENDS_BY_DTYPE.get(kv_cache_dtype)
    if decode is None:
        return False  # refused with its reason by handle_decode_nsa_kv_offload
    if not user_set_prefill:
        server_args.nsa_prefill_backend = _OFFLOAD_PREFILL_BACKENDS[0]
    if not user_set_decode:
        server_args.nsa_decode_backend = decode
    logger.info(
        "Decode NSA KV offload: NSA backends prefill=%s, decode=%s.",
        server_args.nsa_prefill_backend,
        server_args.nsa_decode_backend,
    )
    return True


def handle_decode_nsa_kv_offload(server_args: "ServerArgs") -> None:
    """Resolve the --nsa-kv-offload-* defaults and validate the combination."""
    if not server_args.enable_decode_nsa_kv_offload:
        return

    from sglang.srt.configs.model_config import get_nsa_index_topk, is_deepseek_nsa

    hf_config = server_args.get_model_config().hf_config
    if not is_deepseek_nsa(hf_config):
        archs = getattr(hf_config, "architectures", None)
        _fail(
            "only DSA/NSA models (e.g. DeepSeek-V3.2, GLM-5) are supported, "
            f"but --model-path {server_args.model_path} is {archs}."
        )
    index_topk = get_nsa_index_topk(hf_config)

    if server_args.disaggregation_mode == "prefill":
        _fail(
            "it is a decode-side feature and cannot be used with "
            "--disaggregation-mode prefill."
        )
    if server_args.disaggregation_mode == "decode":
        # The prefill server writes KV rows into the host pool (host slot = token
        # loc); the decode-side caches below would keep them on the GPU instead.
        if server_args.disaggregation_decode_enable_radix_cache:
            _fail("--disaggregation-decode-enable-radix-cache is not supported.")
        if server_args.disaggregation_decode_enable_offload_kvcache:
            _fail(
                "--disaggregation-decode-enable-offload-kvcache is not supported "
                "(the offload already keeps every request's KV in host memory)."
            )
    if server_args.enable_hisparse:
        _fail("it cannot be combined with --enable-hisparse; pick one of the two.")
    layout = NSAKVOffloadRankLayout.from_server_args(server_args)
    _check_parallelism(server_args, layout)
    if not server_args.disable_radix_cache:
        _fail("it requires --disable-radix-cache.")
    if server_args.enable_mixed_chunk:
        # Decode requests inside an extend batch would read KV by token loc.
        _fail("--enable-mixed-chunk is not supported.")
    if server_args.enable_two_batch_overlap:
        # The decode forward's hooks keep one real-row count and one set of
        # swap buffers per forward; two interleaved micro-batches would share them.
        _fail("--enable-two-batch-overlap is not supported.")
    if server_args.page_size != NSA_KV_OFFLOAD_PAGE_SIZE:
        _fail(
            f"it requires --page-size {NSA_KV_OFFLOAD_PAGE_SIZE} (the NSA indexer "
            f"page), but got --page-size {server_args.page_size}."
        )

    expected_backend = _OFFLOAD_DECODE_BACKENDS_BY_DTYPE.get(server_args.kv_cache_dtype)
    if expected_backend is None:
        _fail(
            "it supports --kv-cache-dtype fp8_e4m3 or bfloat16, but got "
            f"--kv-cache-dtype {server_args.kv_cache_dtype}."
        )
    if server_args.nsa_decode_backend != expected_backend:
        _fail(
            f"with --kv-cache-dtype {server_args.kv_cache_dtype} it requires "
            f"--nsa-decode-backend {expected_backend}, but got "
            f"--nsa-decode-backend {server_args.nsa_decode_backend}."
        )
    if server_args.nsa_prefill_backend not in _OFFLOAD_PREFILL_BACKENDS:
        _fail(
            "it requires --nsa-prefill-backend "
            f"{' or '.join(_OFFLOAD_PREFILL_BACKENDS)} (the prefill path that reads "
            "KV through the offload's staging rows), but got --nsa-prefill-backend "
            f"{server_args.nsa_prefill_backend}."
        )

    if server_args.nsa_kv_offload_gpu_buffer_size is None:
        # MTP: one top-k more than the union of a verify's query tokens.
        query_tokens = 1
        if server_args.speculative_algorithm is not None:
            query_tokens = server_args.speculative_num_draft_tokens or 1
        server_args.nsa_kv_offload_gpu_buffer_size = nsa_kv_offload_default_buffer_size(
            index_topk, query_tokens
        )
    buffer_size = server_args.nsa_kv_offload_gpu_buffer_size
    window = server_args.nsa_kv_offload_recent_window
    if buffer_size < index_topk:
        _fail(
            f"--nsa-kv-offload-gpu-buffer-size ({buffer_size}) must be at least the "
            f"model's index_topk ({index_topk})."
        )
    if window < 1:
        _fail(f"--nsa-kv-offload-recent-window ({window}) must be at least 1.")
    if window >= buffer_size:
        _fail(
            f"--nsa-kv-offload-recent-window ({window}) must be smaller than "
            f"--nsa-kv-offload-gpu-buffer-size ({buffer_size})."
        )
    check_nsa_kv_offload_speculative(server_args, index_topk)
    from sglang.srt.utils import get_bool_env_var

    if buffer_size > _MAX_BUFFER_SIZE:
        _fail(
            f"--nsa-kv-offload-gpu-buffer-size ({buffer_size}) must be at most "
            f"{_MAX_BUFFER_SIZE}."
        )
    max_units = server_args.nsa_kv_offload_max_units
    if max_units is None:
        server_args.nsa_kv_offload_max_units = nsa_kv_offload_default_max_units(
            server_args.get_model_config().context_len, buffer_size, window
        )
    elif max_units < 1:
        _fail(f"--nsa-kv-offload-max-units ({max_units}) must be at least 1.")
    max_units = server_args.nsa_kv_offload_max_units
    if max_units * buffer_size > _MAX_INT16_LRU_SLOTS:
        logger.info(
            "Decode NSA KV offload: int32 LRU slot ids for %d units x %d rows "
            "(2 more bytes per token and layer for the slot map, and per slot "
            "and layer for the LRU order, than int16 ids).",
            max_units,
            buffer_size,
        )

    why = warm_units_refusal(
        max_units,
        server_args.speculative_algorithm is not None,
        layout.ranks_per_pool > 1,
    )
    if why and get_bool_env_var(ENV_WARM_UNITS):
        _fail(f"{ENV_WARM_UNITS}=1 {why}.")
    try:
        policy = slot_policy_from_env()
    except ValueError as e:
        _fail(str(e) + ".")
    if policy != "lru":
        # It swaps one query token per request, every slot by the policy.
        if server_args.speculative_algorithm is not None:
            _fail(f"{ENV_SLOT_POLICY}={policy} is not supported with MTP.")
        if get_bool_env_var(ENV_DIRECT_SLOTS):
            _fail(
                f"{ENV_SLOT_POLICY}={policy} does not combine with {ENV_DIRECT_SLOTS}=1."
            )

    pinnable_gb = pinnable_host_memory_gb(layout.host_pools_per_node)
    host_pool_gb = server_args.nsa_kv_offload_host_pool_gb
    if host_pool_gb is None:
        if pinnable_gb <= 0:
            _fail(
                "no host memory is left to pin after the reserve; set "
                "--nsa-kv-offload-host-pool-gb explicitly."
            )
        server_args.nsa_kv_offload_host_pool_gb = round(pinnable_gb, 2)
    elif host_pool_gb <= 0:
        _fail(f"--nsa-kv-offload-host-pool-gb ({host_pool_gb}) must be positive.")
    elif host_pool_gb > pinnable_gb:
        _fail(
            f"--nsa-kv-offload-host-pool-gb ({host_pool_gb}) is larger than the host "
            f"memory one host pool can pin ({pinnable_gb:.2f} GB: available RAM minus "
            f"a reserve, split over the {layout.host_pools_per_node} host pool(s) of "
            "this node)."
        )

    if layout.ranks_per_pool > 1:
        scope = f"shared by {layout.ranks_per_pool} attention-TP ranks"
    else:
        scope = "per rank"
    logger.info(
        "Decode NSA KV offload: %d LRU rows + %d recent-window rows per request "
        "per layer (index_topk=%d), up to %d x %d LRU rows while GPU memory is "
        "idle, host pool %.2f GB %s.",
        buffer_size,
        window,
        index_topk,
        server_args.nsa_kv_offload_max_units,
        buffer_size,
        server_args.nsa_kv_offload_host_pool_gb,
        scope,
    )


def _check_parallelism(
    server_args: "ServerArgs", layout: NSAKVOffloadRankLayout
) -> None:
    """Refuse the parallel layouts the offload cannot run, then those it has
    not run on GPUs yet (docs/MULTI_GPU.md)."""
    from sglang.srt.utils import get_bool_env_var

    tp, dp = server_args.tp_size, server_args.dp_size
    if server_args.pp_size > 1:
        _fail(
            f"pipeline parallelism (--pp-size {server_args.pp_size}) is not supported."
        )
    if server_args.attn_cp_size > 1 or server_args.enable_nsa_prefill_context_parallel:
        _fail(
            "attention context parallelism (--attn-cp-size "
            f"{server_args.attn_cp_size}, --enable-nsa-prefill-context-parallel) is "
            "not supported."
        )
    if server_args.enable_dp_attention and dp != tp:
        # Attention TP inside each DP group: the shared host pool of an
        # attention-TP group and DP attention at once, never built.
        _fail(
            f"--enable-dp-attention with --dp-size {dp} smaller than --tp-size {tp} "
            f"(attention TP of {tp // max(dp, 1)} GPUs inside each DP group) is not "
            f"supported; use --dp-size {tp}."
        )
    if layout.attn_tp_size > 1:
        if layout.attn_tp_spans_nodes:
            _fail(
                f"tensor parallelism across nodes (--tp-size {tp} over --nnodes "
                f"{server_args.nnodes}) is not supported: the ranks of an "
                "attention-TP group share one host pool, so they must be on one "
                "node."
            )
        if server_args.disaggregation_mode == "decode":
            _fail(
                f"tensor parallelism (--tp-size {tp}) on a PD decode server is not "
                "supported: the KV transfer writes every rank's copy of a prompt, "
                "while the ranks of an attention-TP group share one host pool with "
                "one writer."
            )
    if get_bool_env_var(ENV_UNPROVEN_PARALLEL):
        if layout.attn_tp_size > 1 or server_args.enable_dp_attention:
            logger.warning(
                "Decode NSA KV offload: %s=1, starting a layout not yet run on GPUs "
                "(--tp-size %d, --dp-size %d, --enable-dp-attention %s).",
                ENV_UNPROVEN_PARALLEL,
                tp,
                dp,
                server_args.enable_dp_attention,
            )
        return
    if server_args.enable_dp_attention:
        _fail(
            f"DP attention (--enable-dp-attention --dp-size {dp}) has not run on GPUs "
            "yet: its IDLE batches, the DP-attention padding of decode batches "
            "(eager and CUDA graphs) and admission per rank are tested on CPU only "
            f"({ENV_UNPROVEN_PARALLEL}=1 lets it start, for the GPU runs that prove "
            "it)."
        )
    if layout.attn_tp_size > 1:
        _fail(
            f"tensor parallelism (--tp-size {tp}) has not run on GPUs yet: the host "
            "pool its attention-TP ranks share (rank 0 writes, every rank reads) is "
            f"simulated on CPU only ({ENV_UNPROVEN_PARALLEL}=1 lets it start, for "
            "the GPU runs that prove it)."
        )
