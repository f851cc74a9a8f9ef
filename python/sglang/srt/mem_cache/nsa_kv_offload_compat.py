"""The upstream names that differ between the sglang releases the offload
supports (0.5.12.post1, 0.5.17): the one module that knows them.

Every other offload module imports these names from here. 0.5.17 renamed
NSA to DSA (the pool, the model-config helpers, the backend flags), moved
the attention-TP group to ``parallel_state`` and the CUDA-graph batch cap to
``cuda_graph_max_bs_decode``.
"""

from sglang.srt.configs import model_config as _model_config
from sglang.srt.mem_cache import memory_pool as _memory_pool

IS_DSA_NAMING = hasattr(_memory_pool, "DSATokenToKVPool")

if IS_DSA_NAMING:
    SparseTokenToKVPool = _memory_pool.DSATokenToKVPool
    get_index_topk = _model_config.get_dsa_index_topk
    get_index_head_dim = _model_config.get_dsa_index_head_dim
    is_deepseek_sparse = _model_config.is_deepseek_dsa
    DECODE_BACKEND_FIELD = "dsa_decode_backend"
    PREFILL_BACKEND_FIELD = "dsa_prefill_backend"
    CUDA_GRAPH_MAX_BS_FIELD = "cuda_graph_max_bs_decode"
else:
    SparseTokenToKVPool = _memory_pool.NSATokenToKVPool
    get_index_topk = _model_config.get_nsa_index_topk
    get_index_head_dim = _model_config.get_nsa_index_head_dim
    is_deepseek_sparse = _model_config.is_deepseek_nsa
    DECODE_BACKEND_FIELD = "nsa_decode_backend"
    PREFILL_BACKEND_FIELD = "nsa_prefill_backend"
    CUDA_GRAPH_MAX_BS_FIELD = "cuda_graph_max_bs"


def get_attention_tp_group():
    """The attention tensor-parallel group of this rank."""
    if IS_DSA_NAMING:
        from sglang.srt.distributed.parallel_state import get_attn_tp_group

        return get_attn_tp_group()
    from sglang.srt.layers.dp_attention import get_attention_tp_group as get_group

    return get_group()


# Server args: 0.5.17 declares resolvable fields until __post_init__ ends (read
# through resolved_view), names --enable-prefill-cp, resolves cuda_graph_config.
if IS_DSA_NAMING:
    from sglang.srt.arg_groups.overrides import resolved_view

    PREFILL_CP_FIELD = "enable_prefill_cp"
else:

    def resolved_view(server_args):
        return server_args

    PREFILL_CP_FIELD = "enable_nsa_prefill_context_parallel"


if IS_DSA_NAMING:
    from sglang.srt.model_executor.forward_context import get_attn_backend

    def forward_attn_backend(forward_batch):
        """The attention backend of the forward (0.5.17: its forward context's)."""
        return get_attn_backend()

else:

    def forward_attn_backend(forward_batch):
        """The attention backend of the forward (0.5.12: ``forward_batch``'s)."""
        return forward_batch.attn_backend


# ---- Pools. 0.5.17 builds them in a KVCacheConfigurator, sizes a token by its real
# MLA KV row (0.5.12: kv_lora_rank + qk_rope_head_dim), frees pages only through
# ``_release_page_ids`` and may pass writes a ``KVWriteLoc``.
POOL_SIZING_COUNTS_REAL_ROW = IS_DSA_NAMING
FREES_THROUGH_PAGE_IDS = IS_DSA_NAMING


def pool_builder_layout(builder):
    """``(KV layers, MLA KV row dim, attention-DP size)`` of the pools'
    builder: a KVCacheConfigurator (0.5.17) or the ModelRunner (0.5.12)."""
    if not hasattr(builder, "layer_info"):
        dim = builder.calculate_mla_kv_cache_dim()
        return builder.num_effective_layers, dim, builder.dp_size
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim

    dim = calculate_mla_kv_cache_dim(
        model_config=builder.model_config,
        kv_cache_dtype=builder.kv_cache_dtype,
        server_args=builder.server_args,
    )
    return builder.layer_info.num_effective_layers, dim, builder.ps.attn_dp_size


def write_locs(loc_info):
    """The token locs of a KV write (a ``KVWriteLoc`` on 0.5.17, or plain)."""
    return getattr(loc_info, "loc", loc_info)


def decode_cuda_graph_max_bs(server_args) -> int:
    """The largest decode batch captured in a CUDA graph (0: none), as 0.5.17
    resolves it into ``cuda_graph_config`` (0.5.12: the flags)."""
    sa, config = server_args, getattr(server_args, "cuda_graph_config", None)
    if config is None:
        return 0 if sa.disable_cuda_graph else getattr(sa, CUDA_GRAPH_MAX_BS_FIELD) or 0
    return 0 if config.decode.backend == "disabled" else config.decode.max_bs or 0
