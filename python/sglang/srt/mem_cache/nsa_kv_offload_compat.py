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


def cuda_graph_max_bs(server_args) -> int:
    """The resolved decode CUDA-graph batch cap (0: none or not resolved yet)."""
    if IS_DSA_NAMING:
        graphs = server_args.cuda_graph_config  # None until __post_init__ parses it
        return (graphs.decode.max_bs or 0) if graphs else 0
    return server_args.cuda_graph_max_bs or 0


def forward_attn_backend(forward_batch):
    """The attention backend of ``forward_batch`` (0.5.17: the forward context's)."""
    if not IS_DSA_NAMING:
        return forward_batch.attn_backend
    from sglang.srt.model_executor.forward_context import get_attn_backend

    return get_attn_backend()
