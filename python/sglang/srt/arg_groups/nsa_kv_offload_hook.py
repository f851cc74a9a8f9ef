"""Server arguments of --enable-decode-nsa-kv-offload: defaults, validation and
the frozen options the offload is built from.

:func:`handle_decode_nsa_kv_offload` (once, in ``ServerArgs.__post_init__``;
0.5.23: a step of the resolution pipeline)
resolves the ``--nsa-kv-offload-*`` defaults and refuses, naming the flag at
fault, what the offload does not handle (docs/MTP.md; docs/MULTI_GPU.md);
``NSAKVOffloadOptions`` reads the resolved args (docs/ENGINE.md, "Options").
Mid-resolution reads go through ``resolved_view``; backends are declarations,
and so are the defaults on 0.5.23 (``compat.declare``).
"""

import logging
from dataclasses import dataclass
from typing import Optional

import psutil
from sglang.srt.environ import envs
from sglang.srt.mem_cache import nsa_kv_offload_compat as compat
from sglang.srt.mem_cache.nsa_kv_offload_units import units_for_context

logger = logging.getLogger(__name__)

GB = 1 << 30
NSA_KV_OFFLOAD_PAGE_SIZE = 64
_MAX_BUFFER_SIZE = 32767  # one unit's LRU rows fit int16 slot ids
# Decode reads KV through the offload's page table (backend by KV dtype);
# prefill through the staging rows, which only FlashMLA sparse prefill does.
_DECODE_BACKENDS_BY_DTYPE = {"fp8_e4m3": "flashmla_kv", "bfloat16": "flashmla_sparse"}
_PREFILL_BACKENDS = ("flashmla_sparse",)
# Host memory the automatic pinned pool leaves: the larger of floor, fraction.
_HOST_RESERVE_MIN_GB = 8.0
_HOST_RESERVE_FRACTION = 0.1
# MTP the multi-token swap serves (docs/MTP.md); NEXTN is EAGLE by then.
_SPECULATIVE_ALGORITHMS = ("EAGLE", "NEXTN")
_MAX_SPECULATIVE_STEPS = 3
VERIFY_MODES = ("fail", "count")
_REFUSED_FLAGS = (
    "enable_mixed_chunk",
    "enable_two_batch_overlap",
    "enable_hierarchical_cache",
    "enable_pdmux",
    "enable_unified_memory",
    "enable_kv_cache_sharding",  # (0.5.23)
)


def _fail(message: str) -> None:
    raise ValueError(f"--enable-decode-nsa-kv-offload: {message}")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _query_tokens(sa) -> int:
    # Per request and target forward: the MTP draft tokens, or 1.
    return sa.speculative_num_draft_tokens if sa.speculative_algorithm else 1


def pinnable_host_memory_gb(num_host_pools: int) -> float:
    """Available RAM minus the reserve, split over this node's host pools."""
    mem = psutil.virtual_memory()
    reserve = max(_HOST_RESERVE_MIN_GB, _HOST_RESERVE_FRACTION * mem.total / GB)
    return max(mem.available / GB - reserve, 0.0) / max(num_host_pools, 1)


