"""The repo's own Markdown files point at things that exist (CPU, no sglang).

Every relative link ``[text](path)`` (images too) and every backticked path
under ``benchmark/nsa_offload/results/`` must name an existing file or
folder, so that moving or deleting a results folder cannot leave a README,
a doc or the results index pointing at nothing. So must a backticked path
that starts with ``../`` (relative to the file: the results READMEs name
their neighbours so) and, in ``benchmark/nsa_offload/*.md``, one that starts
with ``results/``. Globs (``run*/``, ``{a,b}``) must match something. Links
inside fenced code blocks and inline code are not links; ``http(s)://``,
``mailto:`` and ``#anchor`` links are not checked. Hidden folders (``.venv``,
``.cache``, ``.git``, ...) are skipped.
"""

import glob
import os
import re
import unittest
from pathlib import Path
from urllib.parse import unquote

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "benchmark" / "nsa_offload"
BENCH_REL = "benchmark/nsa_offload"
RESULTS_PREFIX = BENCH_REL + "/results/"

FENCE_RE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1[^\S\n]*$", re.M | re.S)
CODE_SPAN_RE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
# [text](target) or ![alt](target); the target may be <...> and carry a title.
LINK_RE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]+)")
SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
TRAILING = ".,;:)]'\""


def markdown_files(root: Path = REPO_ROOT):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and d != "__pycache__"
        )
        for name in sorted(filenames):
            if name.endswith(".md"):
                yield Path(dirpath) / name


def _expand_braces(pattern: str) -> list:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [
        p for alt in m.group(1).split(",") for p in _expand_braces(head + alt + tail)
    ]


def _exists(path: Path) -> bool:
    text = str(path)
    if any(c in text for c in "*?[{"):
        return any(glob.glob(p) for p in _expand_braces(text))
    return path.exists()


def references(md: Path, root: Path = REPO_ROOT):
    """(line, reference, resolved path) of every checked reference in ``md``."""
    text = md.read_text(encoding="utf-8", errors="replace")
    # Blank out fenced blocks and code spans (keeping the line count), then
    # read the links from what is left and the paths from the code spans.
    prose = FENCE_RE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    spans = []

    def blank(m):
        spans.append((prose.count("\n", 0, m.start()) + 1, m.group(2)))
        return re.sub(r"[^\n]", " ", m.group(0))

    prose = CODE_SPAN_RE.sub(blank, prose)
    for m in LINK_RE.finditer(prose):
        target = m.group(1).strip("<>")
        if not target or target.startswith("#") or SCHEME_RE.match(target):
            continue
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        base = root if path.startswith("/") else md.parent
        line = prose.count("\n", 0, m.start()) + 1
        yield line, target, (base / path.lstrip("/")).resolve()
    in_bench = md.parent.resolve() == (root / BENCH_REL).resolve()
    for line, span in spans:
        words = span.split()
        word = words[0].rstrip(TRAILING) if words else ""
        if word.startswith(RESULTS_PREFIX):
            yield line, word, root / word
        elif word.startswith("../"):
            yield line, word, md.parent / word
        elif in_bench and word.startswith("results/"):
            yield line, word, md.parent / word


def broken_references(root: Path = REPO_ROOT) -> list:
    broken = []
    for md in markdown_files(root):
        for line, ref, path in references(md, root):
            if not _exists(path):
                broken.append(f"{md.relative_to(root)}:{line}: {ref}")
    return broken


class TestDocLinks(unittest.TestCase):
    def test_every_relative_link_and_results_path_exists(self):
        broken = broken_references()
        self.assertEqual(broken, [], "broken references:\n" + "\n".join(broken))

    def test_the_results_index_is_read(self):
        # The index links every claim's folder: the check must see them.
        index = BENCH_DIR / "results" / "README.md"
        refs = [r for _, r, _ in references(index)]
        self.assertGreater(len(refs), 10)

    def test_a_broken_link_is_found(self):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            root = Path(d)
            results = root / RESULTS_PREFIX
            (results / "run1").mkdir(parents=True)
            (results / "run1" / "a.json").write_text("{}\n")
            (root / ".venv").mkdir()
            (root / ".venv" / "skipped.md").write_text("[x](missing.md)\n")
            (results / "run1" / "README.md").write_text(
                "`../run1/a.json`, `../run2/` and `results/run1/` (not checked here)\n"
            )
            (root / BENCH_REL / "README.md").write_text(
                "`results/run1/` `results/gone/` [up](../../doc.md)\n"
            )
            (root / "doc.md").write_text(
                "# t\n"
                "[ok](benchmark/) [web](https://example.com/x) [anchor](#t) "
                "[ok, anchor](doc.md#t) ![img](sub/gone.png)\n"
                "```\n[in a fence](fence/gone.md) `benchmark/nsa_offload/results/f/`\n"
                "```\n"
                "`[in code](code/gone.md)` [gone](sub/gone.md)\n"
                "`benchmark/nsa_offload/results/run*/a.json`, "
                "`benchmark/nsa_offload/results/{run1,run2}/` (globs: something "
                "matches), `benchmark/nsa_offload/results/gone/` and "
                "`benchmark/nsa_offload/results/run1/b.json`.\n"
            )
            broken = broken_references(root)
        self.assertEqual(
            broken,
            [
                "doc.md:2: sub/gone.png",
                "doc.md:6: sub/gone.md",
                "doc.md:7: benchmark/nsa_offload/results/gone/",
                "doc.md:7: benchmark/nsa_offload/results/run1/b.json",
                "benchmark/nsa_offload/README.md:1: results/gone/",
                "benchmark/nsa_offload/results/run1/README.md:1: ../run2/",
            ],
        )


if __name__ == "__main__":
    unittest.main()


def readme_budget_breaches(text: str) -> list:
    """The README's budgets: at most 120 lines; a status table (the first
    table after ``## Status``) of at most 12 rows of at most 200 characters."""
    breaches = []
    lines = text.splitlines()
    if len(lines) > 120:
        breaches.append(f"{len(lines)} lines (budget 120)")
    if "## Status" not in text:
        return breaches + ["no ## Status section"]
    status = text.split("## Status", 1)[1].split("\n## ", 1)[0]
    rows = [l for l in status.splitlines() if l.startswith("|")][2:]
    if not rows or len(rows) > 12:
        breaches.append(f"{len(rows)} status rows (budget 1-12)")
    breaches += [
        f"status row of {len(r)} characters: {r[:40]}" for r in rows if len(r) > 200
    ]
    return breaches


class TestReadmeBudget(unittest.TestCase):
    def test_readme_within_budget(self):
        text = (REPO_ROOT / "README.md").read_text()
        self.assertEqual(readme_budget_breaches(text), [])

    def test_breaches_are_found(self):
        table = "## Status\n\n| a | b |\n|---|---|\n"
        self.assertEqual(readme_budget_breaches(table + "| x |\n"), [])
        self.assertEqual(len(readme_budget_breaches(table + "| x |\n" * 13)), 1)
        self.assertEqual(
            len(readme_budget_breaches(table + "|" + "x" * 200 + "|\n")), 1
        )
        self.assertEqual(len(readme_budget_breaches("\n" * 121 + table + "| x |\n")), 1)
        self.assertEqual(readme_budget_breaches("no table"), ["no ## Status section"])
