"""Every command-line script of the project answers ``--help`` in the CPU
venv (exit 0, a usage line, no traceback) and gives every option a help
text, sub-commands' options included.

Each script runs in its own interpreter, as an operator would start it,
under a wrapper that looks at every ``argparse`` parser before it parses.
"""

import glob
import json
import os
import subprocess
import sys
import unittest
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Runs the script as __main__ with argparse watched: every parser's actions
# without help text are written to stderr as one JSON line.
WRAPPER = r"""
import argparse, json, os, runpy, sys

def undocumented(parser, seen):
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    out += undocumented(sub, seen)
        elif not isinstance(action, argparse._HelpAction) and not action.help:
            out.append(action.option_strings or [action.dest])
    return out

parse = argparse.ArgumentParser.parse_known_args

def watched(self, *args, **kwargs):
    missing = undocumented(self, {id(self)})
    if missing:
        sys.stderr.write("UNDOCUMENTED " + json.dumps(missing) + "\n")
    return parse(self, *args, **kwargs)

argparse.ArgumentParser.parse_known_args = watched
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
"""


def scripts():
    """Python files with a command line: argparse and a __main__ block."""
    paths = sorted(
        glob.glob(str(REPO_ROOT / "benchmark" / "**" / "*.py"), recursive=True)
    )
    paths.append(str(REPO_ROOT / "scripts" / "apply_patch.py"))
    out = []
    for path in paths:
        with open(path) as f:
            text = f.read()
        if "argparse" in text and '__name__ == "__main__"' in text:
            out.append(path)
    return out


class TestScriptHelp(unittest.TestCase):
    def test_found_the_scripts(self):
        names = {os.path.relpath(p, REPO_ROOT) for p in scripts()}
        for name in (
            "benchmark/nsa_offload/demo.py",
            "benchmark/nsa_offload/server/exactness.py",
            "benchmark/nsa_offload/engine/gpu_check_lru.py",
            "scripts/apply_patch.py",
        ):
            self.assertIn(name, names)

    def test_help_of_every_script(self):
        env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", ""))
        for path in scripts():
            name = os.path.relpath(path, REPO_ROOT)
            with self.subTest(script=name):
                proc = subprocess.run(
                    [sys.executable, "-c", WRAPPER, path, "--help"],
                    capture_output=True,
                    text=True,
                    timeout=300,
                    cwd=REPO_ROOT,
                    env=env,
                )
                self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
                self.assertIn("usage:", proc.stdout)
                self.assertNotIn("Traceback", proc.stderr, proc.stderr[-3000:])
                missing = [
                    json.loads(line.split(" ", 1)[1])
                    for line in proc.stderr.splitlines()
                    if line.startswith("UNDOCUMENTED ")
                ]
                self.assertEqual(missing, [], "options without help text")


if __name__ == "__main__":
    unittest.main()
