"""The demo (``benchmark/nsa_offload/demo.py``, the README's first command):
the CPU replay it prints, and the server runs it starts on a GPU host (the
commands and the verdict on an exactness run: the servers need a GPU)."""

import copy
import io
import json
import shutil
import sys
import tempfile
import unittest
from contextlib import redirect_stdout
from pathlib import Path
from unittest import mock

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmark" / "nsa_offload"
sys.path.insert(0, str(BENCH_DIR))

import demo  # noqa: E402

# An exactness.py run on the H200 (tiny checkpoint, batch 1, persistent
# negative control on 64 prompts): 64/64, 64/64; the demo's two servers of it.
GOOD_RUN = BENCH_DIR / "results" / "exactness" / "tiny_run6" / "exactness.json"


def _good_run() -> dict:
    with open(GOOD_RUN) as f:
        run = json.load(f)
    names = (demo.EXACTNESS_BASE, demo.EXACTNESS_OFFLOAD)
    for key in ("servers", "specs", "logs"):
        run[key] = {n: v for n, v in run[key].items() if n in names}
    return run


class TestGpuComparison(unittest.TestCase):
    def setUp(self):
        self.out = Path(tempfile.mkdtemp(prefix="demo_out_"))
        self.addCleanup(shutil.rmtree, self.out, ignore_errors=True)
        (self.out / "exactness").mkdir()
        self.write_run(_good_run())
        _, self.server_utils = demo._import_server_tools()

    def write_run(self, result: dict) -> None:
        with open(self.out / "exactness" / "exactness.json", "w") as f:
            json.dump(result, f)

    def _commands(self, argv, rcs=(0, 0, 0), hooks_missing=None):
        args = demo.parse_args(["--out-dir", str(self.out)] + argv)
        buf = io.StringIO()
        with mock.patch.object(
            self.server_utils, "bench_hooks_missing", return_value=hooks_missing
        ), mock.patch("subprocess.call", side_effect=list(rcs)) as call:
            with redirect_stdout(buf):
                rc = demo.run_gpu_comparison(args)
        self.printed = buf.getvalue()
        return rc, [c.args[0] for c in call.call_args_list]

    def test_exactness_then_colocated_then_pd_decode_at_128k(self):
        rc, cmds = self._commands([])
        self.assertEqual(rc, 0, self.printed)
        self.assertEqual(len(cmds), 3)
        exact, colocated, pd = cmds
        self.assertTrue(exact[1].endswith("exactness.py"))
        self.assertEqual(exact[2:4], ["--out", str(self.out / "exactness")])
        self.assertEqual(exact[exact.index("--model") + 1], "tiny")
        self.assertEqual(exact[exact.index("--servers") + 1], "base_fp8,ours_fp8")
        self.assertEqual(exact[exact.index("--nc-modes") + 1], "persistent")
        self.assertNotIn("--skip-repeat", exact)
        self.assertIn("64/64 prompts identical -> good", self.printed)
        self.assertIn("64/64 outputs changed", self.printed)
        # Capacity only: dummy weights, no outputs compared.
        self.assertTrue(colocated[1].endswith("e2e_server.py"))
        self.assertEqual(colocated[2:4], ["--out", str(self.out / "colocated")])
        self.assertEqual(colocated[colocated.index("--num-requests") + 1], "0")
        self.assertNotIn("--pd-decode", colocated)
        self.assertEqual(pd[2:4], ["--out", str(self.out / "pd_decode_128k")])
        self.assertIn("--pd-decode", pd)
        self.assertEqual(pd[pd.index("--capacity-lengths") + 1], "131072")
        self.assertIn("hisparse", pd[pd.index("--servers") + 1].split(","))

    def test_quick_runs_exactness_and_the_colocated_servers_only(self):
        rc, cmds = self._commands(["--quick"], rcs=(0, 0))
        self.assertEqual(rc, 0, self.printed)
        self.assertEqual(len(cmds), 2)
        self.assertIn("--skip-repeat", cmds[0])
        self.assertNotIn("--pd-decode", cmds[1])

    def test_a_failed_run_fails_the_demo_and_the_next_still_runs(self):
        rc, cmds = self._commands([], rcs=(0, 1, 0))
        self.assertEqual(rc, 1)
        self.assertEqual(len(cmds), 3)

    def test_a_differing_output_fails_the_demo(self):
        run = _good_run()
        run["servers"]["ours_fp8"]["seq"][5][10] += 1
        self.write_run(run)
        rc, cmds = self._commands([])
        self.assertEqual(rc, 1)
        self.assertEqual(len(cmds), 3)
        self.assertIn(
            "63/64 prompts identical (first differing tokens [10]) -> BAD", self.printed
        )

    def test_without_the_bench_hooks_no_negative_control(self):
        rc, cmds = self._commands([], hooks_missing="no hooks here")
        self.assertEqual(rc, 0, self.printed)
        exact = cmds[0]
        nc = [i for i, a in enumerate(exact) if a == "--nc-requests"]
        self.assertEqual(exact[nc[-1] + 1], "0")  # the last flag wins
        self.assertIn("negative control skipped: no hooks here", self.printed)


class TestExactnessVerdict(unittest.TestCase):
    def verdict(self, run, nc_skip_reason=None):
        ok, lines = demo.exactness_verdict(run, nc_skip_reason)
        return ok, "\n".join(lines)

    def test_good_run(self):
        ok, text = self.verdict(_good_run())
        self.assertTrue(ok, text)
        self.assertIn("no-offload server, the same prompts again: 64/64", text)
        self.assertIn("aborted streams: 6/6 identical", text)
        self.assertIn("concurrent (reported only", text)

    def test_a_control_that_changes_nothing_fails(self):
        run = _good_run()
        base = run["servers"]["base_fp8"]
        base["nc_armed_persistent"] = copy.deepcopy(base["nc_clean"])
        ok, text = self.verdict(run)
        self.assertFalse(ok)
        self.assertIn("0/64 outputs changed (need 58", text)
        # Without the hooks the control is not judged.
        self.assertTrue(self.verdict(run, "no hooks")[0])

    def test_a_control_that_changes_the_prefill_token_fails(self):
        run = _good_run()
        base = run["servers"]["base_fp8"]
        base["nc_armed_persistent"][0][0] += 1
        ok, text = self.verdict(run)
        self.assertFalse(ok)
        self.assertIn("1 before the first corrupted step", text)

    def test_failed_or_missing_servers_fail(self):
        run = _good_run()
        run["servers"]["ours_fp8"] = {"error": "RuntimeError: boom"}
        ok, text = self.verdict(run)
        self.assertFalse(ok)
        self.assertIn("boom", text)
        self.assertIn("0/64 prompts identical", text)
        run = _good_run()
        run["servers"]["base_fp8"]["seq_again"][3] = []
        self.assertFalse(self.verdict(run)[0])
        run = _good_run()
        run["servers"]["base_fp8"]["alive"] = False
        self.assertFalse(self.verdict(run)[0])


class TestCpuReplay(unittest.TestCase):
    def test_prints_p6_and_the_engine_exactness(self):
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = demo.main(["--mode", "cpu", "--quick", "--no-plots"])
        text = buf.getvalue()
        self.assertEqual(rc, 0, text[-2000:])
        self.assertIn("== P6", text)
        self.assertIn("== Exactness of the reference engine", text)
        # The cross-layer prefetch was removed from the offload: no replay of it.
        self.assertNotIn("prefetch", text)


if __name__ == "__main__":
    unittest.main()
