"""The LRU swap kernels compiled for the H200 (sm_90) on this CPU machine
(``benchmark/nsa_offload/engine/kernel_resources.py``): every kernel compiles, and
the ones that keep a request's LRU walk in registers do not spill."""

import json
import os
import subprocess
import sys
import unittest
from pathlib import Path

import triton

HERE = Path(__file__).resolve().parent
SCRIPT = (
    HERE.parents[1] / "benchmark" / "nsa_offload" / "engine" / "kernel_resources.py"
)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

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
    def test_compiled_for_sm90_without_spills(self):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        code = RUN.format(here=str(HERE), script=str(SCRIPT), args=["--units", "1,4"])
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        rows = {
            (r["units"], r["kernel"]): r
            for r in map(json.loads, out.stdout.splitlines())
        }
        kernels = ("fused", "select", "count", "reorder_rank", "copy_order")
        # Each also with the direct-slots path compiled in (DIRECT=True).
        expected = {(1, k) for k in ("fused", "fused_direct")} | {
            (4, k + suffix) for k in kernels for suffix in ("", "_direct")
        }
        # CLOCK's one kernel (SGLANG_NSA_KV_OFFLOAD_POLICY=clock), any units.
        expected |= {(1, "clock"), (4, "clock")}
        self.assertEqual(set(rows), expected)
        # One unit: the fused kernel holds the 4096-entry walk in registers
        # (112, no stack, with Triton 3.6 as on the H200 stack). With units the
        # split kernels run instead: the fused one spills there (part of why
        # it took 50 us per layer at 4 units on the H200).
        no_spill = [k for k in expected if k[0] == 1 or not k[1].startswith("fused")]
        for key in no_spill:
            self.assertEqual(rows[key]["stack_bytes"], 0, rows[key])
            self.assertLessEqual(rows[key]["registers"], _fits_sm(rows[key]), rows[key])
        self.assertGreater(rows[(4, "fused")]["stack_bytes"], 0)

    def _resources(self, *args):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        code = RUN.format(here=str(HERE), script=str(SCRIPT), args=list(args))
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
        rows = self._resources("--units", "40", "--served")
        names = {r["kernel"] for r in rows}
        expected = {"select", "count", "reorder_rank", "copy_order"}
        direct = {k + "_direct" for k in expected}
        self.assertEqual(names, expected | direct | {"clock"})
        for row in rows:
            self.assertEqual(row["units"], 40)
            self.assertEqual(row["stack_bytes"], 0, row)
            self.assertLessEqual(row["registers"], _fits_sm(row), row)

    def test_multi_token_kernels_without_spills(self):
        # MTP target verify (docs/MTP.md) at DeepSeek-V3.2's top-k: 2 query
        # tokens fit C = 4096 (the fused kernel), 4 need C = 8192 (split
        # kernels: the fused walk of 8192 slots spills).
        fused = self._resources("--units", "1", "--query-tokens", "2")
        split = self._resources(
            "--units", "1,3", "--query-tokens", "4", "--buffer-size", "8192"
        )
        self.assertEqual([r["kernel"] for r in fused], ["multi_fused"])
        kernels = {(r["units"], r["kernel"]) for r in split}
        self.assertEqual(
            kernels,
            {
                (u, k)
                for u in (1, 3)
                for k in ("multi_classify", "count", "rank", "multi_assign")
            },
        )
        for row in fused + split:
            self.assertEqual(row["stack_bytes"], 0, row)
            self.assertLessEqual(row["registers"], _fits_sm(row), row)


if __name__ == "__main__":
    unittest.main()
