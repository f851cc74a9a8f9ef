"""The upstream names the offload reaches through one module: those that
differ between the sglang releases it supports (0.5.17).

Every other offload module imports these names from here: the sparse pool,
the model-config helpers, the backend and prefill-CP flags, the
attention-TP group, the forward's attention backend, the pool builder.
"""

from sglang.srt.arg_groups.overrides import resolved_view  # noqa: F401
from sglang.srt.configs.model_config import get_dsa_index_head_dim as get_index_head_dim  # noqa: F401
from sglang.srt.configs.model_config import get_dsa_index_topk as get_index_topk
from sglang.srt.configs.model_config import is_deepseek_dsa as is_deepseek_sparse
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool as SparseTokenToKVPool  # noqa: F401
from sglang.srt.model_executor.forward_context import get_attn_backend

DECODE_BACKEND_FIELD = "dsa_decode_backend"
PREFILL_BACKEND_FIELD = "dsa_prefill_backend"
CUDA_GRAPH_MAX_BS_FIELD = "cuda_graph_max_bs_decode"
PREFILL_CP_FIELD = "enable_prefill_cp"


def get_attention_tp_group():
    """The attention tensor-parallel group of this rank."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group

    return get_attn_tp_group()


def forward_attn_backend(forward_batch):
    """The attention backend of the forward: its forward context's."""
    return get_attn_backend()


def pool_builder_layout(builder):
    """``(KV layers, MLA KV row dim, attention-DP size)`` of the pools'
    builder, a KVCacheConfigurator."""
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim

    dim = calculate_mla_kv_cache_dim(
        model_config=builder.model_config,
        kv_cache_dtype=builder.kv_cache_dtype,
        server_args=builder.server_args,
    )
    return builder.layer_info.num_effective_layers, dim, builder.ps.attn_dp_size


def write_locs(loc_info):
    """The token locs of a KV write (a ``KVWriteLoc``, or plain)."""
    return getattr(loc_info, "loc", loc_info)


def decode_cuda_graph_max_bs(server_args) -> int:
    """The largest decode batch captured in a CUDA graph (0: none), as
    resolved into ``cuda_graph_config`` (before that: the flags)."""
    sa, config = server_args, server_args.cuda_graph_config
    if config is None:
        return 0 if sa.disable_cuda_graph else getattr(sa, CUDA_GRAPH_MAX_BS_FIELD) or 0
    return 0 if config.decode.backend == "disabled" else config.decode.max_bs or 0
