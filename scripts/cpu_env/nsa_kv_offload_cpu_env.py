"""CPU venv fix-up, installed into the venv's site-packages by
``scripts/setup_cpu_env.sh`` (with ``nsa_kv_offload_cpu_env.pth``); not part
of the product.

PyPI's torchvision is a CUDA build: beside the CPU torch its import dies with
``operator torchvision::nms does not exist``, and sglang imports it
(``srt/utils/common.py``), so ``import sglang`` fails in the venv. A meta path
finder waits for the first ``import torchvision`` and, if its C extension
cannot register the ops, defines their schemas with ``torch.library`` first
(the trick of the design notes, at venv level). Interpreter start-up stays cheap: nothing is
imported until torchvision is.
"""

import importlib.abc
import importlib.util
import os
import sys


def _op_exists(torch, name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def define_torchvision_schemas() -> bool:
    """Define ``torchvision::nms`` / ``qnms`` when the C extension cannot
    (call before torchvision is imported). True when defined here."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    import torch

    if _op_exists(torch, "nms"):
        return False
    pkg_dir = list(spec.submodule_search_locations)[0]
    for entry in sorted(os.listdir(pkg_dir)):
        if entry.startswith("_C.") and entry.endswith((".so", ".pyd")):
            try:
                torch.ops.load_library(os.path.join(pkg_dir, entry))
            except (OSError, RuntimeError):
                break  # CUDA build beside CPU torch
            if _op_exists(torch, "nms"):
                return False
            break
    # Schemas as in torchvision/csrc/ops/{nms,quantized/qnms}.cpp.
    schema = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
    torch.library.define("torchvision::nms", schema)
    torch.library.define("torchvision::qnms", schema)
    return True


class _TorchvisionSchemaFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            define_torchvision_schemas()
        return None  # the regular finders import it


def install() -> None:
    if "torchvision" in sys.modules:
        return
    if not any(isinstance(f, _TorchvisionSchemaFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionSchemaFinder())


# Installed by the .pth line "import nsa_kv_offload_cpu_env"; test/srt/cpu_shims.py
# loads this file under another name for define_torchvision_schemas() only.
if __name__ == "nsa_kv_offload_cpu_env":
    install()
