"""Tests of scripts/apply_patch.py, the installer of our patch set.

They run the tool (as a subprocess, like a user) against copies of the
pristine wheel of the sglang the venv holds (one of the supported releases,
else the oldest; downloaded once with pip into .cache/), laid out as an
installed package (DIR/sglang) and as a git checkout (DIR/python/sglang), with
small patch series made here and with the repo's real series of that version
(patches/<version>/) and modules.
"""

import difflib
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import zlib
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "apply_patch.py"
MANIFEST = ".nsa_kv_offload_manifest.json"


def _load_tool():
    spec = importlib.util.spec_from_file_location("apply_patch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["apply_patch"] = module
    spec.loader.exec_module(module)
    return module


ap = _load_tool()
_PRISTINE = None


def _venv_version() -> str:
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return version if version in ap.SUPPORTED_VERSIONS else ap.SUPPORTED_VERSIONS[0]


VERSION = _venv_version()
REPO_PATCHES = ap.patches_dir_for(VERSION)


def pristine_package() -> Path:
    """The pristine sglang package dir of the VERSION wheel (cached)."""
    global _PRISTINE
    if _PRISTINE is None:
        _PRISTINE = ap.ensure_pristine(VERSION, REPO_ROOT / ".cache")
    return _PRISTINE


def snapshot(root: Path, with_mtimes: bool = False) -> dict:
    """Every file and directory under root: rel -> sha256 (and mtime)."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        state[rel_dir + "/"] = "dir"
        for name in filenames:
            path = Path(dirpath) / name
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if with_mtimes:
                digest = (digest, path.stat().st_mtime_ns)
            state[Path(rel_dir, name).as_posix()] = digest
    return state


def run_tool(*args, check_rc=None):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if check_rc is not None and proc.returncode != check_rc:
        raise AssertionError(
            f"exit {proc.returncode} (wanted {check_rc}) for {args}:\n{proc.stdout}"
        )
    return proc


def read(path: Path) -> str:
    return path.read_bytes().decode()


def make_diff(rel: str, old, new) -> str:
    """A patch in the format of GNU diff -u / git diff (via difflib)."""
    path = f"python/sglang/{rel}"
    a = [] if old is None else old.splitlines(keepends=True)
    b = [] if new is None else new.splitlines(keepends=True)
    return f"diff --git a/{path} b/{path}\n" + "".join(
        difflib.unified_diff(
            a,
            b,
            fromfile=f"a/{path}" if old is not None else "/dev/null",
            tofile=f"b/{path}" if new is not None else "/dev/null",
        )
    )


# The files of the package the tests touch; a non-full copy of the pristine
# package has these, the files the repo's series patches, and every directory.
TOUCHED_FILES = (
    "__init__.py",
    "version.py",
    "_version.py",
    "srt/constants.py",
    "srt/server_args.py",
    "srt/mem_cache/memory_pool.py",
)


def copy_pristine(dest: Path, full: bool) -> None:
    """Copy the pristine package to dest: all of it, or (faster) every
    directory and only the files that the tool may read or write."""
    src = pristine_package()
    if full:
        shutil.copytree(src, dest)
        return
    for dirpath, _, _ in os.walk(src):
        (dest / Path(dirpath).relative_to(src)).mkdir(parents=True, exist_ok=True)
    files = set(TOUCHED_FILES)
    files.update(ap._touched(ap.read_series(REPO_PATCHES)))
    for rel in sorted(files):
        if (src / rel).is_file():
            shutil.copy2(src / rel, dest / rel)


def insert_after(text: str, line_no: int, new_lines: str) -> str:
    """``line_no`` of a 9,600-line file, scaled down in a shorter one (0.5.23's
    server_args.py has 907 lines)."""
    lines = text.splitlines(keepends=True)
    if len(lines) < 9600:
        line_no = max(line_no * len(lines) // 9600, 1)
    return "".join(lines[:line_no] + [new_lines] + lines[line_no:])


class Fixture:
    """A tmp dir with a target tree, a patches dir and a modules dir."""

    NEW_FILE = "srt/nsa_test_created_by_patch.py"

    def __init__(self, tmp: Path, layout: str, full: bool = False):
        self.tmp = tmp
        self.layout = layout
        if layout == "package":
            self.sglang_dir = tmp / "site-packages"
            self.package = self.sglang_dir / "sglang"
        else:
            self.sglang_dir = tmp / "sglang-checkout"
            self.package = self.sglang_dir / "python" / "sglang"
        copy_pristine(self.package, full)
        if layout == "checkout":
            # A checkout has no generated _version.py: the version comes from
            # the release tag at HEAD.
            (self.package / "_version.py").unlink()
            make_fake_git(self.sglang_dir, tags={"v" + VERSION: "head"})
        self.patches = tmp / "patches"
        self.modules = tmp / "modules" / "sglang"
        self.patches.mkdir()
        self.modules.mkdir(parents=True)

        pristine = pristine_package()
        self.orig_server_args = read(pristine / "srt/server_args.py")
        self.orig_memory_pool = read(pristine / "srt/mem_cache/memory_pool.py")
        server_args_1 = insert_after(self.orig_server_args, 20, "# nsa test: one\n")
        self.memory_pool_1 = insert_after(
            self.orig_memory_pool, 692, "# nsa test: before KVCache\n"
        )
        self.server_args_2 = insert_after(
            server_args_1, 4000, "# nsa test: two\n# second line\n"
        )
        self.new_file = "NEW = 1\n"
        self.patch_texts = {
            "0001-one.patch": "Test patch one.\n\n"
            + make_diff("srt/server_args.py", self.orig_server_args, server_args_1)
            + make_diff(
                "srt/mem_cache/memory_pool.py",
                self.orig_memory_pool,
                self.memory_pool_1,
            ),
            "0002-two.patch": make_diff(
                "srt/server_args.py", server_args_1, self.server_args_2
            )
            + make_diff(self.NEW_FILE, None, self.new_file),
        }
        self.write_series(self.patch_texts)
        self.module_files = {
            "srt/mem_cache/nsa_test_module.py": "VALUE = 1\n",
            "srt/nsa_test_pkg/__init__.py": "",
            "srt/nsa_test_pkg/sub/impl.py": "def f():\n    return 2\n",
        }
        for rel, text in self.module_files.items():
            path = self.modules / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    def write_series(self, texts: dict) -> None:
        for name, text in texts.items():
            (self.patches / name).write_text(text)
        (self.patches / "series").write_text(
            "# test series\n" + "".join(f"{name}\n" for name in texts)
        )

    def run(self, *args, check_rc=None):
        return run_tool(
            "--sglang-dir",
            self.sglang_dir,
            "--patches-dir",
            self.patches,
            "--modules-dir",
            self.modules,
            *args,
            check_rc=check_rc,
        )

    def assert_applied(self, test: unittest.TestCase) -> None:
        pkg = self.package
        test.assertEqual(read(pkg / "srt/server_args.py"), self.server_args_2)
        test.assertEqual(read(pkg / "srt/mem_cache/memory_pool.py"), self.memory_pool_1)
        test.assertEqual(read(pkg / self.NEW_FILE), self.new_file)
        for rel, text in self.module_files.items():
            test.assertEqual(read(pkg / rel), text)
        test.assertTrue((pkg / MANIFEST).is_file())


def make_fake_git(root: Path, tags: dict, annotated: bool = False) -> None:
    """A minimal .git: HEAD on a branch, tags as loose refs."""
    head = "1" * 40
    git = root / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "refs" / "tags").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text(head + "\n")
    for tag, where in tags.items():
        sha = head if where == "head" else "2" * 40
        if annotated:
            body = f"object {sha}\ntype commit\ntag {tag}\n\nrelease\n".encode()
            data = b"tag %d\0" % len(body) + body
            obj_sha = hashlib.sha1(data).hexdigest()
            obj = git / "objects" / obj_sha[:2] / obj_sha[2:]
            obj.parent.mkdir(parents=True, exist_ok=True)
            obj.write_bytes(zlib.compress(data))
            sha = obj_sha
        (git / "refs" / "tags" / tag).write_text(sha + "\n")


class _LayoutTests:
    """Apply / check / re-apply / revert on one layout (see subclasses): what
    depends on the layout (paths, the version, a checkout patched by hand,
    the repo's series); the rest of the tool's behaviour runs on the package
    layout only (``_ToolBehaviourTests``)."""

    layout = None
    # Tests that work on a full copy of the wheel's package (slower).
    FULL_COPY = ("test_check_apply_reapply_revert", "test_repo_series_and_modules")

    def setUp(self):
        self._tmp = tempfile.mkdtemp(prefix="apply-patch-test-")
        full = self._testMethodName in self.FULL_COPY
        self.fx = Fixture(Path(self._tmp), self.layout, full=full)

    def tearDown(self):
        shutil.rmtree(self._tmp, ignore_errors=True)

    def test_check_apply_reapply_revert(self):
        fx = self.fx
        before = snapshot(fx.sglang_dir, with_mtimes=True)

        out = fx.run("--check", check_rc=0).stdout
        self.assertIn("would add module srt/nsa_test_pkg/sub/impl.py", out)
        self.assertIn("would apply patch 0001-one.patch (2 file(s), 2 hunk(s))", out)
        self.assertIn("would apply patch 0002-two.patch", out)
        self.assertIn("dry run, nothing written", out)
        self.assertEqual(snapshot(fx.sglang_dir, with_mtimes=True), before)

        out = fx.run(check_rc=0).stdout
        self.assertIn("apply: done", out)
        fx.assert_applied(self)
        applied = snapshot(fx.sglang_dir, with_mtimes=True)

        time.sleep(0.01)  # a rewrite would show in the mtimes
        out = fx.run(check_rc=0).stdout
        self.assertIn("nothing to do", out)
        self.assertIn("patch 0001-one.patch: already applied", out)
        self.assertIn("3 module(s) already up to date", out)
        self.assertEqual(snapshot(fx.sglang_dir, with_mtimes=True), applied)

        out = fx.run("--check", check_rc=0).stdout
        self.assertIn("nothing to do", out)

        out = fx.run("--revert", "--check", check_rc=0).stdout
        self.assertIn("would revert patch 0002-two.patch", out)
        self.assertIn("would remove module srt/mem_cache/nsa_test_module.py", out)
        self.assertEqual(snapshot(fx.sglang_dir, with_mtimes=True), applied)

        # Bytecode of our modules goes too, with the directories we made.
        cache = fx.package / "srt" / "nsa_test_pkg" / "sub" / "__pycache__"
        cache.mkdir()
        (cache / "impl.cpython-311.pyc").write_bytes(b"x")
        out = fx.run("--revert", check_rc=0).stdout
        self.assertIn("revert: done", out)
        self.assertEqual(snapshot(fx.sglang_dir), snapshot_of_before(before))

        out = fx.run("--revert", check_rc=0).stdout
        self.assertIn("nothing to do", out)

    def test_version_refusal(self):
        fx = self.fx
        if self.layout == "package":
            version_file = fx.package / "_version.py"
            version_file.write_text(
                read(version_file).replace(f"'{VERSION}'", "'0.5.11'")
            )
        else:
            shutil.rmtree(fx.sglang_dir / ".git")
            make_fake_git(fx.sglang_dir, tags={"v0.5.11": "head"})
        before = snapshot(fx.sglang_dir, with_mtimes=True)
        for args in ((), ("--check",), ("--revert",)):
            proc = fx.run(*args, check_rc=2)
            self.assertIn("0.5.11", proc.stdout)
            for supported in ap.SUPPORTED_VERSIONS:
                self.assertIn(supported, proc.stdout)
            self.assertIn("refusing", proc.stdout)
        self.assertEqual(snapshot(fx.sglang_dir, with_mtimes=True), before)

    def test_files_patched_by_hand_are_recognised(self):
        # No manifest (e.g. a checkout patched with `git apply`): the state of
        # each patch is read from the files.
        fx = self.fx
        before = snapshot(fx.sglang_dir)
        (fx.package / "srt/server_args.py").write_text(fx.server_args_2)
        (fx.package / "srt/mem_cache/memory_pool.py").write_text(fx.memory_pool_1)
        (fx.package / fx.NEW_FILE).write_text(fx.new_file)
        out = fx.run(check_rc=0).stdout
        self.assertIn("patch 0001-one.patch: already applied", out)
        self.assertIn("patch 0002-two.patch: already applied", out)
        fx.assert_applied(self)
        fx.run("--revert", check_rc=0)
        self.assertEqual(snapshot(fx.sglang_dir), before)

    def test_repo_series_and_modules(self):
        """The repo's real patches/ and python/sglang/ on this layout."""
        fx = self.fx
        before = snapshot(fx.sglang_dir)
        # No --patches-dir: the series of the target's version.
        out = run_tool("--sglang-dir", fx.sglang_dir, "--check", check_rc=0).stdout
        self.assertIn(f"sglang {VERSION} at", out)
        self.assertIn(f"patch(es) in {REPO_PATCHES}\n", out)
        self.assertEqual(snapshot(fx.sglang_dir), before)
        repo = ("--patches-dir", REPO_PATCHES)
        repo += ("--modules-dir", REPO_ROOT / "python" / "sglang")
        out = run_tool("--sglang-dir", fx.sglang_dir, *repo, check_rc=0).stdout
        self.assertNotIn("ERROR", out)
        modules = ap.list_modules(REPO_ROOT / "python" / "sglang")
        for rel, data in modules.items():
            self.assertEqual((fx.package / rel).read_bytes(), data)
        for patch in ap.read_series(REPO_PATCHES):
            self.assertIn(patch.name, out)
        applied = snapshot(fx.sglang_dir, with_mtimes=True)
        out = run_tool("--sglang-dir", fx.sglang_dir, *repo, check_rc=0).stdout
        self.assertIn("nothing to do", out)
        self.assertEqual(snapshot(fx.sglang_dir, with_mtimes=True), applied)
        run_tool("--sglang-dir", fx.sglang_dir, "--revert", *repo, check_rc=0)
        self.assertEqual(snapshot(fx.sglang_dir), before)


class _ToolBehaviourTests(_LayoutTests):
    """The layout-independent behaviour (on the package layout)."""

    def test_conflict_writes_nothing(self):
        fx = self.fx
        # Change the first context line of 0002's first hunk.
        lines = fx.patch_texts["0002-two.patch"].splitlines(keepends=True)
        k = next(i for i, line in enumerate(lines) if line.startswith("@@")) + 1
        lines[k] = " # not what the file says\n"
        broken = "".join(lines)
        fx.write_series({**fx.patch_texts, "0002-two.patch": broken})
        before = snapshot(fx.sglang_dir, with_mtimes=True)
        for args in (("--check",), ()):
            proc = fx.run(*args, check_rc=1)
            self.assertIn("0002-two.patch", proc.stdout)
            self.assertIn("python/sglang/srt/server_args.py", proc.stdout)
            self.assertIn("hunk #1", proc.stdout)
            self.assertIn("# not what the file says", proc.stdout)
        # Not even the good first patch or the modules were written.
        self.assertEqual(snapshot(fx.sglang_dir, with_mtimes=True), before)

    def test_edited_patch_and_modules_are_picked_up(self):
        fx = self.fx
        before = snapshot(fx.sglang_dir)
        fx.run(check_rc=0)
        fx.assert_applied(self)
        # The developer edits patch 0001 and the modules.
        server_args_1b = insert_after(
            fx.orig_server_args, 20, "# nsa test: one, edited\n"
        )
        fx.patch_texts["0001-one.patch"] = make_diff(
            "srt/server_args.py", fx.orig_server_args, server_args_1b
        )
        fx.server_args_2 = insert_after(
            server_args_1b, 4000, "# nsa test: two\n# second line\n"
        )
        fx.patch_texts["0002-two.patch"] = make_diff(
            "srt/server_args.py", server_args_1b, fx.server_args_2
        ) + make_diff(fx.NEW_FILE, None, fx.new_file)
        fx.write_series(fx.patch_texts)
        fx.memory_pool_1 = fx.orig_memory_pool  # 0001 no longer touches it
        (fx.modules / "srt/mem_cache/nsa_test_module.py").write_text("VALUE = 2\n")
        fx.module_files["srt/mem_cache/nsa_test_module.py"] = "VALUE = 2\n"
        shutil.rmtree(fx.modules / "srt/nsa_test_pkg")
        del fx.module_files["srt/nsa_test_pkg/__init__.py"]
        del fx.module_files["srt/nsa_test_pkg/sub/impl.py"]

        out = fx.run(check_rc=0).stdout
        self.assertIn("take back patch 0002-two.patch", out)
        self.assertIn("apply patch 0001-one.patch", out)
        self.assertIn("update module srt/mem_cache/nsa_test_module.py", out)
        self.assertIn("remove module srt/nsa_test_pkg/sub/impl.py", out)
        fx.assert_applied(self)
        self.assertFalse((fx.package / "srt/nsa_test_pkg").exists())
        self.assertIn("nothing to do", fx.run(check_rc=0).stdout)

        fx.run("--revert", check_rc=0)
        self.assertEqual(snapshot(fx.sglang_dir), before)

    def test_patch_removed_from_series_is_taken_back(self):
        fx = self.fx
        before = snapshot(fx.sglang_dir)
        fx.run(check_rc=0)
        (fx.patches / "series").write_text("0001-one.patch\n")
        out = fx.run(check_rc=0).stdout
        self.assertIn("take back patch 0002-two.patch", out)
        self.assertFalse((fx.package / fx.NEW_FILE).exists())
        fx.run("--revert", check_rc=0)
        self.assertEqual(snapshot(fx.sglang_dir), before)

    def test_reinstalled_sglang_is_detected(self):
        # pip install --force-reinstall puts the upstream files back but
        # leaves our manifest and modules: the next apply must patch again.
        fx = self.fx
        fx.run(check_rc=0)
        shutil.copy(
            pristine_package() / "srt/server_args.py", fx.package / "srt/server_args.py"
        )
        shutil.copy(
            pristine_package() / "srt/mem_cache/memory_pool.py",
            fx.package / "srt/mem_cache/memory_pool.py",
        )
        (fx.package / fx.NEW_FILE).unlink()
        out = fx.run(check_rc=0).stdout
        self.assertIn("reading the patch state from the files", out)
        self.assertIn("apply patch 0001-one.patch", out)
        fx.assert_applied(self)

    def test_module_over_an_upstream_file_is_refused(self):
        fx = self.fx
        (fx.modules / "srt/constants.py").write_text("# not upstream\n")
        before = snapshot(fx.sglang_dir, with_mtimes=True)
        proc = fx.run(check_rc=1)
        self.assertIn("srt/constants.py", proc.stdout)
        self.assertIn("upstream file", proc.stdout)
        self.assertEqual(snapshot(fx.sglang_dir, with_mtimes=True), before)

    def test_empty_series_installs_modules_only(self):
        fx = self.fx
        before = snapshot(fx.sglang_dir)
        (fx.patches / "series").unlink()
        out = fx.run(check_rc=0).stdout
        self.assertIn("0 patch(es)", out)
        self.assertEqual(read(fx.package / "srt/server_args.py"), fx.orig_server_args)
        for rel, text in fx.module_files.items():
            self.assertEqual(read(fx.package / rel), text)
        fx.run("--revert", check_rc=0)
        self.assertEqual(snapshot(fx.sglang_dir), before)

    def test_bench_hooks_only_with_the_option(self):
        """--with-bench-hooks adds the top-k trace module and its calls (the
        MLA forward's decode and verify hooks); a plain apply
        installs neither (and takes them back out). A version without
        hooks yet refuses the option, writing nothing."""
        fx = self.fx
        before = snapshot(fx.sglang_dir)
        repo = ("--patches-dir", REPO_PATCHES)
        repo += ("--modules-dir", REPO_ROOT / "python" / "sglang")
        if not ap.read_series(ap.BENCH_HOOKS_ROOT / VERSION):
            proc = run_tool(
                "--sglang-dir", fx.sglang_dir, "--with-bench-hooks", *repo, check_rc=2
            )
            self.assertIn(f"no benchmark hooks for sglang {VERSION}", proc.stdout)
            self.assertEqual(snapshot(fx.sglang_dir), before)
            return
        trace_rel = "srt/layers/attention/nsa_topk_trace.py"
        backend = fx.package / "srt/layers/attention/nsa_backend.py"
        if not backend.exists():  # the DSA backend (no hook of its own)
            backend = fx.package / "srt/layers/attention/dsa_backend.py"
        # An NSA backend's 0003: the unfused verify top-k mapped in one gather.
        one_gather = "all(n == 1 for n in metadata.nsa_extend_seq_lens_list)"
        hooks_backend = backend.name == "nsa_backend.py"
        mla = fx.package / (
            "srt/models/deepseek_common/attention_forward_methods/forward_mla.py"
        )
        run_tool("--sglang-dir", fx.sglang_dir, *repo, check_rc=0)
        plain = snapshot(fx.sglang_dir)
        self.assertFalse((fx.package / trace_rel).exists())
        self.assertNotIn("nsa_topk_trace", backend.read_text())
        self.assertNotIn("nsa_topk_trace", mla.read_text())
        out = run_tool(
            "--sglang-dir", fx.sglang_dir, "--with-bench-hooks", *repo, check_rc=0
        ).stdout
        self.assertNotIn("ERROR", out)
        self.assertEqual(
            (fx.package / trace_rel).read_bytes(),
            ap.BENCH_HOOKS_MODULES[trace_rel].read_bytes(),
        )
        self.assertIn("nsa_topk_trace.apply_decode_topk_hooks", mla.read_text())
        self.assertIn("nsa_topk_trace.apply_verify_topk_hooks", mla.read_text())
        self.assertNotIn("nsa_topk_trace", backend.read_text())
        self.assertEqual(one_gather in backend.read_text(), hooks_backend)
        run_tool("--sglang-dir", fx.sglang_dir, *repo, check_rc=0)
        self.assertEqual(snapshot(fx.sglang_dir), plain)
        self.assertNotIn(one_gather, backend.read_text())
        run_tool("--sglang-dir", fx.sglang_dir, "--with-bench-hooks", *repo, check_rc=0)
        run_tool("--sglang-dir", fx.sglang_dir, "--revert", *repo, check_rc=0)
        self.assertEqual(snapshot(fx.sglang_dir), before)


def snapshot_of_before(before_with_mtimes: dict) -> dict:
    return {
        k: (v[0] if isinstance(v, tuple) else v) for k, v in before_with_mtimes.items()
    }


class TestApplyPatchPackageLayout(_ToolBehaviourTests, unittest.TestCase):
    layout = "package"

    def test_export_regenerates_a_patch(self):
        fx = self.fx
        fx.run(check_rc=0)
        # The developer edits the installed file further...
        path = fx.package / "srt/server_args.py"
        edited = insert_after(read(path), 6000, "# nsa test: three\n")
        path.write_text(edited)
        pristine = pristine_package()
        out = fx.run(
            "--export",
            "0003-three",
            "--files",
            "srt/server_args.py",
            "--pristine-dir",
            pristine.parent,
            check_rc=0,
        ).stdout
        self.assertIn("appended 0003-three.patch", out)
        series = (fx.patches / "series").read_text().split()
        self.assertEqual(series[-1], "0003-three.patch")
        text = (fx.patches / "0003-three.patch").read_text()
        self.assertIn("+# nsa test: three\n", text)
        self.assertNotIn("+# nsa test: one", text)  # only this patch's change
        self.assertIn("--- a/python/sglang/srt/server_args.py\n", text)

        # ...which now applies as part of the series, from pristine.
        other = Fixture(Path(self._tmp) / "other", "package")
        shutil.rmtree(other.patches)
        shutil.copytree(fx.patches, other.patches)
        other.run(check_rc=0)
        self.assertEqual(read(other.package / "srt/server_args.py"), edited)

        # The edited target itself: the new patch is recognised as applied.
        out = fx.run(check_rc=0).stdout
        self.assertIn("patch 0003-three.patch: already applied", out)

        # Re-export without --files keeps the description and the files.
        fx.run("--export", "0001-one.patch", "--pristine-dir", pristine, check_rc=0)
        self.assertEqual(
            (fx.patches / "0001-one.patch").read_text().split("diff --git")[0],
            "Test patch one.\n\n",
        )
        self.assertEqual((fx.patches / "series").read_text().count("0001-one"), 1)

        proc = fx.run(
            "--export",
            "0004-none.patch",
            "--files",
            "srt/constants.py",
            "--pristine-dir",
            pristine,
            check_rc=2,
        )
        self.assertIn("nothing to export", proc.stdout)
        self.assertFalse((fx.patches / "0004-none.patch").exists())

    def test_record_tells_upstream_files_from_stray_modules(self):
        # A module copied in by hand (no manifest) is taken over when the
        # wheel's RECORD says it is not an upstream file.
        fx = self.fx
        dist_info = fx.sglang_dir / f"sglang-{VERSION}.dist-info"
        dist_info.mkdir()
        (dist_info / "RECORD").write_text(
            "sglang/srt/constants.py,sha256=x,1\nsglang/version.py,sha256=y,2\n"
        )
        stray = fx.package / "srt/mem_cache/nsa_test_module.py"
        stray.write_text("OLD = 0\n")
        out = fx.run(check_rc=0).stdout
        self.assertIn("not an upstream file, taking it over", out)
        fx.assert_applied(self)
        fx.run("--revert", check_rc=0)
        self.assertFalse(stray.exists())

        (fx.modules / "srt/constants.py").write_text("# not upstream\n")
        proc = fx.run(check_rc=1)
        self.assertIn("would overwrite the upstream file", proc.stdout)

    def test_package_dir_itself_is_accepted(self):
        fx = self.fx
        out = run_tool(
            "--sglang-dir",
            fx.package,
            "--patches-dir",
            fx.patches,
            "--modules-dir",
            fx.modules,
            check_rc=0,
        ).stdout
        self.assertIn("installed package", out)
        fx.assert_applied(self)


class TestVersionSelection(unittest.TestCase):
    """Each supported release has its series and its bench-hooks folder; the
    target's version picks them; any other version is refused by name."""

    def test_every_supported_version_has_both_dirs(self):
        self.assertIn(VERSION, ap.SUPPORTED_VERSIONS)
        for version in ap.SUPPORTED_VERSIONS:
            with self.subTest(version=version):
                hooks = ap.BENCH_HOOKS_ROOT / version
                # A release without bench hooks yet has no folder (refused).
                for folder in (ap.patches_dir_for(version),) + (
                    (hooks,) if hooks.is_dir() else ()
                ):
                    self.assertTrue((folder / "series").is_file(), folder)
                    ap.read_series(folder)  # every listed patch exists and parses
                self.assertEqual(ap.resolve_patches_dir(version, None).name, version)
                self.assertEqual(ap.series_version(version, None), version)
        # A --patches-dir of a release names the release (for its bench hooks).
        other = ap.patches_dir_for(ap.SUPPORTED_VERSIONS[-1])
        self.assertEqual(ap.series_version(ap.SUPPORTED_VERSIONS[0], other), other.name)

    def test_unsupported_version_is_refused_by_name(self):
        tmp = Path(tempfile.mkdtemp(prefix="apply-patch-version-"))
        self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
        (tmp / "sglang").mkdir()
        (tmp / "sglang" / "version.py").write_text("__version__ = '0.5.99'\n")
        before = snapshot(tmp)
        for args in ((), ("--check",), ("--revert",), ("--with-bench-hooks",)):
            proc = run_tool("--sglang-dir", tmp, *args, check_rc=2)
            self.assertIn("it is sglang 0.5.99", proc.stdout)
            self.assertIn(", ".join(ap.SUPPORTED_VERSIONS), proc.stdout)
        # --ignore-version goes ahead only with a series named.
        proc = run_tool("--sglang-dir", tmp, "--ignore-version", "--check", check_rc=2)
        self.assertIn("name one with --patches-dir", proc.stdout)
        self.assertEqual(snapshot(tmp), before)

    def test_dropped_version_is_refused_by_name(self):
        self.assertNotIn("0.5.12.post1", ap.SUPPORTED_VERSIONS)
        tmp = Path(tempfile.mkdtemp(prefix="apply-patch-dropped-"))
        self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
        (tmp / "sglang").mkdir()
        (tmp / "sglang" / "version.py").write_text("__version__ = '0.5.12.post1'\n")
        before = snapshot(tmp)
        for args in ((), ("--check",), ("--revert",)):
            proc = run_tool("--sglang-dir", tmp, *args, check_rc=2)
            self.assertIn("it is sglang 0.5.12.post1", proc.stdout)
            self.assertIn("support for sglang 0.5.12.post1 was dropped", proc.stdout)
        self.assertEqual(snapshot(tmp), before)


class TestApplyPatchCheckoutLayout(_LayoutTests, unittest.TestCase):
    layout = "checkout"

    def test_layout_detected(self):
        out = self.fx.run("--check", check_rc=0).stdout
        self.assertIn("git checkout", out)
        self.assertIn(f"sglang {VERSION}", out)

    def test_unknown_version_is_refused(self):
        fx = self.fx
        shutil.rmtree(fx.sglang_dir / ".git")
        proc = fx.run(check_rc=2)
        self.assertIn("cannot tell which sglang version", proc.stdout)
        self.assertIn("--ignore-version", proc.stdout)
        fx.run("--ignore-version", check_rc=0)

    def test_annotated_tag(self):
        fx = self.fx
        shutil.rmtree(fx.sglang_dir / ".git")
        make_fake_git(fx.sglang_dir, tags={"v" + VERSION: "head"}, annotated=True)
        self.assertIn(f"sglang {VERSION}", fx.run("--check", check_rc=0).stdout)

    def test_tag_elsewhere_is_refused(self):
        fx = self.fx
        shutil.rmtree(fx.sglang_dir / ".git")
        make_fake_git(fx.sglang_dir, tags={"v" + VERSION: "elsewhere"})
        self.assertIn("cannot tell", fx.run(check_rc=2).stdout)

    @unittest.skipUnless(shutil.which("git"), "needs the git binary")
    def test_real_git_tags(self):
        root = Path(self._tmp) / "real-git"
        (root / "python" / "sglang").mkdir(parents=True)
        (root / "python" / "sglang" / "version.py").write_text("# dynamic\n")
        env = dict(
            os.environ,
            GIT_AUTHOR_NAME="t",
            GIT_AUTHOR_EMAIL="t@example.com",
            GIT_COMMITTER_NAME="t",
            GIT_COMMITTER_EMAIL="t@example.com",
        )

        def git(*args):
            subprocess.run(
                ["git", "-C", str(root), *args],
                check=True,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

        git("init", "-q")
        git("add", "-A")
        git("commit", "-q", "-m", "release")
        git("tag", "-a", "v" + VERSION, "-m", "release")
        target = ap.find_target(root)
        self.assertEqual(ap.read_version(target)[0], VERSION)
        git("pack-refs", "--all")
        git("gc", "-q")  # tag object into a pack: falls back to `git tag`
        self.assertEqual(ap.read_version(target)[0], VERSION)


class TestDiffEngine(unittest.TestCase):
    def roundtrip(self, old, new):
        text = ap.unified_diff(old, new, "srt/x.py")
        if old == new:
            self.assertEqual(text, "")
            return
        patch = ap.parse_patch(text, "t.patch")
        (fp,) = patch.files
        self.assertEqual(ap.apply_file_patch(old, fp, False, "t"), new)
        self.assertEqual(ap.apply_file_patch(new, fp, True, "t"), old)

    def test_no_newline_at_end_of_file(self):
        self.roundtrip("a\nb\nc", "a\nb\nc\n")
        self.roundtrip("a\nb\nc\n", "a\nB\nc")
        self.roundtrip("x", "y")
        text = ap.unified_diff("a\nb", "a\nc", "srt/x.py")
        self.assertIn("\\ No newline at end of file\n", text)

    def test_crlf_and_odd_separators_are_kept(self):
        self.roundtrip("a\r\nb\r\nc\r\n", "a\r\nB\r\nc\r\n")
        # str.splitlines() would split at \x0c and \u2028; diff must not.
        self.roundtrip("a\x0cb\nc\u2028d\n", "a\x0cb\nC\u2028d\n")

    def test_created_and_deleted_files(self):
        text = ap.unified_diff(None, "new\n", "srt/x.py")
        (fp,) = ap.parse_patch(text, "t").files
        self.assertEqual(ap.apply_file_patch(None, fp, False, "t"), "new\n")
        self.assertIsNone(ap.apply_file_patch("new\n", fp, True, "t"))
        with self.assertRaises(ap.PatchError):
            ap.apply_file_patch("exists\n", fp, False, "t")

    def test_offset_search(self):
        old = "".join(f"line {i}\n" for i in range(100))
        new = old.replace("line 50\n", "line 50\nadded\n")
        text = ap.unified_diff(old, new, "srt/x.py")
        (fp,) = ap.parse_patch(text, "t").files
        shifted = "".join(f"extra {i}\n" for i in range(7)) + old
        result = ap.apply_file_patch(shifted, fp, False, "t")
        self.assertEqual(result, shifted.replace("line 50\n", "line 50\nadded\n"))
        # A changed context line fails, naming the file and the hunk.
        with self.assertRaises(ap.PatchError) as ctx:
            ap.apply_file_patch(old.replace("line 49\n", "LINE 49\n"), fp, False, "t")
        self.assertIn("hunk #1", str(ctx.exception))
        self.assertIn("python/sglang/srt/x.py", str(ctx.exception))

    def test_bad_paths_are_rejected(self):
        text = make_diff("srt/x.py", "a\n", "b\n").replace(
            "python/sglang/srt/x.py", "python/pyproject.toml"
        )
        with self.assertRaises(ap.PatchError):
            ap.parse_patch(text, "t")

    @given(
        st.lists(st.sampled_from(["a\n", "b\n", "c\n", "\n", "d"]), max_size=30),
        st.lists(st.sampled_from(["a\n", "b\n", "c\n", "\n", "e"]), max_size=30),
    )
    def test_roundtrip_property(self, a, b):
        # Only the last line may lack its newline.
        old = "".join(line if line.endswith("\n") else line + "\n" for line in a)
        new = "".join(line if line.endswith("\n") else line + "\n" for line in b)
        if a and not a[-1].endswith("\n"):
            old = old[:-1]
        if b and not b[-1].endswith("\n"):
            new = new[:-1]
        self.roundtrip(old, new)

    def test_difflib_patches_parse(self):
        old = "".join(f"{i}\n" for i in range(20))
        new = old.replace("5\n", "five\n").replace("15\n", "")
        (fp,) = ap.parse_patch(make_diff("srt/y.py", old, new), "t").files
        self.assertEqual(ap.apply_file_patch(old, fp, False, "t"), new)


if __name__ == "__main__":
    unittest.main()
