"""The demo (``benchmark/nsa_offload/demo.py``, the README's first command):
the CPU replay it prints, and the server runs it starts on a GPU host (the
commands only: the servers need a GPU)."""

import io
import sys
import unittest
from contextlib import redirect_stdout
from pathlib import Path
from unittest import mock

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmark" / "nsa_offload"
sys.path.insert(0, str(BENCH_DIR))

import demo  # noqa: E402


class TestGpuComparison(unittest.TestCase):
    def _commands(self, argv, rcs=(0, 0)):
        args = demo.parse_args(argv)
        with mock.patch("subprocess.call", side_effect=list(rcs)) as call:
            with redirect_stdout(io.StringIO()):
                rc = demo.run_gpu_comparison(args)
        return rc, [c.args[0] for c in call.call_args_list]

    def test_colocated_then_pd_decode_at_128k(self):
        rc, cmds = self._commands(["--out-dir", "/tmp/demo_out"])
        self.assertEqual(rc, 0)
        self.assertEqual(len(cmds), 2)
        colocated, pd = cmds
        self.assertTrue(colocated[1].endswith("e2e_server.py"))
        self.assertEqual(colocated[2:4], ["--out", "/tmp/demo_out/colocated"])
        self.assertIn("--num-requests", colocated)
        self.assertNotIn("--pd-decode", colocated)
        self.assertEqual(pd[2:4], ["--out", "/tmp/demo_out/pd_decode_128k"])
        self.assertIn("--pd-decode", pd)
        self.assertEqual(pd[pd.index("--capacity-lengths") + 1], "131072")
        self.assertIn("hisparse", pd[pd.index("--servers") + 1].split(","))

    def test_quick_runs_the_colocated_servers_only(self):
        rc, cmds = self._commands(["--quick"], rcs=(0,))
        self.assertEqual(rc, 0)
        self.assertEqual(len(cmds), 1)
        self.assertNotIn("--pd-decode", cmds[0])

    def test_a_failed_run_fails_the_demo_and_the_next_still_runs(self):
        rc, cmds = self._commands([], rcs=(1, 0))
        self.assertEqual(rc, 1)
        self.assertEqual(len(cmds), 2)


class TestCpuReplay(unittest.TestCase):
    def test_prints_p6_and_the_engine_exactness(self):
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = demo.main(["--mode", "cpu", "--quick", "--no-plots"])
        text = buf.getvalue()
        self.assertEqual(rc, 0, text[-2000:])
        self.assertIn("== P6", text)
        self.assertIn("== Exactness of the reference engine", text)
        # The prefetch replay: both traces, and a verdict computed from them.
        section = text.split("== P6 with the cross-layer prefetch", 1)[1]
        self.assertIn("| embedded (layers 0,20,21,40,60) | 4160 |", section)
        row = [l for l in section.splitlines() if l.startswith("| adjacent layers")]
        ratio = float(row[0].split("|")[6])
        verdict = "met" if ratio <= 0.8 else "NOT MET"
        self.assertIn(f"= {ratio:.3f} -> {verdict}**", section)


if __name__ == "__main__":
    unittest.main()
