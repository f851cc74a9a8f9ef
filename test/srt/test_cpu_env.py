"""Smoke test of the CPU test environment (scripts/setup_cpu_env.sh).

The tests run against the sglang installed in the venv (a supported release:
scripts/apply_patch.py SUPPORTED_VERSIONS) with our patch set of that release
applied (patches/<version>/), never against the files under python/ of this
repo.
"""

import importlib
import importlib.util
import json
import os
import sys
import unittest
from pathlib import Path

import cpu_shims
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
REPO_PYTHON_DIR = REPO_ROOT / "python"
MODULES_DIR = REPO_PYTHON_DIR / "sglang"
MANIFEST_NAME = ".nsa_kv_offload_manifest.json"


def _load_apply_tool():
    path = REPO_ROOT / "scripts" / "apply_patch.py"
    spec = importlib.util.spec_from_file_location("apply_patch", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("apply_patch", module)
    spec.loader.exec_module(module)
    return module


apply_tool = _load_apply_tool()


def _our_module_names():
    names = []
    for rel in sorted(apply_tool.list_modules(MODULES_DIR)):
        if not rel.endswith(".py"):
            continue
        parts = ["sglang"] + list(Path(rel).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


class TestCpuEnv(unittest.TestCase):
    def test_sglang_version(self):
        from sglang.version import __version__

        self.assertIn(__version__, apply_tool.SUPPORTED_VERSIONS)

    def test_torch_is_the_cpu_build(self):
        self.assertTrue(torch.__version__.startswith("2.13.0"), torch.__version__)

    def test_sglang_is_the_installed_package(self):
        import sglang

        location = Path(sglang.__file__).resolve()
        # (the venv itself may live in the repo, as .venv does)
        self.assertNotIn(REPO_PYTHON_DIR, location.parents, location)
        self.assertNotIn(
            str(REPO_PYTHON_DIR), [os.path.abspath(p) for p in sys.path if p]
        )

    def test_patch_set_is_installed(self):
        import sglang

        package_dir = Path(sglang.__file__).resolve().parent
        manifest = json.loads((package_dir / MANIFEST_NAME).read_text())
        version = manifest["sglang_version"]
        self.assertEqual(version, sglang.__version__)
        series = apply_tool.read_series(apply_tool.patches_dir_for(version))
        self.assertEqual(
            [(p["name"], p["sha256"]) for p in manifest["patches"]],
            [(p.name, p.sha256) for p in series],
            "the installed patches are not the repo's: run scripts/test.sh",
        )
        for rel, data in apply_tool.list_modules(MODULES_DIR).items():
            installed = package_dir / rel
            self.assertTrue(installed.is_file(), f"{rel} is not installed")
            self.assertEqual(
                installed.read_bytes(),
                data,
                f"{rel} differs from the repo: run scripts/test.sh",
            )

    def test_our_modules_import_from_the_installed_package(self):
        import sglang

        package_dir = Path(sglang.__file__).resolve().parent
        names = _our_module_names()
        for name in names:
            with self.subTest(module=name):
                module = importlib.import_module(name)
                location = Path(module.__file__).resolve()
                self.assertIn(package_dir, location.parents)
                self.assertNotIn(REPO_PYTHON_DIR, location.parents)

    def test_sglang_modules_import_under_the_shims(self):
        for name in cpu_shims.STUBBED_FOR:
            with self.subTest(module=name):
                importlib.import_module(name)

    def test_triton_interpreter(self):
        import triton
        import triton.language as tl

        if not torch.cuda.is_available():
            self.assertEqual(os.environ.get("TRITON_INTERPRET"), "1")

        @triton.jit
        def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

        device = "cuda" if torch.cuda.is_available() else "cpu"
        x = torch.arange(100, dtype=torch.float32, device=device)
        out = torch.empty_like(x)
        add_one[(triton.cdiv(100, 32),)](x, out, 100, BLOCK=32)
        torch.testing.assert_close(out, x + 1)


@unittest.skipIf(cpu_shims.cuda_available(), "the shims are off on a CUDA machine")
class TestCpuShims(unittest.TestCase):
    def test_stubbed_submodule_imports_and_refuses_to_run(self):
        if not cpu_shims.SGL_KERNEL_STUBS:
            # sglang imports no sgl_kernel module unguarded on CPU.
            with self.assertRaises(ImportError):
                importlib.import_module("sgl_kernel.kvcacheio")
            return
        from sgl_kernel.kvcacheio import transfer_kv_per_layer_mla

        with self.assertRaises(cpu_shims.SglKernelStubError):
            transfer_kv_per_layer_mla()

    def test_other_submodules_raise_import_error(self):
        with self.assertRaises(ImportError):
            importlib.import_module("sgl_kernel.flash_mla")
        with self.assertRaises(ImportError):
            from sgl_kernel import fast_topk_v2  # noqa: F401

    def test_sglang_sees_no_kernels(self):
        from sglang.srt.utils import common

        # 0.5.23 asks lazily (a cached function).
        available = getattr(common, "is_intel_amx_backend_available", None)
        if available is None:
            available = common._is_intel_amx_backend_available()
        self.assertFalse(available)

    def test_torchvision_imports(self):
        import torchvision  # noqa: F401

        self.assertTrue(hasattr(torch.ops.torchvision, "nms"))

    def test_stubs_are_only_what_sglang_imports_at_module_level(self):
        # Every stubbed submodule must have been asked for by the imports of
        # cpu_shims.STUBBED_FOR (a stale stub would hide a real ImportError).
        for name in cpu_shims.STUBBED_FOR:
            importlib.import_module(name)
        requested = set(cpu_shims.requested)
        for name in cpu_shims.SGL_KERNEL_STUBS:
            self.assertIn(name, requested)


if __name__ == "__main__":
    unittest.main()
