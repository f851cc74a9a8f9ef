"""Every command-line script of the project answers ``--help`` in the CPU
venv (exit 0, a usage line, no traceback) and gives every option a help
text, sub-commands' options included.

The scripts run one after the other in one interpreter of their own (not
pytest's: TRITON_INTERPRET and the scripts' imports stay out of it), each as
``__main__`` with ``--help`` as an operator would start it, under a wrapper
that looks at every ``argparse`` parser before it parses. Between scripts
the wrapper restores ``sys.path``, the working directory, the environment and
drops the modules imported from this repo (the heavy libraries stay
imported: that is what one interpreter saves).
"""

import glob
import json
import os
import subprocess
import sys
import unittest
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Runs each script (argv[2:]) as __main__ with "--help" and argparse watched;
# writes one JSON line per script after the marker: its exit code, stdout,
# stderr, whether a traceback was raised and the actions without help text.
WRAPPER = r"""
import argparse, contextlib, io, json, os, runpy, sys, traceback

repo = os.path.realpath(sys.argv[1])

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
missing = []

def watched(self, *args, **kwargs):
    missing.extend(undocumented(self, {id(self)}))
    return parse(self, *args, **kwargs)

argparse.ArgumentParser.parse_known_args = watched

# The scripts' own modules (not the venv's, which may live in the repo too).
local_dirs = tuple(os.path.join(repo, d) + os.sep for d in ("benchmark", "scripts"))

def local(module):
    path = getattr(module, "__file__", None) or ""
    return os.path.realpath(path).startswith(local_dirs)

results = []
for script in sys.argv[2:]:
    saved = (list(sys.path), os.getcwd(), dict(os.environ), list(sys.argv))
    before = set(sys.modules)
    missing.clear()
    out, err = io.StringIO(), io.StringIO()
    code, raised = None, False
    sys.argv = [script, "--help"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        code, raised = 1, True
        err.write(traceback.format_exc())
    sys.path[:], sys.argv = saved[0], saved[3]
    os.chdir(saved[1])
    os.environ.clear()
    os.environ.update(saved[2])
    for name in set(sys.modules) - before:
        if local(sys.modules[name]):
            del sys.modules[name]
    results.append(
        dict(script=script, code=code, stdout=out.getvalue(), stderr=err.getvalue(),
             raised=raised, undocumented=list(missing))
    )
sys.stdout.write("\n@@RESULTS@@\n")
for r in results:
    sys.stdout.write(json.dumps(r) + "\n")
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
        paths = scripts()
        env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(
            [sys.executable, "-c", WRAPPER, str(REPO_ROOT), *paths],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO_ROOT,
            env=env,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        results = [
            json.loads(line)
            for line in proc.stdout.split("\n@@RESULTS@@\n", 1)[1].splitlines()
        ]
        self.assertEqual([r["script"] for r in results], paths)
        for r in results:
            with self.subTest(script=os.path.relpath(r["script"], REPO_ROOT)):
                self.assertEqual(r["code"], 0, r["stderr"][-3000:])
                self.assertIn("usage:", r["stdout"])
                self.assertFalse(r["raised"], r["stderr"][-3000:])
                self.assertNotIn("Traceback", r["stderr"], r["stderr"][-3000:])
                self.assertEqual(r["undocumented"], [], "options without help text")

    def test_a_broken_help_fails(self):
        # The wrapper reports a script whose --help raises, exits non-zero,
        # prints no usage or leaves an option undocumented, and the next
        # script still runs in the same interpreter.
        import tempfile

        scripts_text = {
            "raises.py": "raise RuntimeError('boom')\n",
            "exits.py": "import sys\nsys.exit(3)\n",
            "undocumented.py": (
                "import argparse\np = argparse.ArgumentParser()\n"
                "p.add_argument('--x')\np.parse_args()\n"
            ),
            "good.py": (
                "import argparse\np = argparse.ArgumentParser()\n"
                "p.add_argument('--x', help='x')\np.parse_args()\n"
            ),
        }
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for name, text in scripts_text.items():
                paths.append(os.path.join(d, name))
                with open(paths[-1], "w") as f:
                    f.write(text)
            proc = subprocess.run(
                [sys.executable, "-c", WRAPPER, d, *paths],
                capture_output=True,
                text=True,
                timeout=60,
            )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        results = {
            os.path.basename(r["script"]): r
            for r in map(
                json.loads,
                proc.stdout.split("\n@@RESULTS@@\n", 1)[1].splitlines(),
            )
        }
        self.assertTrue(results["raises.py"]["raised"])
        self.assertIn("boom", results["raises.py"]["stderr"])
        self.assertEqual(results["exits.py"]["code"], 3)
        self.assertEqual(results["undocumented.py"]["undocumented"], [["--x"]])
        self.assertEqual(results["good.py"]["code"], 0)
        self.assertIn("usage:", results["good.py"]["stdout"])
        self.assertEqual(results["good.py"]["undocumented"], [])


if __name__ == "__main__":
    unittest.main()
