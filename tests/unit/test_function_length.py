"""No function or method in `workbench/` or `backends/` is longer than 60 lines (issue 36; STYLE.md:
"functions that fit on a screen").

A function's length is its `def` line through its last line (ast: end_lineno - lineno + 1):
docstring, comments and blank lines included, decorators not. A nested function counts on its own
and inside the function that holds it. A long function is split into named parts, not wrapped.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("workbench", "backends")
MAX_LINES = 60



def long_functions(source: str, path: str, limit: int = MAX_LINES) -> dict[str, int]:
    """"path:qualified name" -> lines, for each function or method of `source` over `limit` lines."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1
                if lines > limit:
                    found[f"{path}:{name}"] = lines
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_long_functions_are_found_with_their_qualified_names():
    def body(indent: int, n: int = 59) -> str:
        return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(n))

    source = ("def short():\n" + body(4)  # 60 lines: allowed
              + "class A:\n    def long(self):\n" + body(8) + "        return 1\n"  # 61 lines
              + "    @property\n    def p(self):\n        def inner():\n" + body(12)
              + "            return 2\n        return inner\n")  # inner: 61 lines, p: 63
    assert long_functions(source, "m.py") == {"m.py:A.long": 61, "m.py:A.p.inner": 61, "m.py:A.p": 63}


def test_no_function_is_over_60_lines():
    found: dict[str, int] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found.update(long_functions(path.read_text(), path.relative_to(ROOT).as_posix()))
    assert found == {}, "split these into named parts: " + ", ".join(f"{k} ({v} lines)" for k, v in found.items())
