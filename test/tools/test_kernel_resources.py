"""The LRU swap kernels compiled for the H200 (sm_90) on this CPU machine
(``benchmark/nsa_offload/engine/kernel_resources.py``): every kernel compiles
without spills."""

import json
import os
import subprocess
import sys
import unittest
from pathlib import Path

import pytest
import triton

HERE = Path(__file__).resolve().parent
SCRIPT = (
    HERE.parents[1] / "benchmark" / "nsa_offload" / "engine" / "kernel_resources.py"
)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
HELPERS = HERE.parent / "helpers"  # cpu_shims

# The CPU shims (torchvision op schemas etc.) before sglang is imported, and
# no interpreter: the kernels must be JIT functions to compile.
RUN = (
    "import sys; sys.path.insert(0, {here!r}); import cpu_shims; "
    "cpu_shims.install_all(); sys.argv = [{script!r}] + {args!r}; "
    "import runpy; runpy.run_path({script!r}, run_name='__main__')"
)


def _fits_sm(row) -> int:
    """The most registers per thread with which one program of the kernel's
    warps fits an SM's 64K registers (128 at 16 warps, 255 at 8)."""
    return min(255, 65536 // (32 * row["num_warps"]))


@unittest.skipUnless(CUOBJDUMP.exists(), "triton without its NVIDIA backend tools")
class TestSwapKernelResources(unittest.TestCase):
    @pytest.mark.full  # ~7-14 s of compiling; the served default runs always
    def test_compiled_for_sm90_without_spills(self):
        rows = {(r["units"], r["kernel"]): r for r in self._resources("--units", "1,4")}
        kernels = ("select", "count", "reorder_rank", "copy_order")
        # Each also with the direct-slots path compiled in (DIRECT=True).
        expected = {
            (u, k + suffix)
            for u in (1, 4)
            for k in kernels
            for suffix in ("", "_direct")
        }
        self.assertEqual(set(rows), expected)
        for key in expected:
            self.assertEqual(rows[key]["stack_bytes"], 0, rows[key])
            self.assertLessEqual(rows[key]["registers"], _fits_sm(rows[key]), rows[key])

    def _resources(self, *args):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        code = RUN.format(here=str(HELPERS), script=str(SCRIPT), args=list(args))
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        return [json.loads(line) for line in out.stdout.splitlines()]

    def test_default_units_without_spills(self):
        # The server's default units since f418aa2 (DeepSeek-V3.2's context
        # at 4,096 rows: 40), the kernels it launches with them.
        rows = self._resources("--units", "40")
        names = {r["kernel"] for r in rows}
        expected = {"select", "count", "reorder_rank", "copy_order"}
        direct = {k + "_direct" for k in expected}
        self.assertEqual(names, expected | direct)
        for row in rows:
            self.assertEqual(row["units"], 40)
            self.assertEqual(row["stack_bytes"], 0, row)
            self.assertLessEqual(row["registers"], _fits_sm(row), row)

    @pytest.mark.full  # ~7-14 s of compiling; the served default runs always
    def test_multi_token_kernels_without_spills(self):
        # MTP target verify (docs/MTP.md) at DeepSeek-V3.2's top-k: 4 query
        # tokens need C = 8192.
        split = self._resources(
            "--units", "1,3", "--query-tokens", "4", "--buffer-size", "8192"
        )
        kernels = {(r["units"], r["kernel"]) for r in split}
        self.assertEqual(
            kernels,
            {
                (u, k)
                for u in (1, 3)
                for k in ("multi_classify", "count", "rank", "multi_assign")
            },
        )
        for row in split:
            self.assertEqual(row["query_tokens"], 4)
            self.assertEqual(row["stack_bytes"], 0, row)
            self.assertLessEqual(row["registers"], _fits_sm(row), row)


if __name__ == "__main__":
    unittest.main()
