"""The sglang sparse-attention backend the CPU tests drive, by release.

0.5.12.post1: ``nsa_backend.NativeSparseAttnBackend`` (``nsa_*`` impl
fields), the forward's backend on ``ForwardBatch.attn_backend``. 0.5.17:
``dsa_backend.DeepseekSparseAttnBackend`` (``dsa_*`` fields, ``use_fused_topk``),
the forward's backend in the forward context (``ForwardBatch.attn_backend``
is gone; its ``nsa_backend`` shim no longer imports).
"""

import contextlib

from sglang.srt.mem_cache.nsa_kv_offload_compat import IS_DSA_NAMING

if IS_DSA_NAMING:
    from sglang.srt.layers.attention import dsa_backend as backend_module

    SparseAttnBackend = backend_module.DeepseekSparseAttnBackend
else:
    from sglang.srt.layers.attention import nsa_backend as backend_module

    SparseAttnBackend = backend_module.NativeSparseAttnBackend

TopkTransformMethod = backend_module.TopkTransformMethod
# The backend's per-phase impl fields: f"{IMPL}_decode_impl", f"{IMPL}_prefill_impl".
IMPL = "dsa" if IS_DSA_NAMING else "nsa"


@contextlib.contextmanager
def forward_backend(backend):
    """``backend`` is the running forward's attention backend (what the model's
    early-swap hook looks up): 0.5.17's forward context; on 0.5.12 the hook
    reads ``forward_batch.attn_backend``, which the test sets itself."""
    if not IS_DSA_NAMING:
        yield
        return
    from sglang.srt.model_executor.forward_context import (
        ForwardContext,
        forward_context,
    )

    with forward_context(ForwardContext(attn_backend=backend)):
        yield
