"""The code's shape in the router and the shared core: no module over 500 lines, no function over 80, and the core
(tandem/) importing no component (router/, workers/, operator/) at module level."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECKED = ("router", "tandem")  # kernels excepted (none live there today)
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
COMPONENTS = ("tandem.router", "tandem.workers", "tandem.operator")


def _modules(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py") if "kernels" not in p.parts)


def _name(path: Path) -> str:
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def too_long(path: Path) -> list[str]:
    """What in `path` is past the bounds: the module itself, and each function (nested ones on their own)."""
    text = path.read_text()
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{_name(path)}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{_name(path)}:{node.lineno}: {node.name} is {length} lines (at most "
                             f"{MAX_FUNCTION_LINES})")
    return found


def module_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of each import run when the module is imported: outside function bodies."""
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.append((child.lineno, child.module))
            visit(child)

    visit(tree)
    return found


@pytest.mark.parametrize("root", CHECKED)
def test_no_module_or_function_is_too_long(root):
    found = [problem for path in _modules(root) for problem in too_long(path)]
    assert not found, "split along a real seam:\n" + "\n".join(found)


def test_the_core_imports_no_component():
    found = [f"{_name(path)}:{line}: imports {module}"
             for path in _modules("tandem")
             for line, module in module_level_imports(ast.parse(path.read_text()))
             if any(module == c or module.startswith(c + ".") for c in COMPONENTS)]
    assert not found, "the core imports components only inside the functions that start them:\n" + "\n".join(found)


def test_the_checks_see_what_they_check(tmp_path):
    """A long module, a long function and a module-level component import are each caught."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    long = tmp_path / "long.py"
    long.write_text(f"def f():\n{body}\n" + "\n" * MAX_MODULE_LINES)
    assert len(too_long(long)) == 2
    tree = ast.parse("import tandem.router.app\nfrom tandem.workers import main\n"
                     "def run():\n    from tandem.operator.main import run_operator\n")
    assert [m for _, m in module_level_imports(tree)] == ["tandem.router.app", "tandem.workers"]
