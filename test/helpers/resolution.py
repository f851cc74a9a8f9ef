"""Server-args resolution steps the tests run one at a time, by release.

0.5.17 resolves in ``ServerArgs.__post_init__`` (our step is the patched
``_handle_decode_nsa_kv_offload``; its writes land on the record). 0.5.23
resolves in a pipeline over a raw-input record: our step declares its
decisions, which :func:`handle_offload_args` then writes into the record, so
a test reads resolved values as it does on 0.5.17.
"""

from unittest import mock

from sglang.srt.arg_groups import nsa_kv_offload_hook, overrides
from sglang.srt.mem_cache.nsa_kv_offload_compat import RESOLUTION_PIPELINE


def _take_declarations(args) -> None:
    for _source, declared in getattr(args, "_resolved_overrides", None) or ():
        for name, value in declared.items():
            setattr(args, name, value)
    args._resolved_overrides = []


def handle_offload_args(args) -> None:
    """The offload's resolution step on ``args``."""
    if not RESOLUTION_PIPELINE:
        args._handle_decode_nsa_kv_offload()
        return
    from sglang.srt.arg_groups.parallel_hook import handle_deprecated_dp_attention

    try:
        # The pipeline's first step: --enable-dp-attention -> --attn-dp-size.
        handle_deprecated_dp_attention(args)
        nsa_kv_offload_hook.handle_decode_nsa_kv_offload(args)
    finally:
        _take_declarations(args)


def resolve_dsa_backends(args, device_sm: int = 90) -> None:
    """sglang's DSA backend defaults (a declaration pass that asks torch for
    the device) on ``args``, as on a GPU of ``device_sm``."""
    capability = (device_sm // 10, device_sm % 10)
    with mock.patch("torch.cuda.get_device_capability", return_value=capability):
        if not RESOLUTION_PIPELINE:
            args._set_default_dsa_backends(device_sm)
            return
        overrides.run_post_process_pass(args, overrides._dsa_split_backend_resolution)
        _take_declarations(args)
