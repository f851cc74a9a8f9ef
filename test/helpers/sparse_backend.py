"""The sglang sparse-attention backend the CPU tests drive:
``dsa_backend.DeepseekSparseAttnBackend`` (``dsa_*`` impl fields,
``use_fused_topk``), the forward's backend in the forward context.
"""

import contextlib

from sglang.srt.layers.attention import dsa_backend as backend_module
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

SparseAttnBackend = backend_module.DeepseekSparseAttnBackend
TopkTransformMethod = backend_module.TopkTransformMethod
# The backend's per-phase impl fields: f"{IMPL}_decode_impl", f"{IMPL}_prefill_impl".
IMPL = "dsa"


@contextlib.contextmanager
def forward_backend(backend):
    """``backend`` is the running forward's attention backend (what the model's
    early-swap hook looks up): the forward context's."""
    with forward_context(ForwardContext(attn_backend=backend)):
        yield
