"""The planner imports downward only: no import circle among its modules, and nothing of what stands above it (the
dry run and the trainer import the planner). Read from the source, imports inside functions included."""

import ast
from pathlib import Path

import torchtitan

PACKAGE_ROOT = Path(torchtitan.__file__).parent
PLANNER = "torchtitan.planner"
ABOVE_THE_PLANNER = ("torchtitan.dry_run", "torchtitan.train")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE_ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path) -> set[str]:
    """The modules `path` imports: `from package import module` names the module, `from module import name` the
    module."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            modules.update({name for name in submodules if _is_module(name)} or {node.module})
    return modules


def planner_graph() -> dict[str, set[str]]:
    files = sorted((PACKAGE_ROOT / "planner").glob("*.py"))
    return {_module_name(path): imported_modules(path) for path in files}


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle among the graph's own modules (the first module repeated at its end), or []."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        for target in sorted(graph[module] & graph.keys()):
            found = visit(target, path + [module])
            if found:
                return found
        done.add(module)
        return []

    for module in sorted(graph):
        found = visit(module, [])
        if found:
            return found
    return []


def test_the_planner_has_no_import_circle():
    assert circle(planner_graph()) == []


def test_the_planner_imports_nothing_above_it():
    upward = {module: sorted(target for target in targets if target.startswith(ABOVE_THE_PLANNER))
              for module, targets in planner_graph().items()}
    assert {module: targets for module, targets in upward.items() if targets} == {}


def test_the_check_sees_a_circle_and_imports_inside_functions(tmp_path):
    """The checks read what they must: an import made inside a function, and a circle of three."""
    source = tmp_path / "late.py"
    source.write_text("def f():\n    from torchtitan.dry_run import run\n    from torchtitan.planner import cost\n")
    assert imported_modules(source) == {"torchtitan.dry_run", "torchtitan.planner.cost"}
    assert circle({"a": {"b"}, "b": {"c", "os"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
