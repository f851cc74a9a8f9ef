#!/usr/bin/env python3
"""Install the decode-side NSA KV-offload patch set into an sglang tree.

The patch set has two parts:

* new modules: every file under ``python/sglang/`` of this repository, copied
  to the same place in the target's ``sglang`` package;
* edits of upstream files: the unified diffs listed in
  ``patches/<version>/series`` (paths ``a/python/sglang/...``), one series
  per supported sglang release (``SUPPORTED_VERSIONS``); the target's
  installed version picks it, ``--patches-dir`` overrides the choice.

The target (``--sglang-dir DIR``) is either a directory holding the installed
package (site-packages or a ``pip --target`` dir: the package is
``DIR/sglang``) or an sglang git checkout (the package is
``DIR/python/sglang``).

Usage::

    scripts/apply_patch.py --sglang-dir DIR             # apply (idempotent)
    scripts/apply_patch.py --sglang-dir DIR --check     # dry run, writes nothing
    scripts/apply_patch.py --sglang-dir DIR --revert    # restore upstream files
    scripts/apply_patch.py --sglang-dir DIR --with-bench-hooks  # + benchmark hooks
    scripts/apply_patch.py --sglang-dir DIR --export NAME.patch \\
        --files srt/server_args.py [...]               # regenerate a patch

``--with-bench-hooks`` adds the benchmark-only part (never for a production
server): the top-k trace override / recorder
(``benchmark/nsa_offload/traces/nsa_topk_trace.py``, installed as
``sglang/srt/layers/attention/nsa_topk_trace.py``) and the patches listed in
``benchmark/nsa_offload/traces/bench_hooks/<version>/series`` (its calls in
the MLA forward), applied after the patch series; a
version whose hooks series is empty refuses the option. Applying without the
option takes them back out.

Everything is computed in memory before anything is written: a patch that
does not apply leaves every file untouched. Patches are applied in pure
Python (exact context match, line-offset search, no fuzz), so neither
``patch`` nor ``git`` is needed. What was installed is recorded in
``sglang/.nsa_kv_offload_manifest.json``; re-applying after editing a module
or a patch updates the target in place, and ``--revert`` undoes exactly what
was recorded and checks that every upstream file is byte for byte what it was.
"""

from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import difflib
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# The sglang releases with a patch series (patches/<version>/series), oldest
# first. Any other version is refused: add its series first.
SUPPORTED_VERSIONS = ("0.5.17", "0.5.23")
# Releases supported once, refused now with the reason.
DROPPED_VERSIONS = {
    "0.5.12.post1": "support for sglang 0.5.12.post1 was dropped (the GPU base "
    "is 0.5.17); install sglang 0.5.17",
}
REPO_ROOT = Path(__file__).resolve().parent.parent
PATCHES_ROOT = REPO_ROOT / "patches"
DEFAULT_MODULES_DIR = REPO_ROOT / "python" / "sglang"
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache"
BENCH_HOOKS_ROOT = REPO_ROOT / "benchmark" / "nsa_offload" / "traces" / "bench_hooks"
# Package-relative path -> file of the benchmark-only modules.
BENCH_HOOKS_MODULES = {
    "srt/layers/attention/nsa_topk_trace.py": REPO_ROOT
    / "benchmark"
    / "nsa_offload"
    / "traces"
    / "nsa_topk_trace.py",
}
MANIFEST_NAME = ".nsa_kv_offload_manifest.json"
MANIFEST_FORMAT = 1
PATCH_PATH_PREFIXES = ("python/sglang/", "sglang/")
DEV_NULL = "/dev/null"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2


class PatchError(Exception):
    """A patch that cannot be parsed or applied."""


class RefusedError(Exception):
    """The target is not something this tool may touch."""


# ---------------------------------------------------------------------------
# Text helpers: byte-exact round trips.
# ---------------------------------------------------------------------------


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _plan_file_changes(plan, state) -> None:
    """The plan's writes and deletes: every file the state changed."""
    for rel, text in state.changed().items():
        if text is None:
            plan.deletes.append(rel)
        else:
            plan.writes[rel] = _encode(text)


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def split_lines(text: str) -> List[str]:
    """Split on ``\\n`` only, keeping the endings (``str.splitlines`` would
    also split on form feeds and other separators that diff does not)."""
    if not text:
        return []
    lines = text.split("\n")
    out = [line + "\n" for line in lines[:-1]]
    if lines[-1]:
        out.append(lines[-1])
    return out


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_text(text: Optional[str]) -> Optional[str]:
    return None if text is None else sha256_bytes(_encode(text))


# ---------------------------------------------------------------------------
# Unified diff model, parser and applier.
# ---------------------------------------------------------------------------

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$")


@dataclasses.dataclass
class Hunk:
    old_start: int
    old_count: int
    new_start: int
    new_count: int
    header: str
    lines: List[Tuple[str, str]]  # (tag in " -+", text with its line ending)

    def old_lines(self) -> List[str]:
        return [text for tag, text in self.lines if tag != "+"]

    def new_lines(self) -> List[str]:
        return [text for tag, text in self.lines if tag != "-"]


@dataclasses.dataclass
class FilePatch:
    old_path: Optional[str]  # None for a created file
    new_path: Optional[str]  # None for a deleted file
    rel: str  # path inside the sglang package, e.g. "srt/server_args.py"
    hunks: List[Hunk]

    @property
    def display_path(self) -> str:
        return "python/sglang/" + self.rel


@dataclasses.dataclass
class Patch:
    name: str
    text: str
    files: List[FilePatch]

    @property
    def sha256(self) -> str:
        return sha256_text(self.text)

    @property
    def preamble(self) -> str:
        """Free text before the first file header (a description)."""
        lines = split_lines(self.text)
        out = []
        for line in lines:
            if line.startswith(("diff --git ", "--- ", "Index: ")):
                break
            out.append(line)
        return "".join(out)


def _strip_patch_path(raw: str) -> Optional[str]:
    path = raw.rstrip("\r\n")
    if "\t" in path:  # "--- a/foo.py\t2024-01-01 00:00:00"
        path = path.split("\t", 1)[0]
    path = path.strip()
    if path == DEV_NULL:
        return None
    if path.startswith('"'):
        raise PatchError(f"quoted paths are not supported: {path}")
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return path


