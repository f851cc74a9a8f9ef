"""The product's shape: no import circle among its modules (imports inside
functions count too) and the line budgets of the patch set (at most 6,000
lines in all, no module over 700), read from the sources in ``python/``."""

import ast
import unittest
from pathlib import Path

PRODUCT_DIR = Path(__file__).resolve().parents[2] / "python"
MAX_TOTAL_LINES = 6000
MAX_FILE_LINES = 700


def product_modules():
    """Module name -> source path of every product module."""
    return {
        ".".join(path.relative_to(PRODUCT_DIR).with_suffix("").parts): path
        for path in sorted(PRODUCT_DIR.rglob("*.py"))
    }


def import_graph(modules):
    """Module -> the product modules it imports (anywhere in its source)."""
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [
                    f"{node.module}.{alias.name}" for alias in node.names
                ]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def find_cycle(graph):
    """One import circle as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep) :] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


class TestProductLayout(unittest.TestCase):
    def test_no_import_circle(self):
        graph = import_graph(product_modules())
        self.assertGreater(sum(map(len, graph.values())), 10)  # the graph is read
        self.assertIsNone(find_cycle(graph))

    def test_cycle_finder_finds_one(self):
        graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
        self.assertEqual(find_cycle(graph), ["a", "b", "c", "a"])
        self.assertIsNone(find_cycle({"a": {"b"}, "b": set()}))

    def test_line_budgets(self):
        lines = {
            name: len(path.read_text().splitlines())
            for name, path in product_modules().items()
        }
        self.assertGreater(len(lines), 10)
        over = {name: n for name, n in lines.items() if n > MAX_FILE_LINES}
        self.assertEqual(over, {}, f"modules over {MAX_FILE_LINES} lines")
        self.assertLessEqual(sum(lines.values()), MAX_TOTAL_LINES)


if __name__ == "__main__":
    unittest.main()