@dataclass(frozen=True)
class NSAKVOffloadRankLayout:
    """How a server's GPU processes on a node hold the host KV: an attention-TP
    group shares one host pool, every other rank keeps its own."""

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
    def from_server_args(cls, sa) -> "NSAKVOffloadRankLayout":
        sa = compat.resolved_args(sa)
        # DP attention: groups of tp // attn_dp ranks; plain DP: replicas of tp.
        replicas = compat.dp_replicas(sa)
        attn_tp = sa.tp_size // compat.attn_dp_size(sa)
        world = sa.tp_size * sa.pp_size * replicas
        local = max(world // max(sa.nnodes, 1), 1)
        return cls(local, attn_tp, min(attn_tp, local))


@dataclass(frozen=True)
class NSAKVOffloadOptions:
    """What the offload is built with, read from resolved server args."""

    top_k: int  # K: the indexer's top-k width
    buffer_size: int  # C: LRU rows per unit and layer
    recent_window: int  # W: ring rows of a request's newest tokens
    max_units: int  # U: units one request may hold
    host_pool_gb: float  # pinned host memory of one host pool
    query_tokens: int  # per request and target forward: MTP draft tokens, or 1
    kv_arrives_in_host: bool  # a PD decode server: the transfer fills host slots
    shares_host_pool: bool  # attention TP: one host pool per group and node
    prefill_budget: int  # tokens of one prefill batch
    cuda_graph_max_bs: int
    verify: Optional[str] = None  # the verify mode: None, "fail" or "count"

    @property
    def region_rows(self) -> int:
        return self.buffer_size + self.recent_window

    @property
    def warm_units(self) -> bool:
        """An admission is warmed into every slot its units give it: with units,
        one query token and a host pool of its own (docs/ELASTIC_BUFFER.md)."""
        return self.max_units > 1 and self.direct_slots and not self.shares_host_pool

    @property
    def direct_slots(self) -> bool:
        """A context that fits its slots keeps position p in slot p (one query only)."""
        return self.query_tokens == 1

    @classmethod
    def from_server_args(cls, sa, hf_config=None) -> "NSAKVOffloadOptions":
        layout = NSAKVOffloadRankLayout.from_server_args(sa)
        hf_config = hf_config or compat.model_config_of(sa).hf_config
        sa = compat.resolved_args(sa)
        return cls(
            top_k=compat.get_index_topk(hf_config),
            buffer_size=sa.nsa_kv_offload_gpu_buffer_size,
            recent_window=sa.nsa_kv_offload_recent_window,
            max_units=sa.nsa_kv_offload_max_units,
            host_pool_gb=sa.nsa_kv_offload_host_pool_gb,
            query_tokens=_query_tokens(sa),
            kv_arrives_in_host=sa.disaggregation_mode == "decode",
            shares_host_pool=layout.attn_tp_size > 1,
            prefill_budget=max(sa.chunked_prefill_size or 0, sa.max_prefill_tokens),
            cuda_graph_max_bs=compat.decode_cuda_graph_max_bs(sa),
            verify=sa.nsa_kv_offload_verify,
        )


def nsa_kv_offload_backend_declarations(
    view, user_set_prefill: bool, user_set_decode: bool, kv_cache_dtype: str
) -> Optional[dict]:
    """``{field: backend}`` for the backend flags left unset; None (sglang's
    defaults) with the offload off or a KV dtype it refuses (and says why)."""
    decode = _DECODE_BACKENDS_BY_DTYPE.get(kv_cache_dtype)
    if not view.enable_decode_nsa_kv_offload or decode is None:
        return None
    declared = {}
    if not user_set_prefill:
        declared[compat.PREFILL_BACKEND_FIELD] = _PREFILL_BACKENDS[0]
    if not user_set_decode:
        declared[compat.DECODE_BACKEND_FIELD] = decode
    return declared


def handle_decode_nsa_kv_offload(server_args) -> None:
    """Resolve the --nsa-kv-offload-* defaults and validate the combination."""
    sa, cfg = server_args, compat.resolved_view(server_args)
    if not cfg.enable_decode_nsa_kv_offload:
        if cfg.nsa_kv_offload_verify is not None:
            _fail("--nsa-kv-offload-verify needs --enable-decode-nsa-kv-offload.")
        return
    model_config = compat.model_config_of(sa)
    if not compat.is_deepseek_sparse(model_config.hf_config):
        archs = getattr(model_config.hf_config, "architectures", None)
        _fail(
            "only DSA/NSA models (e.g. DeepSeek-V3.2, GLM-5) are supported, "
            f"but --model-path {cfg.model_path} is {archs}."
        )
    index_topk = compat.get_index_topk(model_config.hf_config)
    if getattr(model_config.hf_config, "index_kpool", 1) != 1:  # (0.5.23)
        _fail("models whose indexer pools keys (index_kpool > 1) are not supported.")
    _check_server_mode(cfg)
    layout = NSAKVOffloadRankLayout.from_server_args(cfg)
    _check_parallelism(cfg, layout)
    _check_backends(cfg)
    if cfg.nsa_kv_offload_verify not in (None,) + VERIFY_MODES:
        _fail(
            f"--nsa-kv-offload-verify {cfg.nsa_kv_offload_verify!r}: expected one of "
            f"{', '.join(VERIFY_MODES)}."
        )

    if cfg.nsa_kv_offload_gpu_buffer_size is None:
        # One top-k more than the union of a step's query tokens can need.
        q = _query_tokens(cfg) or 1
        compat.declare(sa, nsa_kv_offload_gpu_buffer_size=(q + 1) * index_topk)
    buffer_size = cfg.nsa_kv_offload_gpu_buffer_size
    window = cfg.nsa_kv_offload_recent_window
    if buffer_size < index_topk:
        _fail(
            f"--nsa-kv-offload-gpu-buffer-size ({buffer_size}) must be at least the "
            f"model's index_topk ({index_topk})."
        )
    if buffer_size > _MAX_BUFFER_SIZE:
        _fail(
            f"--nsa-kv-offload-gpu-buffer-size ({buffer_size}) must be at most "
            f"{_MAX_BUFFER_SIZE}."
        )
    if window < 1:
        _fail(f"--nsa-kv-offload-recent-window ({window}) must be at least 1.")
    if window >= buffer_size:
        _fail(
            f"--nsa-kv-offload-recent-window ({window}) must be smaller than "
            f"--nsa-kv-offload-gpu-buffer-size ({buffer_size})."
        )
    check_nsa_kv_offload_speculative(cfg, index_topk)
    units = cfg.nsa_kv_offload_max_units
    if units is None:
        units = units_for_context(model_config.context_len, buffer_size, window)
        compat.declare(sa, nsa_kv_offload_max_units=units)
    elif units < 1:
        _fail(f"--nsa-kv-offload-max-units ({units}) must be at least 1.")

    pinnable_gb = pinnable_host_memory_gb(layout.host_pools_per_node)
    host_pool_gb = cfg.nsa_kv_offload_host_pool_gb
    if host_pool_gb is None:
        if pinnable_gb <= 0:
            _fail(
                "no host memory is left to pin after the reserve; set "
                "--nsa-kv-offload-host-pool-gb explicitly."
            )
        compat.declare(sa, nsa_kv_offload_host_pool_gb=round(pinnable_gb, 2))
    elif host_pool_gb <= 0:
        _fail(f"--nsa-kv-offload-host-pool-gb ({host_pool_gb}) must be positive.")
    elif host_pool_gb > pinnable_gb:
        _fail(
            f"--nsa-kv-offload-host-pool-gb ({host_pool_gb}) is larger than the host "
            f"memory one host pool can pin ({pinnable_gb:.2f} GB: available RAM minus "
            f"a reserve, split over the {layout.host_pools_per_node} host pool(s) of "
            "this node)."
        )


def _check_server_mode(sa) -> None:
    if sa.disaggregation_mode == "prefill":
        _fail(
            "it is a decode-side feature and cannot be used with --disaggregation-mode prefill."
        )
    if sa.disaggregation_mode == "decode":
        if sa.disaggregation_decode_enable_radix_cache:
            _fail("--disaggregation-decode-enable-radix-cache is not supported.")
        if sa.disaggregation_decode_enable_offload_kvcache:
            _fail(
                "--disaggregation-decode-enable-offload-kvcache is not supported (the "
                "offload already keeps every request's KV in host memory)."
            )
    if sa.enable_hisparse:
        _fail("it cannot be combined with --enable-hisparse; pick one of the two.")
    if not sa.disable_radix_cache:
        _fail("it requires --disable-radix-cache.")
    # Also what keeps KV in pools or transfers the offload does not see.
    for field in _REFUSED_FLAGS:
        if getattr(sa, field, False):
            _fail(f"{_flag(field)} is not supported.")
    if (getattr(sa, "dcp_size", 1) or 1) > 1:
        _fail(
            f"decode context parallelism (--dcp-size {sa.dcp_size}) is not supported."
        )
    if getattr(sa, "disaggregation_decode_retraction_backup", None) == "host_pool":
        _fail("--disaggregation-decode-retraction-backup host_pool is not supported.")
    if sa.page_size != NSA_KV_OFFLOAD_PAGE_SIZE:
        _fail(
            f"it requires --page-size {NSA_KV_OFFLOAD_PAGE_SIZE} (the NSA indexer "
            f"page), but got --page-size {sa.page_size}."
        )


def _check_backends(sa) -> None:
    expected = _DECODE_BACKENDS_BY_DTYPE.get(sa.kv_cache_dtype)
    if expected is None:
        _fail(
            "it supports --kv-cache-dtype fp8_e4m3 or bfloat16, but got "
            f"--kv-cache-dtype {sa.kv_cache_dtype}."
        )
    decode, prefill = compat.DECODE_BACKEND_FIELD, compat.PREFILL_BACKEND_FIELD
    if getattr(sa, decode) != expected:
        _fail(
            f"with --kv-cache-dtype {sa.kv_cache_dtype} it requires {_flag(decode)} "
            f"{expected}, but got {_flag(decode)} {getattr(sa, decode)}."
        )
    if getattr(sa, prefill) not in _PREFILL_BACKENDS:
        _fail(
            f"it requires {_flag(prefill)} {' or '.join(_PREFILL_BACKENDS)} (the "
            "prefill path that reads KV through the offload's staging rows), but got "
            f"{_flag(prefill)} {getattr(sa, prefill)}."
        )


def check_nsa_kv_offload_speculative(sa, index_topk: int) -> int:
    """Refuse the speculative decoding the multi-token swap does not serve
    (docs/MTP.md, "Startup"); returns the query tokens per request (1: none)."""
    algorithm = sa.speculative_algorithm
    if algorithm is None:
        return 1
    if algorithm.upper() not in _SPECULATIVE_ALGORITHMS:
        _fail(
            f"--speculative-algorithm {algorithm} is not supported; only EAGLE / NEXTN MTP is."
        )
    if sa.tp_size > 1 or compat.attn_dp_size(sa) > 1:
        # DP attention would also pad verify's top-k rows.
        _fail(
            f"--speculative-algorithm {algorithm} is not supported with --tp-size > 1 "
            "or --enable-dp-attention yet."
        )
    if sa.speculative_eagle_topk != 1:
        _fail(
            f"--speculative-eagle-topk {sa.speculative_eagle_topk} is not supported; "
            "only 1 (one draft chain) is."
        )
    steps = sa.speculative_num_steps
    if steps is None or not 1 <= steps <= _MAX_SPECULATIVE_STEPS:
        _fail(
            f"--speculative-num-steps {steps} is not supported; 1 to "
            f"{_MAX_SPECULATIVE_STEPS} are."
        )
    q = sa.speculative_num_draft_tokens
    if q != steps + 1:
        _fail(
            f"--speculative-num-draft-tokens ({q}) must be --speculative-num-steps + 1 "
            f"({steps + 1}) with --speculative-eagle-topk 1."
        )
    for field in ("speculative_adaptive", "enable_multi_layer_eagle"):
        if getattr(sa, field):
            _fail(
                f"{_flag(field)} is not supported with --speculative-algorithm {algorithm}."
            )
    if not sa.disable_overlap_schedule:
        if sa.disaggregation_mode == "decode":
            # The transfer may write host slots a forward still writes back.
            _fail(
                "speculative decoding with the overlap scheduler on a PD decode "
                "server (--disaggregation-mode decode) is not supported; pass "
                "--disable-overlap-schedule."
            )
        if envs.SGLANG_ENABLE_OVERLAP_PLAN_STREAM.get():
            _fail(
                "SGLANG_ENABLE_OVERLAP_PLAN_STREAM=1 (the overlap scheduler's plan "
                "stream) is not supported; unset it or pass --disable-overlap-schedule."
            )
    if sa.nsa_kv_offload_gpu_buffer_size < q * index_topk:
        # A verify step keeps the union of its query tokens' top-k resident.
        _fail(
            f"--nsa-kv-offload-gpu-buffer-size ({sa.nsa_kv_offload_gpu_buffer_size}) "
            f"must be at least --speculative-num-draft-tokens ({q}) x the model's "
            f"index_topk ({index_topk}) = {q * index_topk}."
        )
    if sa.nsa_kv_offload_recent_window < 2 * q - 1:
        # Swaps read the newest window - (q - 1) positions from the ring.
        _fail(
            f"--nsa-kv-offload-recent-window ({sa.nsa_kv_offload_recent_window}) must "
            f"be at least 2 x --speculative-num-draft-tokens - 1 ({2 * q - 1})."
        )
    return q


def _check_parallelism(sa, layout: NSAKVOffloadRankLayout) -> None:
    """Refuse the parallel layouts the offload cannot run or has not run on GPUs."""
    attn_dp = compat.attn_dp_size(sa)
    dpa = attn_dp > 1
    tp, dp = sa.tp_size, attn_dp if dpa else sa.dp_size
    if sa.pp_size > 1:
        _fail(f"pipeline parallelism (--pp-size {sa.pp_size}) is not supported.")
    if sa.attn_cp_size > 1 or getattr(sa, compat.PREFILL_CP_FIELD):
        _fail(
            f"attention context parallelism (--attn-cp-size {sa.attn_cp_size}, "
            f"{_flag(compat.PREFILL_CP_FIELD)}) is not supported."
        )
    if dpa and dp != tp:
        _fail(
            f"--enable-dp-attention with --dp-size {dp} smaller than --tp-size {tp} "
            f"(attention TP of {tp // max(dp, 1)} GPUs inside each DP group) is not "
            f"supported; use --dp-size {tp}."
        )
    if layout.attn_tp_size > 1:
        if layout.attn_tp_spans_nodes:
            _fail(
                f"tensor parallelism across nodes (--tp-size {tp} over --nnodes "
                f"{sa.nnodes}) is not supported: an attention-TP group shares one "
                "host pool, so it must be on one node."
            )
        if sa.disaggregation_mode == "decode":
            _fail(
                f"tensor parallelism (--tp-size {tp}) on a PD decode server is not "
                "supported: the KV transfer writes every rank's copy, while an "
                "attention-TP group shares one host pool with one writer."
            )
    if not (dpa or layout.attn_tp_size > 1):
        return
    if envs.SGLANG_NSA_KV_OFFLOAD_UNPROVEN_PARALLEL.get():
        logger.warning(
            "Decode NSA KV offload: SGLANG_NSA_KV_OFFLOAD_UNPROVEN_PARALLEL=1, starting "
            f"a layout not yet run on GPUs (--tp-size {tp}, --dp-size {dp}, "
            f"--enable-dp-attention {dpa})."
        )
        return
    what = f"tensor parallelism (--tp-size {tp})"
    if dpa:
        what = f"DP attention (--enable-dp-attention --dp-size {dp})"
    _fail(
        f"{what} has not run on GPUs yet (tested on CPU only); "
        "SGLANG_NSA_KV_OFFLOAD_UNPROVEN_PARALLEL=1 lets it start, for the GPU runs "
        "that prove it (docs/MULTI_GPU.md)."
    )