def _package_rel(path: str, patch_name: str) -> str:
    for prefix in PATCH_PATH_PREFIXES:
        if path.startswith(prefix):
            return path[len(prefix) :]
    raise PatchError(
        f"{patch_name}: {path} is outside python/sglang/; only files of the "
        "sglang package can be patched"
    )


def parse_patch(text: str, name: str) -> Patch:
    lines = split_lines(text)
    files: List[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not (
            line.startswith("--- ")
            and i + 1 < len(lines)
            and lines[i + 1].startswith("+++ ")
        ):
            i += 1
            continue
        old_path = _strip_patch_path(line[4:])
        new_path = _strip_patch_path(lines[i + 1][4:])
        if old_path is None and new_path is None:
            raise PatchError(f"{name}: line {i + 1}: both sides are {DEV_NULL}")
        if old_path is not None and new_path is not None:
            old_rel = _package_rel(old_path, name)
            rel = _package_rel(new_path, name)
            if old_rel != rel:
                raise PatchError(
                    f"{name}: renames are not supported ({old_path} -> {new_path})"
                )
        else:
            rel = _package_rel(old_path or new_path, name)
        i += 2
        hunks: List[Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _parse_hunk(lines, i, name, rel)
            hunks.append(hunk)
        if not hunks:
            raise PatchError(f"{name}: python/sglang/{rel}: no hunks")
        files.append(FilePatch(old_path, new_path, rel, hunks))
    if not files and text.strip():
        raise PatchError(f"{name}: no file headers (--- a/... / +++ b/...) found")
    seen = set()
    for fp in files:
        if fp.rel in seen:
            raise PatchError(f"{name}: python/sglang/{fp.rel} appears twice")
        seen.add(fp.rel)
    return Patch(name=name, text=text, files=files)


def _parse_hunk(lines: List[str], i: int, name: str, rel: str) -> Tuple[Hunk, int]:
    header = lines[i].rstrip("\r\n")
    m = _HUNK_RE.match(header)
    if not m:
        raise PatchError(f"{name}: python/sglang/{rel}: bad hunk header {header!r}")
    old_start = int(m.group(1))
    old_count = int(m.group(2)) if m.group(2) is not None else 1
    new_start = int(m.group(3))
    new_count = int(m.group(4)) if m.group(4) is not None else 1
    body: List[Tuple[str, str]] = []
    old_left, new_left = old_count, new_count
    i += 1
    while old_left > 0 or new_left > 0:
        if i >= len(lines):
            raise PatchError(
                f"{name}: python/sglang/{rel}: hunk {header!r} is truncated"
            )
        line = lines[i]
        tag = line[0]
        if line in ("\n", "\r\n"):  # context line whose blank was stripped
            tag, text = " ", line
        elif tag in " -+":
            text = line[1:]
        elif tag == "\\":
            _no_newline(body, name, rel, header)
            i += 1
            continue
        else:
            raise PatchError(
                f"{name}: python/sglang/{rel}: hunk {header!r}: "
                f"unexpected line {line.rstrip()!r}"
            )
        if tag in " -":
            old_left -= 1
        if tag in " +":
            new_left -= 1
        if old_left < 0 or new_left < 0:
            raise PatchError(
                f"{name}: python/sglang/{rel}: hunk {header!r}: "
                "line counts do not match the header"
            )
        body.append((tag, text))
        i += 1
    if i < len(lines) and lines[i].startswith("\\"):
        _no_newline(body, name, rel, header)
        i += 1
    return Hunk(old_start, old_count, new_start, new_count, header, body), i


def _no_newline(body, name, rel, header):
    if not body or not body[-1][1].endswith("\n"):
        raise PatchError(
            f"{name}: python/sglang/{rel}: hunk {header!r}: "
            "misplaced '\\ No newline at end of file'"
        )
    tag, text = body[-1]
    body[-1] = (tag, text[:-1])


def _find_block(
    lines: Sequence[str], block: Sequence[str], expected: int, lo: int
) -> Optional[int]:
    """Index ``p >= lo`` nearest to ``expected`` with an exact match of
    ``block`` at ``lines[p:]``, or None."""
    n = len(block)
    hi = len(lines) - n  # last valid start
    if hi < lo:
        return None
    expected = min(max(expected, lo), hi)
    if n == 0:
        return expected
    first = block[0]
    for delta in range(0, max(expected - lo, hi - expected) + 1):
        for p in (expected - delta, expected + delta) if delta else (expected,):
            if lo <= p <= hi and lines[p] == first and lines[p : p + n] == block:
                return p
    return None


def _mismatch_hint(lines: Sequence[str], block: Sequence[str], at: int) -> str:
    at = max(0, min(at, len(lines)))
    for k, want in enumerate(block):
        have = lines[at + k] if at + k < len(lines) else None
        if have != want:
            return (
                f"at line {at + k + 1} expected {want.rstrip(chr(10))!r}, "
                f"found {have.rstrip(chr(10)) if have is not None else '<EOF>'!r}"
            )
    return "context found only before an earlier hunk"


def apply_file_patch(
    content: Optional[str], fp: FilePatch, reverse: bool, patch_name: str
) -> Optional[str]:
    """Apply one file's hunks to ``content`` (None: file absent).

    Returns the new content, or None when the result is a deleted file.
    Raises PatchError naming the file and hunk on any mismatch.
    """
    src_path = fp.new_path if reverse else fp.old_path
    dst_path = fp.old_path if reverse else fp.new_path
    where = f"{patch_name}: {fp.display_path}"
    if src_path is None:
        if content is not None:
            raise PatchError(f"{where}: file should not exist but does")
        content = ""
    elif content is None:
        raise PatchError(f"{where}: file does not exist")
    lines = split_lines(content)
    out: List[str] = []
    pos = 0
    drift = 0
    for k, hunk in enumerate(fp.hunks, 1):
        old = hunk.new_lines() if reverse else hunk.old_lines()
        new = hunk.old_lines() if reverse else hunk.new_lines()
        start = hunk.new_start if reverse else hunk.old_start
        nominal = start - 1 if old else start
        found = _find_block(lines, old, nominal + drift, pos)
        if found is None:
            hint = _mismatch_hint(lines, old, nominal + drift)
            raise PatchError(
                f"{where}: hunk #{k} {hunk.header} does not "
                f"{'reverse-' if reverse else ''}apply ({hint})"
            )
        out.extend(lines[pos:found])
        out.extend(new)
        pos = found + len(old)
        drift = found - nominal
    out.extend(lines[pos:])
    result = "".join(out)
    if dst_path is None:
        if result:
            raise PatchError(f"{where}: file should be empty after deletion")
        return None
    return result


def apply_patch_to_state(
    state: "FileState", patch: Patch, reverse: bool = False
) -> Dict[str, Optional[str]]:
    """Apply a whole patch on top of ``state`` without changing it; returns
    the new contents of the touched files. All or nothing."""
    result = {}
    for fp in patch.files:
        result[fp.rel] = apply_file_patch(state.get(fp.rel), fp, reverse, patch.name)
    return result


# ---------------------------------------------------------------------------
# Unified diff writer (for --export).
# ---------------------------------------------------------------------------


def _format_range(start: int, stop: int) -> str:
    beginning = start + 1
    length = stop - start
    if length == 1:
        return str(beginning)
    if not length:
        beginning -= 1
    return f"{beginning},{length}"


def _diff_line(tag: str, text: str) -> str:
    if text.endswith("\n"):
        return tag + text
    return tag + text + "\n\\ No newline at end of file\n"


def unified_diff(
    old: Optional[str], new: Optional[str], rel: str, context: int = 3
) -> str:
    """A git-style unified diff of one package file (None: absent)."""
    a = split_lines(old or "")
    b = split_lines(new or "")
    path = "python/sglang/" + rel
    out = [f"diff --git a/{path} b/{path}\n"]
    if old is None:
        out.append("new file mode 100644\n")
    elif new is None:
        out.append("deleted file mode 100644\n")
    out.append(f"--- {'a/' + path if old is not None else DEV_NULL}\n")
    out.append(f"+++ {'b/' + path if new is not None else DEV_NULL}\n")
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    groups = list(matcher.get_grouped_opcodes(context))
    if not groups:
        return ""
    for group in groups:
        first, last = group[0], group[-1]
        old_range = _format_range(first[1], last[2])
        new_range = _format_range(first[3], last[4])
        out.append(f"@@ -{old_range} +{new_range} @@\n")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out.extend(_diff_line(" ", line) for line in a[i1:i2])
                continue
            if tag in ("replace", "delete"):
                out.extend(_diff_line("-", line) for line in a[i1:i2])
            if tag in ("replace", "insert"):
                out.extend(_diff_line("+", line) for line in b[j1:j2])
    return "".join(out)


# ---------------------------------------------------------------------------
# Series, modules, manifest.
# ---------------------------------------------------------------------------


def read_series(patches_dir: Path) -> List[Patch]:
    series = patches_dir / "series"
    if not series.is_file():
        return []
    patches = []
    for raw in _decode(series.read_bytes()).split("\n"):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name = line.split()[0]
        path = patches_dir / name
        if not path.is_file():
            raise PatchError(f"{series} lists {name}, which does not exist")
        patches.append(parse_patch(_decode(path.read_bytes()), name))
    return patches


_IGNORED_MODULE_NAMES = re.compile(r"(^\.|~$|\.py[co]$|\.sw[po]$|\.orig$|\.rej$)")


def patches_dir_for(version: str) -> Path:
    """The patch series of one supported sglang release."""
    return PATCHES_ROOT / version


def bench_hooks(version: str) -> Tuple[Dict[str, bytes], List[Patch]]:
    """The benchmark-only modules and patches (``--with-bench-hooks``) of one
    supported sglang release; refused where that release has none yet."""
    series = read_series(BENCH_HOOKS_ROOT / version)
    if not series:
        raise RefusedError(
            f"no benchmark hooks for sglang {version} yet "
            f"({BENCH_HOOKS_ROOT / version / 'series'} lists no patch)"
        )
    modules = {rel: path.read_bytes() for rel, path in BENCH_HOOKS_MODULES.items()}
    return modules, series


def list_modules(modules_dir: Path) -> Dict[str, bytes]:
    """Package-relative path -> bytes of every module file to install."""
    modules: Dict[str, bytes] = {}
    if not modules_dir.is_dir():
        return modules
    for root, dirs, files in os.walk(modules_dir):
        dirs[:] = sorted(
            d for d in dirs if d != "__pycache__" and not d.startswith(".")
        )
        for name in sorted(files):
            if _IGNORED_MODULE_NAMES.search(name):
                continue
            path = Path(root) / name
            rel = path.relative_to(modules_dir).as_posix()
            modules[rel] = path.read_bytes()
    return modules


@dataclasses.dataclass
class Target:
    sglang_dir: Path
    package_dir: Path
    layout: str  # "package" or "checkout"
    checkout_root: Optional[Path] = None

    @property
    def manifest_path(self) -> Path:
        return self.package_dir / MANIFEST_NAME

    def describe(self) -> str:
        kind = "git checkout" if self.layout == "checkout" else "installed package"
        return f"{self.package_dir} ({kind})"


def find_target(sglang_dir: Path) -> Target:
    sglang_dir = sglang_dir.resolve()
    if (sglang_dir / "python" / "sglang" / "version.py").is_file():
        return Target(
            sglang_dir, sglang_dir / "python" / "sglang", "checkout", sglang_dir
        )
    if (sglang_dir / "sglang" / "version.py").is_file():
        return Target(sglang_dir, sglang_dir / "sglang", "package")
    if sglang_dir.name == "sglang" and (sglang_dir / "version.py").is_file():
        return Target(sglang_dir, sglang_dir, "package")
    raise RefusedError(
        f"no sglang found in {sglang_dir}: expected {sglang_dir}/sglang/version.py "
        f"(installed package) or {sglang_dir}/python/sglang/version.py (checkout)"
    )


def _literal_version(path: Path) -> Optional[str]:
    if not path.is_file():
        return None
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if "__version__" in names and isinstance(node.value, ast.Constant):
                if isinstance(node.value.value, str):
                    return node.value.value
        elif isinstance(node, ast.AnnAssign):
            if (
                isinstance(node.target, ast.Name)
                and node.target.id == "__version__"
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                return node.value.value
    return None


def _git_dir(root: Path) -> Optional[Path]:
    dot_git = root / ".git"
    if dot_git.is_dir():
        return dot_git
    if dot_git.is_file():  # worktree / submodule: "gitdir: PATH"
        text = dot_git.read_text().strip()
        if text.startswith("gitdir:"):
            path = Path(text[len("gitdir:") :].strip())
            return path if path.is_absolute() else (root / path).resolve()
    return None


def _git_head_tags(root: Path) -> Optional[List[str]]:
    """Tags pointing at HEAD, read from .git without the git binary.

    Returns None when that cannot be decided (e.g. annotated tags in packs).
    """
    git_dir = _git_dir(root)
    if git_dir is None:
        return []
    common = git_dir
    if (git_dir / "commondir").is_file():
        common = (git_dir / (git_dir / "commondir").read_text().strip()).resolve()
    packed: Dict[str, str] = {}
    peeled: Dict[str, str] = {}
    packed_refs = common / "packed-refs"
    if packed_refs.is_file():
        last = None
        for line in packed_refs.read_text().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line.startswith("^") and last:
                peeled[last] = line[1:].strip()
                continue
            sha, _, ref = line.partition(" ")
            packed[ref.strip()] = sha.strip()
            last = ref.strip()

    def resolve(ref: str, depth: int = 0) -> Optional[str]:
        if depth > 5:
            return None
        for base in (git_dir, common):
            path = base / ref
            if path.is_file():
                value = path.read_text().strip()
                if value.startswith("ref:"):
                    return resolve(value[4:].strip(), depth + 1)
                return value
        return packed.get(ref)

    head = resolve("HEAD")
    if head is None:
        return None
    tags = {}
    tags_dir = common / "refs" / "tags"
    if tags_dir.is_dir():
        for path in tags_dir.rglob("*"):
            if path.is_file():
                tags[path.relative_to(tags_dir).as_posix()] = path.read_text().strip()
    for ref, sha in packed.items():
        if ref.startswith("refs/tags/"):
            tags.setdefault(ref[len("refs/tags/") :], sha)
    found = []
    for tag, sha in tags.items():
        target = peeled.get("refs/tags/" + tag, sha)
        if target == head:
            found.append(tag)
            continue
        obj = common / "objects" / sha[:2] / sha[2:]
        if obj.is_file():  # loose annotated tag object: "tag N\0object SHA\n..."
            try:
                data = zlib.decompress(obj.read_bytes())
            except zlib.error:
                continue
            if data.startswith(b"tag "):
                body = data.split(b"\0", 1)[1]
                if body.startswith(b"object ") and body[7:47].decode() == head:
                    found.append(tag)
        elif tag.lstrip("v") in SUPPORTED_VERSIONS:
            return None  # a tag we care about is packed: cannot peel it here
    return found


def _git_binary_tags(root: Path) -> List[str]:
    git = shutil.which("git")
    if git is None:
        return []
    proc = subprocess.run(
        [git, "-C", str(root), "tag", "--points-at", "HEAD"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    return proc.stdout.split() if proc.returncode == 0 else []


def read_version(target: Target) -> Tuple[Optional[str], str]:
    """(version or None, where it was read from)."""
    pkg = target.package_dir
    version = _literal_version(pkg / "version.py")
    if version:
        return version, str(pkg / "version.py")
    version = _literal_version(pkg / "_version.py")
    if version:
        return version, str(pkg / "_version.py")
    if target.checkout_root is not None:
        tags = _git_head_tags(target.checkout_root)
        if tags is None:
            tags = _git_binary_tags(target.checkout_root)
        versions = sorted(
            t[1:] if t.startswith("v") else t
            for t in tags
            if re.match(r"^v?\d+\.\d+", t)
        )
        supported = [v for v in versions if v in SUPPORTED_VERSIONS]
        if supported:
            return supported[-1], f"git tag at HEAD of {target.checkout_root}"
        if versions:
            return versions[-1], f"git tag at HEAD of {target.checkout_root}"
    return None, f"{pkg / 'version.py'} (no __version__ literal, no _version.py)"


def _supported() -> str:
    return ", ".join(SUPPORTED_VERSIONS)


def check_version(target: Target, ignore: bool) -> str:
    version, source = read_version(target)
    if version in SUPPORTED_VERSIONS:
        return version
    if ignore:
        print(
            f"warning: sglang version {version or 'unknown'} (from {source}) is not "
            f"one of {_supported()}; continuing because of --ignore-version"
        )
        return version or "unknown"
    if version in DROPPED_VERSIONS:
        raise RefusedError(
            f"refusing to touch {target.package_dir}: it is sglang {version} "
            f"(read from {source}): {DROPPED_VERSIONS[version]}"
        )
    if version is None:
        raise RefusedError(
            f"cannot tell which sglang version {target.package_dir} is: {source}; "
            f"this patch set supports sglang {_supported()} "
            "(use --ignore-version to go ahead anyway)"
        )
    raise RefusedError(
        f"refusing to touch {target.package_dir}: it is sglang {version} "
        f"(read from {source}), but this patch set supports sglang {_supported()} "
        f"only (a series in {PATCHES_ROOT}/<version>/ for each)"
    )


def series_version(version: str, patches_dir: Optional[Path]) -> Optional[str]:
    """The supported release whose series (bench hooks, pristine wheel) goes
    in: the one a ``--patches-dir .../<version>`` names, else the target's;
    None when neither is supported (a ``--patches-dir`` of one's own)."""
    if patches_dir is not None and patches_dir.resolve().name in SUPPORTED_VERSIONS:
        return patches_dir.resolve().name
    return version if version in SUPPORTED_VERSIONS else None


def resolve_patches_dir(version: str, patches_dir: Optional[Path]) -> Path:
    """``--patches-dir`` when given, else the series of the target's version."""
    if patches_dir is not None:
        return patches_dir
    if version not in SUPPORTED_VERSIONS:
        raise RefusedError(
            f"sglang {version} has no patch series here (supported: {_supported()}); "
            "name one with --patches-dir"
        )
    return patches_dir_for(version)


class _AllFiles:
    """Stands for an unknown list of upstream files: every file may be one."""

    def __contains__(self, rel: str) -> bool:
        return True


def upstream_file_list(target: Target, version: str):
    """Package-relative paths of the upstream files: from the wheel's RECORD
    for an installed package; unknown (every file counts) otherwise."""
    if target.layout != "package":
        return _AllFiles()
    record = target.package_dir.parent / f"sglang-{version}.dist-info" / "RECORD"
    if not record.is_file():
        return _AllFiles()
    files = set()
    with open(record, newline="") as f:
        for row in csv.reader(f):
            if row and row[0].startswith("sglang/"):
                files.add(row[0][len("sglang/") :])
    return files


def load_manifest(target: Target) -> Optional[dict]:
    path = target.manifest_path
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise RefusedError(f"{path} is corrupt ({exc}); remove it by hand") from exc
    if manifest.get("format") != MANIFEST_FORMAT:
        raise RefusedError(f"{path} has an unknown format; remove it by hand")
    return manifest


def dump_manifest(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


class FileState:
    """In-memory view of package files: disk contents overlaid by edits."""

    def __init__(self, package_dir: Path):
        self.package_dir = package_dir
        self.disk: Dict[str, Optional[str]] = {}
        self.current: Dict[str, Optional[str]] = {}

    def read_disk(self, rel: str) -> Optional[str]:
        if rel not in self.disk:
            path = self.package_dir / rel
            self.disk[rel] = _decode(path.read_bytes()) if path.is_file() else None
        return self.disk[rel]

    def get(self, rel: str) -> Optional[str]:
        if rel in self.current:
            return self.current[rel]
        return self.read_disk(rel)

    def update(self, changes: Dict[str, Optional[str]]) -> None:
        self.current.update(changes)

    def copy(self) -> "FileState":
        other = FileState(self.package_dir)
        other.disk = self.disk
        other.current = dict(self.current)
        return other

    def changed(self) -> Dict[str, Optional[str]]:
        return {
            rel: text
            for rel, text in sorted(self.current.items())
            if text != self.read_disk(rel)
        }


# ---------------------------------------------------------------------------
# Planning (pure) and execution.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    writes: Dict[str, bytes] = dataclasses.field(default_factory=dict)
    deletes: List[str] = dataclasses.field(default_factory=list)
    rmdirs: List[str] = dataclasses.field(default_factory=list)
    manifest: Optional[bytes] = None  # bytes to write; None: remove it
    manifest_changed: bool = False
    actions: List[str] = dataclasses.field(default_factory=list)  # what changes
    notes: List[str] = dataclasses.field(default_factory=list)  # what does not
    errors: List[str] = dataclasses.field(default_factory=list)

    @property
    def has_changes(self) -> bool:
        return bool(self.writes or self.deletes or self.rmdirs or self.manifest_changed)


def _patch_status(state: FileState, patch: Patch) -> Tuple[str, Optional[dict], str]:
    """('pending', forward result) / ('applied', None) / ('conflict', None)."""
    forward_error = reverse_error = ""
    try:
        forward = apply_patch_to_state(state, patch)
    except PatchError as exc:
        forward, forward_error = None, str(exc)
    try:
        apply_patch_to_state(state, patch, reverse=True)
        reverse_ok = True
    except PatchError as exc:
        reverse_ok, reverse_error = False, str(exc)
    if forward is not None and not reverse_ok:
        return "pending", forward, ""
    if forward is None and reverse_ok:
        return "applied", None, ""
    if forward is not None and reverse_ok:
        return (
            "conflict",
            None,
            f"{patch.name}: cannot tell whether it is applied "
            "(it applies both forward and in reverse)",
        )
    return "conflict", None, forward_error + f"\n  (and not applied: {reverse_error})"


def _manifest_is_current(state: FileState, manifest: dict) -> bool:
    """True when the patched files on disk are what the manifest recorded."""
    for rel, digest in manifest.get("patched", {}).items():
        if sha256_text(state.read_disk(rel)) != digest:
            return False
    return True


def _patches_from_manifest(manifest: dict) -> List[Patch]:
    return [parse_patch(p["text"], p["name"]) for p in manifest.get("patches", [])]


def _touched(patches: Sequence[Patch]) -> List[str]:
    return sorted({fp.rel for p in patches for fp in p.files})


def _pycache_for(package_dir: Path, rel: str) -> List[Path]:
    path = package_dir / rel
    if path.suffix != ".py":
        return []
    cache = path.parent / "__pycache__"
    if not cache.is_dir():
        return []
    return sorted(cache.glob(path.stem + ".*.pyc"))


def plan_apply(
    target: Target, modules: Dict[str, bytes], series: List[Patch], version: str
) -> Plan:
    plan = Plan()
    pkg = target.package_dir
    manifest = load_manifest(target) or {}
    old_modules: Dict[str, str] = manifest.get("modules", {})
    old_created_dirs: List[str] = manifest.get("created_dirs", [])
    patched_rels = set(_touched(series))
    upstream_files = upstream_file_list(target, version)

    # Modules.
    new_modules: Dict[str, str] = {}
    created_dirs = set(old_created_dirs)
    for rel, data in sorted(modules.items()):
        dest = pkg / rel
        if rel in patched_rels:
            plan.errors.append(
                f"python/sglang/{rel} is both a new module and patched by the series"
            )
            continue
        if dest.is_dir():
            plan.errors.append(f"module {rel}: {dest} is a directory")
            continue
        exists = dest.is_file()
        if rel not in old_modules and exists and rel not in upstream_files:
            # Not ours on record, but not an upstream file either (copied in
            # by hand, or left by a lost manifest): take it over.
            plan.notes.append(f"module {rel}: not an upstream file, taking it over")
        elif rel not in old_modules and exists:
            if dest.read_bytes() == data:
                plan.notes.append(
                    f"module {rel}: identical to the upstream file, left alone"
                )
                continue
            plan.errors.append(
                f"module {rel} would overwrite the upstream file {dest}; "
                "edit upstream files through a patch in patches/ instead"
            )
            continue
        new_modules[rel] = sha256_bytes(data)
        if exists and dest.read_bytes() == data:
            continue
        plan.writes[rel] = data
        plan.actions.append(f"{'update' if exists else 'add'} module {rel}")
        parent = Path(rel).parent
        while parent != Path(".") and not (pkg / parent).is_dir():
            created_dirs.add(parent.as_posix())
            parent = parent.parent
    for rel in sorted(set(old_modules) - set(new_modules) - set(modules)):
        if (pkg / rel).is_file():
            plan.deletes.append(rel)
            plan.actions.append(f"remove module {rel} (no longer in the repo)")
    unchanged = len(new_modules) - sum(1 for r in plan.writes if r in new_modules)
    if unchanged:
        plan.notes.append(f"{unchanged} module(s) already up to date")

    # Directories we created that no longer hold a module of ours.
    needed_dirs = set()
    for rel in new_modules:
        parent = Path(rel).parent
        while parent != Path("."):
            needed_dirs.add(parent.as_posix())
            parent = parent.parent
    keep_dirs = sorted(d for d in created_dirs if d in needed_dirs)
    for d in sorted(created_dirs - needed_dirs, key=lambda d: -d.count("/")):
        plan.rmdirs.append(d)

    # Patches.
    state = FileState(pkg)
    old_patches = _patches_from_manifest(manifest) if manifest else []
    use_manifest = bool(manifest) and _manifest_is_current(state, manifest)
    if manifest and not use_manifest:
        plan.notes.append(
            "patched files differ from what the last run recorded (sglang "
            "reinstalled or edited?): reading the patch state from the files"
        )
    applied: List[Patch] = []
    if use_manifest:
        k = 0
        while (
            k < min(len(old_patches), len(series))
            and old_patches[k].name == series[k].name
            and old_patches[k].sha256 == series[k].sha256
        ):
            k += 1
        for patch in reversed(old_patches[k:]):
            try:
                state.update(apply_patch_to_state(state, patch, reverse=True))
            except PatchError as exc:
                plan.errors.append(f"cannot take back the old {exc}")
                return plan
            changed = patch.name in {p.name for p in series[k:]}
            plan.actions.append(
                f"take back patch {patch.name} as applied last time"
                + (" (it changed since)" if changed else " (no longer in the series)")
            )
        for patch in series[:k]:
            plan.notes.append(f"patch {patch.name}: already applied")
            applied.append(patch)
        todo = series[k:]
    else:
        todo = series
    for patch in todo:
        if use_manifest:
            try:
                result = apply_patch_to_state(state, patch)
                status, message = "pending", ""
            except PatchError as exc:
                result, status, message = None, "conflict", str(exc)
        else:
            status, result, message = _patch_status(state, patch)
        if status == "conflict":
            plan.errors.append(message)
            continue
        if status == "applied":
            plan.notes.append(f"patch {patch.name}: already applied")
        else:
            state.update(result)
            hunks = sum(len(fp.hunks) for fp in patch.files)
            plan.actions.append(
                f"apply patch {patch.name} ({len(patch.files)} file(s), "
                f"{hunks} hunk(s))"
            )
        applied.append(patch)
    if plan.errors:
        return plan

    # The pristine content of every touched file: take the whole series back
    # in memory. This also proves that --revert will work.
    pristine = state.copy()
    try:
        for patch in reversed(applied):
            pristine.update(apply_patch_to_state(pristine, patch, reverse=True))
    except PatchError as exc:
        plan.errors.append(f"the series does not reverse cleanly: {exc}")
        return plan
    old_upstream = manifest.get("upstream", {}) if use_manifest else {}
    upstream = {}
    for rel in _touched(applied):
        upstream[rel] = sha256_text(pristine.get(rel))
        if rel in old_upstream and old_upstream[rel] != upstream[rel]:
            plan.errors.append(
                f"python/sglang/{rel} no longer reverses to the upstream file "
                "recorded at the first apply"
            )
    # Files that earlier patches touched and the series no longer does must
    # be back to upstream.
    for rel, digest in old_upstream.items():
        if rel not in upstream and sha256_text(state.get(rel)) != digest:
            plan.errors.append(
                f"python/sglang/{rel}: not back to upstream after taking back "
                "patches no longer in the series"
            )
    if plan.errors:
        return plan

    _plan_file_changes(plan, state)

    new_manifest = {
        "format": MANIFEST_FORMAT,
        "tool": "scripts/apply_patch.py (decode-side NSA KV offload)",
        "sglang_version": version,
        "modules": new_modules,
        "created_dirs": keep_dirs,
        "patches": [
            {"name": p.name, "sha256": p.sha256, "text": p.text} for p in applied
        ],
        "patched": {rel: sha256_text(state.get(rel)) for rel in _touched(applied)},
        "upstream": upstream,
    }
    data = dump_manifest(new_manifest)
    old_data = target.manifest_path.read_bytes() if manifest else None
    plan.manifest = data
    plan.manifest_changed = data != old_data
    return plan


def plan_revert(
    target: Target, modules: Dict[str, bytes], series: List[Patch], version: str
) -> Plan:
    plan = Plan()
    pkg = target.package_dir
    manifest = load_manifest(target)
    state = FileState(pkg)

    if manifest is not None and _manifest_is_current(state, manifest):
        applied = _patches_from_manifest(manifest)
        upstream = manifest.get("upstream", {})
        our_modules = sorted(manifest.get("modules", {}))
        created_dirs = manifest.get("created_dirs", [])
    else:
        if manifest is not None:
            plan.notes.append(
                "patched files differ from what the last run recorded: "
                "reading the patch state from the files"
            )
        applied = []
        probe = state.copy()
        for patch in series:
            status, result, message = _patch_status(probe, patch)
            if status == "conflict":
                plan.errors.append(message)
            elif status == "applied":
                applied.append(patch)
            else:
                probe.update(result)
        upstream = {}
        if manifest is not None:
            our_modules = sorted(manifest.get("modules", {}))
            created_dirs = manifest.get("created_dirs", [])
        else:
            # No record: remove only files identical to the repo's modules
            # that are not upstream files (an empty file may well be one).
            upstream_files = upstream_file_list(target, version)
            known = not isinstance(upstream_files, _AllFiles)
            our_modules = [
                rel
                for rel, data in sorted(modules.items())
                if (pkg / rel).is_file()
                and (pkg / rel).read_bytes() == data
                and (rel not in upstream_files if known else data != b"")
            ]
            created_dirs = []
    if plan.errors:
        return plan

    for patch in reversed(applied):
        try:
            state.update(apply_patch_to_state(state, patch, reverse=True))
        except PatchError as exc:
            plan.errors.append(str(exc))
            return plan
        plan.actions.append(f"revert patch {patch.name}")
    for rel, digest in sorted(upstream.items()):
        if sha256_text(state.get(rel)) != digest:
            plan.errors.append(
                f"python/sglang/{rel}: the reverted file is not byte for byte the "
                "upstream file recorded at apply time"
            )
    if plan.errors:
        return plan
    _plan_file_changes(plan, state)

    for rel in our_modules:
        if (pkg / rel).is_file():
            plan.deletes.append(rel)
            plan.actions.append(f"remove module {rel}")
    plan.rmdirs = sorted(created_dirs, key=lambda d: (-d.count("/"), d))
    plan.manifest = None
    plan.manifest_changed = manifest is not None
    if plan.manifest_changed:
        plan.actions.append(f"remove the record {MANIFEST_NAME}")
    return plan


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o7777 if path.exists() else None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def execute(target: Target, plan: Plan) -> None:
    pkg = target.package_dir
    for rel, data in sorted(plan.writes.items()):
        for pyc in _pycache_for(pkg, rel):
            pyc.unlink()
        _atomic_write(pkg / rel, data)
    for rel in plan.deletes:
        for pyc in _pycache_for(pkg, rel):
            pyc.unlink()
        path = pkg / rel
        if path.is_file():
            path.unlink()
    for rel in plan.rmdirs:
        path = pkg / rel
        if not path.is_dir():
            continue
        cache = path / "__pycache__"
        entries = [e for e in os.listdir(path) if e != "__pycache__"]
        if entries:
            print(f"warning: leaving {path}: it holds files that are not ours")
            continue
        if cache.is_dir():
            shutil.rmtree(cache)
        path.rmdir()
    if plan.manifest_changed:
        if plan.manifest is None:
            if target.manifest_path.exists():
                target.manifest_path.unlink()
        else:
            _atomic_write(target.manifest_path, plan.manifest)


def report(plan: Plan, dry_run: bool, what: str) -> None:
    for note in plan.notes:
        print(f"  {note}")
    for action in plan.actions:
        print(f"  {'would ' if dry_run else ''}{action}")
    for error in plan.errors:
        for k, line in enumerate(error.splitlines()):
            print(f"  {'ERROR: ' if k == 0 else '  '}{line}")
    done = "reverted" if what == "revert" else "up to date"
    what = f"check {what}" if dry_run else what
    if plan.errors:
        verb = "would fail" if dry_run else "failed, nothing was written"
        print(f"{what} {verb}: {len(plan.errors)} problem(s)")
    elif not plan.has_changes:
        print(f"{what}: nothing to do (already {done})")
    elif dry_run:
        print(f"{what}: dry run, nothing written")
    else:
        print(f"{what}: done")


# ---------------------------------------------------------------------------
# Pristine wheel and --export.
# ---------------------------------------------------------------------------


def ensure_pristine(version: str, cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Path of a pristine sglang ``version`` package (``.../sglang``) from the
    PyPI wheel, downloaded with pip into ``cache_dir`` once (per version)."""
    if version not in SUPPORTED_VERSIONS:
        raise RefusedError(f"no pristine wheel for sglang {version}: not supported")
    root = cache_dir / f"sglang-{version}"
    stamp = root / ".complete"
    if stamp.is_file():
        return root / "sglang"
    wheel_dir = cache_dir / "wheels"
    pattern = str(wheel_dir / f"sglang-{version}-*.whl")
    wheels = sorted(glob.glob(pattern))
    if not wheels:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-d",
            str(wheel_dir),
            f"sglang=={version}",
        ]
        pip = [sys.executable, "-m", "pip"]
        probe = subprocess.run(pip + ["--version"], capture_output=True)
        if probe.returncode != 0:
            exe = shutil.which("pip3") or shutil.which("pip")
            if exe is None:
                raise RefusedError("pip is needed to download the sglang wheel")
            pip = [exe]
        subprocess.run(pip + cmd, check=True, stdout=subprocess.DEVNULL)
        wheels = sorted(glob.glob(pattern))
        if not wheels:
            raise RefusedError(f"pip download gave no wheel matching {pattern}")
    tmp = Path(tempfile.mkdtemp(prefix=".sglang-", dir=cache_dir))
    try:
        with zipfile.ZipFile(wheels[0]) as zf:
            for member in zf.infolist():
                if member.filename.startswith("sglang/") and not member.is_dir():
                    zf.extract(member, tmp)
        (tmp / ".complete").write_text(Path(wheels[0]).name + "\n")
        if root.exists():
            shutil.rmtree(root)
        os.replace(tmp, root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return root / "sglang"


def _normalize_rel(path: str) -> str:
    path = path.strip()
    if path.startswith("./"):
        path = path[2:]
    for prefix in ("a/", "b/"):
        if path.startswith(prefix + "python/sglang/"):
            path = path[len(prefix) :]
    for prefix in PATCH_PATH_PREFIXES:
        if path.startswith(prefix):
            return path[len(prefix) :]
    return path


def export_patch(
    target: Target,
    name: str,
    files: Optional[List[str]],
    patches_dir: Path,
    pristine_dir: Path,
) -> Path:
    if not name.endswith((".patch", ".diff")):
        name += ".patch"
    if "/" in name:
        raise RefusedError(f"--export takes a file name, not a path: {name}")
    out_path = patches_dir / name
    series = read_series(patches_dir)
    existing = None
    if out_path.is_file():
        existing = parse_patch(_decode(out_path.read_bytes()), name)
    if not files:
        if existing is None:
            raise RefusedError(f"{out_path} does not exist: name the --files to diff")
        files = [fp.rel for fp in existing.files]
    rels = list(dict.fromkeys(_normalize_rel(f) for f in files))  # keep order

    # Base: pristine upstream with every other patch of the series applied.
    others = [p for p in series if p.name != name]
    base = FileState(pristine_dir)
    for patch in others:
        relevant = [fp for fp in patch.files if fp.rel in rels]
        if relevant:
            sub = Patch(patch.name, patch.text, relevant)
            base.update(apply_patch_to_state(base, sub))
    edited = FileState(target.package_dir)
    chunks = []
    for rel in rels:
        if base.get(rel) is None and edited.get(rel) is None:
            raise RefusedError(f"python/sglang/{rel} exists in neither tree")
        diff = unified_diff(base.get(rel), edited.get(rel), rel)
        if diff:
            chunks.append(diff)
        else:
            print(f"  python/sglang/{rel}: no changes against upstream")
    if not chunks:
        raise RefusedError("nothing to export: the files equal upstream")
    preamble = existing.preamble if existing is not None else ""
    text = preamble + "".join(chunks)
    new_patch = parse_patch(text, name)

    # Check: the full series (with the new patch in its place) reproduces the
    # edited files from pristine upstream.
    names = [p.name for p in series]
    full = [new_patch if p.name == name else p for p in series]
    if name not in names:
        full.append(new_patch)
    check = FileState(pristine_dir)
    for patch in full:
        relevant = [fp for fp in patch.files if fp.rel in rels]
        if relevant:
            check.update(apply_patch_to_state(check, Patch(patch.name, "", relevant)))
    for rel in rels:
        if check.get(rel) != edited.get(rel):
            raise RefusedError(
                f"python/sglang/{rel}: the series with the exported patch does not "
                f"reproduce the edited file (a later patch in the series touches "
                f"it too?); nothing written"
            )

    patches_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(out_path, _encode(text))
    print(f"wrote {out_path} ({len(new_patch.files)} file(s))")
    if name not in names:
        series_path = patches_dir / "series"
        old = series_path.read_bytes() if series_path.is_file() else b""
        if old and not old.endswith(b"\n"):
            old += b"\n"
        _atomic_write(series_path, old + _encode(name + "\n"))
        print(f"appended {name} to {series_path}")
    return out_path


# ---------------------------------------------------------------------------
# CLI.
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Install the decode-side NSA KV-offload modules and patch "
        f"series into sglang {' or '.join(SUPPORTED_VERSIONS)} (the series of "
        "the target's version, patches/<version>/).",
    )
    parser.add_argument(
        "--sglang-dir",
        required=True,
        type=Path,
        help="site-packages / pip --target dir (holding sglang/) or an sglang "
        "git checkout (holding python/sglang/)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--revert",
        action="store_true",
        help="restore the upstream files and remove our modules",
    )
    mode.add_argument(
        "--export",
        metavar="NAME.patch",
        help="write NAME.patch into the patches dir (patches/<version>/) from "
        "the edited files of --sglang-dir, "
        "diffed against the pristine wheel (plus the other patches)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="dry run: report what apply (or --revert) would do, write nothing",
    )
    parser.add_argument(
        "--files",
        nargs="+",
        metavar="FILE",
        help="with --export: package files to diff, e.g. srt/server_args.py",
    )
    parser.add_argument(
        "--patches-dir",
        type=Path,
        help="directory holding series and the patches (default: "
        f"{PATCHES_ROOT}/<the target's sglang version>)",
    )
    parser.add_argument(
        "--modules-dir",
        type=Path,
        default=DEFAULT_MODULES_DIR,
        help="the sglang package tree of new modules (default: %(default)s)",
    )
    parser.add_argument(
        "--pristine-dir",
        type=Path,
        help="with --export: a pristine sglang package dir to diff against "
        "(default: the wheel of the series' version, downloaded into .cache/)",
    )
    parser.add_argument(
        "--with-bench-hooks",
        action="store_true",
        help="also install the benchmark-only top-k trace override / recorder "
        "and its hook in the NSA backend, from bench_hooks/<version>/ (benchmark "
        "servers only; applying without it takes them back out)",
    )
    parser.add_argument(
        "--ignore-version",
        action="store_true",
        help=f"go ahead even when the target is not sglang {_supported()} "
        "(then name the series with --patches-dir)",
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.export and args.check:
        print("error: --check does not go with --export", file=sys.stderr)
        return EXIT_REFUSED
    if args.export and args.with_bench_hooks:
        print("error: --with-bench-hooks does not go with --export", file=sys.stderr)
        return EXIT_REFUSED
    if args.files and not args.export:
        print("error: --files goes with --export", file=sys.stderr)
        return EXIT_REFUSED
    try:
        target = find_target(args.sglang_dir)
        version = check_version(target, args.ignore_version)
        patches_dir = resolve_patches_dir(version, args.patches_dir)
        release = series_version(version, args.patches_dir)
        if (args.export and not args.pristine_dir or args.with_bench_hooks) and (
            release is None
        ):
            raise RefusedError(
                f"{patches_dir} is not the series of a supported sglang release "
                f"({_supported()}): no pristine wheel or benchmark hooks for it"
            )
        if args.export:
            pristine = args.pristine_dir or ensure_pristine(release)
            if (pristine / "sglang" / "version.py").is_file():
                pristine = pristine / "sglang"
            export_patch(target, args.export, args.files, patches_dir, pristine)
            return EXIT_OK
        series = read_series(patches_dir)
        modules = list_modules(args.modules_dir)
        if args.with_bench_hooks:
            bench_modules, bench_series = bench_hooks(release)
            modules.update(bench_modules)
            series += bench_series
        what = "revert" if args.revert else "apply"
        print(
            f"{'check ' if args.check else ''}{what}: sglang {version} at "
            f"{target.describe()}; {len(modules)} module(s), "
            f"{len(series)} patch(es) in {patches_dir}"
        )
        if args.revert:
            plan = plan_revert(target, modules, series, version)
        else:
            plan = plan_apply(target, modules, series, version)
        report(plan, args.check, what)
        if plan.errors:
            return EXIT_FAILED
        if not args.check and plan.has_changes:
            execute(target, plan)
        return EXIT_OK
    except RefusedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except PatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
