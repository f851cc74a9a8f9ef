"""Test-only shims that let the installed sglang be imported on a CPU-only machine.

Two obstacles (see "CPU test environment" in the design notes):

* PyPI's torchvision wheel is a CUDA build. Beside a CPU torch its C extension
  fails to load and ``import torchvision`` dies with
  ``operator torchvision::nms does not exist`` (its meta registrations need the
  op schemas). :func:`install_torchvision_shim` defines the schemas with
  ``torch.library`` when, and only when, the extension cannot be loaded.

* ``sgl_kernel`` binaries need CUDA. sglang imports a few of its submodules at
  module level. :func:`install_sgl_kernel_shim` adds a meta path finder that,
  when the real ``sgl_kernel`` cannot be imported, serves stub modules for
  exactly those submodules (their functions raise when called) and raises
  ``ImportError`` for every other ``sgl_kernel`` module, so that sglang's own
  fallbacks behave as on a machine without the kernels.

Product code must never rely on these shims: they are installed by
``test/conftest.py`` only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
import unittest
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO_ROOT = Path(__file__).resolve().parents[2]
SGL_KERNEL = "sgl_kernel"

# Submodules of sgl_kernel that the sglang modules under test import at module
# level, unguarded, on a non-NPU/XPU/MPS machine, with the names they import.
# Everything else under sgl_kernel raises ImportError (sglang guards those
# imports or imports them lazily inside CUDA-only code paths).
# Found by importing the modules listed in STUBBED_FOR with the shim's
# ``SGLANG_CPU_SHIM_TRACE=1`` tracing on (see ``trace`` below).
# sglang 0.5.17 imports none of them unguarded (memory_pool_host only on CUDA).
SGL_KERNEL_STUBS: Dict[str, Tuple[str, ...]] = {}

# The sglang modules whose imports the stub list above was derived from; the
# smoke test imports each of them under the shim.
STUBBED_FOR: Tuple[str, ...] = (
    "sglang.srt.server_args",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.layers.attention.dsa_backend",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.configs.model_config",
)

# Every sgl_kernel module name that was asked for (for tracing and tests).
requested: List[str] = []


class SglKernelStubError(RuntimeError):
    """Raised when a stubbed sgl_kernel function is called on a CPU machine."""


def _make_stub_function(qualname: str):
    def _stub(*args, **kwargs):
        raise SglKernelStubError(
            f"{qualname} is a CPU-test stub of a CUDA kernel; "
            "it cannot run on this machine"
        )

    _stub.__name__ = qualname.rsplit(".", 1)[-1]
    _stub.__qualname__ = _stub.__name__
    _stub.__module__ = qualname.rsplit(".", 1)[0]
    _stub._sgl_kernel_cpu_stub = True
    return _stub


class _StubLoader(importlib.abc.Loader):
    def __init__(self, names: Tuple[str, ...], is_package: bool):
        self._names = names
        self._is_package = is_package

    def create_module(self, spec):
        return None  # default module creation

    def exec_module(self, module: types.ModuleType) -> None:
        module.__sgl_kernel_cpu_stub__ = True
        if self._is_package:
            module.__path__ = []
        for name in self._names:
            setattr(module, name, _make_stub_function(f"{module.__name__}.{name}"))


class SglKernelStubFinder(importlib.abc.MetaPathFinder):
    """Serves stub ``sgl_kernel`` modules when the real package is unusable."""

    def __init__(self, stubs: Optional[Dict[str, Tuple[str, ...]]] = None):
        self.stubs = dict(SGL_KERNEL_STUBS if stubs is None else stubs)
        self.trace = os.environ.get("SGLANG_CPU_SHIM_TRACE") == "1"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != SGL_KERNEL and not fullname.startswith(SGL_KERNEL + "."):
            return None
        requested.append(fullname)
        if self.trace:
            import traceback

            caller = "".join(traceback.format_stack(limit=12)[:-1])
            sys.stderr.write(f"[cpu_shims] import {fullname}\n{caller}\n")
        if fullname == SGL_KERNEL:
            loader = _StubLoader((), is_package=True)
            return importlib.machinery.ModuleSpec(fullname, loader, is_package=True)
        if fullname in self.stubs:
            loader = _StubLoader(self.stubs[fullname], is_package=False)
            return importlib.machinery.ModuleSpec(fullname, loader)
        raise ImportError(
            f"No module named {fullname!r} (sgl_kernel is stubbed on this "
            "CPU-only test machine)",
            name=fullname,
        )


def real_sgl_kernel_available() -> bool:
    """True when the real sgl_kernel imports (CUDA machine with the wheel)."""
    if any(isinstance(f, SglKernelStubFinder) for f in sys.meta_path):
        raise RuntimeError("call before install_sgl_kernel_shim()")
    if importlib.util.find_spec(SGL_KERNEL) is None:
        return False
    try:
        import sgl_kernel  # noqa: F401
    except Exception:
        for name in list(sys.modules):
            if name == SGL_KERNEL or name.startswith(SGL_KERNEL + "."):
                del sys.modules[name]
        return False
    return True


def install_sgl_kernel_shim() -> bool:
    """Install the stub finder unless the real sgl_kernel works.

    Returns True when the shim was installed (now or before).
    """
    if any(isinstance(f, SglKernelStubFinder) for f in sys.meta_path):
        return True
    if real_sgl_kernel_available():
        return False
    sys.meta_path.insert(0, SglKernelStubFinder())
    return True


def is_sgl_kernel_stub(module: types.ModuleType) -> bool:
    return bool(getattr(module, "__sgl_kernel_cpu_stub__", False))


def install_torchvision_shim() -> bool:
    """Define the torchvision op schemas when its C extension cannot load.

    Must run before torchvision is imported. Returns True when the schemas
    were defined here. The same fix-up the CPU venv applies at torchvision's
    first import (``scripts/cpu_env/nsa_kv_offload_cpu_env.py``, installed by
    ``scripts/setup_cpu_env.sh``), run eagerly.
    """
    if "torchvision" in sys.modules:
        return False
    return _cpu_env_module().define_torchvision_schemas()


def _cpu_env_module():
    path = REPO_ROOT / "scripts" / "cpu_env" / "nsa_kv_offload_cpu_env.py"
    spec = importlib.util.spec_from_file_location("_nsa_kv_offload_cpu_env", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torch_op_exists(namespace: str, name: str) -> bool:
    import torch

    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# For unittest-style tests (pytest tests can use @pytest.mark.requires_cuda).
requires_cuda = unittest.skipUnless(cuda_available(), "requires a CUDA device")


def stamp_one_gpu_layout() -> None:
    """sglang 0.5.23 reads the parallel layout from its runtime context, which
    nothing publishes in a CPU test: every configured leaf at its default (one
    GPU), the derived widths 1 and the ranks 0 (after sglang can be imported)."""
    try:
        from sglang.srt.arg_groups.fields.parallel import Parallel
        from sglang.srt.runtime_context import get_parallel
    except ImportError:
        return
    defaults = Parallel()
    leaves = {name: getattr(defaults, name) for name in Parallel.__struct_fields__}
    groups = ("tp", "pp", "dp", "attn_tp", "attn_dp", "attn_cp", "attn_dcp")
    leaves.update({f"{name}_size": 1 for name in groups})
    leaves.update({f"{name}_rank": 0 for name in groups})
    get_parallel().override_permanently(**leaves)


def install_all() -> Dict[str, bool]:
    return {
        "torchvision": install_torchvision_shim(),
        "sgl_kernel": install_sgl_kernel_shim(),
    }
