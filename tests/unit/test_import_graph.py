"""The layer table of docs/architecture.md ("Which package imports which") is the import graph.

The test reads the table from the document, so the two cannot drift: every module is in one row,
and imports (inside functions and under `if TYPE_CHECKING:` too) reach only the layers its row
allows. No import, wherever it stands (top level, inside a function, under `if TYPE_CHECKING:`),
closes a cycle: a cycle hidden in a function-level import still decides what loads what, and in
which order, and one through an annotation-only import is still two modules that need each other
(spec <-> validate was one: `spec_fields` now holds the types both read).
"""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("workbench", "backends")
TABLE_DOC = ROOT / "docs" / "architecture.md"


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, known: dict[str, Path], typing: bool = False) -> set[str]:
    """The package modules `name` imports anywhere in its body; with `typing`, those imported
    under `if TYPE_CHECKING:` too (names for annotations, which load nothing)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node) and not typing:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                target = f"{base}.{alias.name}"
                out.add(target if target in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in out if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_walker_counts_function_level_and_type_checking_imports(tmp_path):
    """A cycle of spec -> validate (inside a function) and validate -> spec (under TYPE_CHECKING)
    is what the package had; the walker must see both edges, or the cycle test below is blind."""
    (tmp_path / "spec.py").write_text("def load():\n    from pkg.validate import rules\n    return rules\n")
    (tmp_path / "validate.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from pkg.spec import JobSpec\nelse:\n    import pkg.base\n")
    (tmp_path / "base.py").write_text("")
    known = {f"pkg.{p.stem}": p for p in tmp_path.glob("*.py")}
    graph = {name: imports_of(name, path, known, typing=True) for name, path in known.items()}
    assert graph == {"pkg.spec": {"pkg.validate"}, "pkg.validate": {"pkg.spec", "pkg.base"}, "pkg.base": set()}
    assert cycles(graph) == [["pkg.spec", "pkg.validate"]]
    assert imports_of("pkg.validate", known["pkg.validate"], known) == {"pkg.base"}  # without typing: no edge


def test_the_package_has_no_import_cycles():
    """No cycle through any import: top-level, function-level or under `if TYPE_CHECKING:`."""
    known = modules()
    graph = {name: imports_of(name, path, known, typing=True) for name, path in known.items()}
    assert graph["workbench.cli"], "the graph found no imports: the walker is broken"
    assert {"workbench.spec_fields", "workbench.validate"} <= graph["workbench.spec"]
    assert cycles(graph) == []


# -- the layer table ------------------------------------------------------------------------------

def layer_table(text: str) -> tuple[list[str], dict[str, list[str]], dict[str, set[str]]]:
    """(layers bottom-up, the modules named in each row, the layers each row may import) from the
    markdown table under "## Which package imports which"."""
    section = text.split("## Which package imports which", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| layer ")]
    order: list[str] = []
    members: dict[str, list[str]] = {}
    allowed: dict[str, set[str]] = {}
    for row in rows:
        layer, mods, may = (cell.strip() for cell in row.strip().strip("|").split("|"))
        order.append(layer)
        members[layer] = re.findall(r"`([^`]+)`", mods)
        allowed[layer] = {part.strip() for part in may.split(";")[0].split(",")}
    return order, members, allowed


def module_name(entry: str) -> str:
    """A table entry as a module (or package) name: `spec`, `memory/`, `backends/`, `__init__`."""
    if entry == "__init__":
        return "workbench"
    entry = entry.rstrip("/")
    return entry if entry in PACKAGES else f"workbench.{entry}"


def layer_of(module: str, members: dict[str, list[str]]) -> list[str]:
    """Every layer whose row names `module` or a package above it (the test wants exactly one)."""
    found = []
    for layer, entries in members.items():
        for entry in entries:
            name = module_name(entry)
            package = entry.endswith("/")
            if (module == name or (package and module.startswith(name + "."))) and layer not in found:
                found.append(layer)
    return found


def check_layers(graph: dict[str, set[str]], members: dict[str, list[str]],
                 allowed: dict[str, set[str]]) -> list[str]:
    """One line per module outside the table (or in two rows) and per import the table forbids."""
    problems = []
    where = {}
    for module in sorted(graph):
        layers = layer_of(module, members)
        if len(layers) != 1:
            problems.append(f"{module}: in {len(layers)} rows of the layer table ({', '.join(layers) or 'none'})")
        else:
            where[module] = layers[0]
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if module in where and target in where and where[target] not in allowed[where[module]]:
                problems.append(f"{module} ({where[module]}) imports {target} ({where[target]})")
            if module.startswith("workbench.parallel.") and target.startswith("workbench.runtime."):
                problems.append(f"{module} imports {target}: parallel/ imports no runtime/ module")
    return problems


def test_the_layer_table_names_each_layer_once_and_only_layers_below_or_its_own():
    order, members, allowed = layer_table(TABLE_DOC.read_text())
    assert order[:2] == ["core", "report"] and order[-1] == "entry points", order
    for i, layer in enumerate(order):  # dependencies point one way: down the table
        assert layer in allowed[layer] and allowed[layer] <= set(order[: i + 1]), (layer, allowed[layer])


def test_check_layers_finds_upward_and_unlisted_imports():
    members = {"core": ["spec", "memory/"], "runtime": ["runtime/", "parallel/"]}
    allowed = {"core": {"core"}, "runtime": {"core", "runtime"}}
    graph = {"workbench.spec": set(), "workbench.memory.states": {"workbench.runtime.loop"},
             "workbench.runtime.loop": {"workbench.spec"}, "workbench.parallel.zero": {"workbench.runtime.loop"},
             "workbench.ui.app": set()}
    assert check_layers(graph, members, allowed) == [
        "workbench.ui.app: in 0 rows of the layer table (none)",
        "workbench.memory.states (core) imports workbench.runtime.loop (runtime)",
        "workbench.parallel.zero imports workbench.runtime.loop: parallel/ imports no runtime/ module",
    ]


def test_every_import_follows_the_layer_table():
    """Every module is in one row; imports inside functions and for annotations count."""
    _, members, allowed = layer_table(TABLE_DOC.read_text())
    known = modules()
    graph = {name: imports_of(name, path, known, typing=True) for name, path in known.items()}
    assert graph["workbench.launch"], "the graph found no imports: the walker is broken"
    assert check_layers(graph, members, allowed) == []
