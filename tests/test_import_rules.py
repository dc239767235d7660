"""The workspace's import rules, checked on the source of every module:

- a package imports only packages below it in the stack (planner < io < kernels < optim <
  storage < torchrec), and only those its ``pyproject.toml`` declares;
- no package imports another package's private names (a module or a name starting with ``_``);
- no import cycle between the modules of one package, counting imports under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STACK = ["demb_planner", "demb_io", "demb_kernels", "demb_optim", "demb_storage", "demb_torchrec"]
LEVEL = {"demb_planner": 0, "demb_io": 1, "demb_kernels": 2, "demb_optim": 3, "demb_storage": 4}
LEVEL["demb_torchrec"] = 5


def _modules(package: str) -> dict[str, Path]:
    src = ROOT / "packages" / package.replace("_", "-") / "src"
    found = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str) -> list[tuple[str, list[str], bool]]:
    """(imported module, names imported from it, under TYPE_CHECKING) for every import."""
    tree = ast.parse(path.read_text())
    package_parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[str, list[str], bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for inner in child.body:
                    visit_one(inner, True)
                for inner in child.orelse:
                    visit_one(inner, typing_only)
                continue
            visit_one(child, typing_only)

    def visit_one(child: ast.AST, typing_only: bool) -> None:
        if isinstance(child, ast.Import):
            found.extend((alias.name, [], typing_only) for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:
                base = ".".join([*package_parts[: len(package_parts) - child.level + 1], base])
            found.append((base.strip("."), [a.name for a in child.names], typing_only))
        visit(child, typing_only)

    visit(tree, False)
    return found


def _declared(package: str) -> set[str]:
    pyproject = ROOT / "packages" / package.replace("_", "-") / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    names = {re.split(r"[ <>=;\[]", d, maxsplit=1)[0].replace("-", "_") for d in deps}
    return names & set(STACK)


def test_every_package_is_found():
    for package in STACK:
        assert _modules(package), package


def test_imports_follow_the_stack_and_name_no_private_module_of_another_package():
    problems = []
    for package in STACK:
        declared = _declared(package)
        for module, path in _modules(package).items():
            for target, names, _ in _imports(path, module):
                top = target.split(".")[0]
                if top not in STACK or top == package:
                    continue
                where = f"{path.relative_to(ROOT)}: {target}"
                if LEVEL[top] >= LEVEL[package]:
                    problems.append(f"{where}: {top} is not below {package} in the stack")
                if top not in declared:
                    problems.append(f"{where}: {top} is not in {package}'s dependencies")
                private = [p for p in target.split(".")[1:] if p.startswith("_")]
                private += [n for n in names if n.startswith("_")]
                if private:
                    problems.append(f"{where}: private name(s) {private} of another package")
    assert not problems, "\n".join(problems)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = walk(nxt)
                if found:
                    return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = walk(node)
            if found:
                return found
    return None


def test_no_import_cycle_inside_a_package():
    cycles = []
    for package in STACK:
        modules = _modules(package)
        graph: dict[str, set[str]] = {}
        for module, path in modules.items():
            edges = set()
            for target, names, _ in _imports(path, module):
                if target.split(".")[0] != package:
                    continue
                # `from pkg import sub` imports the submodule `pkg.sub` when there is one
                hits = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
                edges.update(hits or ([target] if target in modules else []))
            # a package's __init__ re-exports its modules; an edge into it is not a cycle's
            graph[module] = {e for e in edges if e != module and e != package}
        found = _cycle(graph)
        if found:
            cycles.append(" -> ".join(found))
    assert not cycles, "\n".join(cycles)


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
