"""The upstream names the offload reaches through one module: those that
differ between the sglang releases it supports (0.5.17, 0.5.23).

Every other offload module imports these names from here: the sparse pool,
the model-config helpers, the backend and prefill-CP flags, the pool
builder, and how server args are read and decided.
"""

from importlib.util import find_spec

from sglang.srt.configs import model_config as _model_config
from sglang.srt.mem_cache import memory_pool as _memory_pool

SparseTokenToKVPool = _memory_pool.DSATokenToKVPool
get_index_topk = _model_config.get_dsa_index_topk
get_index_head_dim = _model_config.get_dsa_index_head_dim
is_deepseek_sparse = _model_config.is_deepseek_dsa

DECODE_BACKEND_FIELD = "dsa_decode_backend"
PREFILL_BACKEND_FIELD = "dsa_prefill_backend"
CUDA_GRAPH_MAX_BS_FIELD = "cuda_graph_max_bs_decode"
PREFILL_CP_FIELD = "enable_prefill_cp"

# 0.5.23 resolves server args in a pipeline: ServerArgs keeps the raw input,
# decisions are declared and read through the resolving view (mid-resolution
# and after), the attention-DP width is ``attn_dp_size``.
RESOLUTION_PIPELINE = find_spec("sglang.srt.arg_groups.pipeline") is not None

if RESOLUTION_PIPELINE:
    from sglang.srt.arg_groups.overrides import declare_resolution, model_config_of
    from sglang.srt.arg_groups.overrides import resolving_view as resolved_view

    # Server args as resolved: the record holds the raw input.
    resolved_args = resolved_view

    def declare(server_args, **fields) -> None:
        """Decide fields during resolution (0.5.23: a declaration)."""
        declare_resolution(server_args, "handle_decode_nsa_kv_offload", **fields)

    def attn_dp_size(cfg) -> int:
        return cfg.attn_dp_size

    def req_pool_idx(req):
        """A request's ``req_to_token`` row (0.5.23: on its ``kv`` record)."""
        return req.kv.req_pool_idx

    def kv_committed_len(req) -> int:
        return req.kv.kv_committed_len

    def dp_replicas(cfg) -> int:
        return max(cfg.dp_size, 1)

else:
    from sglang.srt.arg_groups.overrides import resolved_view  # noqa: F401

    def resolved_args(server_args):
        return server_args

    def declare(server_args, **fields) -> None:
        for name, value in fields.items():
            setattr(server_args, name, value)

    def model_config_of(server_args):
        return server_args.get_model_config()

    def attn_dp_size(cfg) -> int:
        return max(cfg.dp_size, 1) if cfg.enable_dp_attention else 1

    def req_pool_idx(req):
        return req.req_pool_idx

    def kv_committed_len(req) -> int:
        return req.kv_committed_len

    def dp_replicas(cfg) -> int:
        return 1 if cfg.enable_dp_attention else max(cfg.dp_size, 1)


def pool_builder_layout(builder):
    """``(KV layers, MLA KV row dim, attention-DP size)`` of the pools'
    builder, a KVCacheConfigurator (0.5.23: no server args to the row dim)."""
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim

    kw = dict(model_config=builder.model_config, kv_cache_dtype=builder.kv_cache_dtype)
    if RESOLUTION_PIPELINE:
        dp = builder.attn_dp_size
    else:
        kw["server_args"], dp = builder.server_args, builder.ps.attn_dp_size
    return builder.layer_info.num_effective_layers, calculate_mla_kv_cache_dim(**kw), dp


def write_locs(loc_info):
    """The token locs of a KV write (a ``KVWriteLoc``, or plain)."""
    return getattr(loc_info, "loc", loc_info)


def decode_cuda_graph_max_bs(server_args) -> int:
    """The largest decode batch captured in a CUDA graph (0: none), as
    resolved into ``cuda_graph_config`` (before that: the flags)."""
    sa = resolved_args(server_args)
    config = sa.cuda_graph_config
    if config is None:
        return 0 if sa.disable_cuda_graph else getattr(sa, CUDA_GRAPH_MAX_BS_FIELD) or 0
    return 0 if config.decode.backend == "disabled" else config.decode.max_bs or 0
