"""The layout's rules, checked on the source: no import circles inside gem_ops (package __init__
re-exports aside), gem_ops never imports dagster, only the engine backpropagates a training loss, and
every Markdown document the project cites is in the project."""

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gem_ops_modules() -> dict[str, Path]:
    modules = {}
    for path in (ROOT / "gem_ops").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def imported(path: Path, module: str, known: set[str]) -> set[str]:
    """The gem_ops modules a module imports (at any depth of its code, lazy imports included)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in known}


def import_circles(modules: dict[str, Path]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), __init__ modules left out."""
    plain = {m: p for m, p in modules.items() if p.name != "__init__.py"}
    graph = {m: imported(p, m, set(plain)) - {m} for m, p in plain.items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_the_walker_finds_a_circle(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.a import g\n")
    (package / "c.py").write_text("import pkg.a\n")
    modules = {f"pkg.{p.stem}": p for p in package.glob("*.py")}
    assert import_circles(modules) == [["pkg.a", "pkg.b"]]


def test_gem_ops_has_no_import_circles():
    assert import_circles(gem_ops_modules()) == []


def test_gem_ops_never_imports_dagster_assets_or_pipelines():
    for name, path in gem_ops_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [n for n in names if n.split(".")[0] in ("dagster", "assets", "pipelines")]
            assert not bad, f"{name} imports {bad}"


def test_only_the_engine_backpropagates():
    calling = sorted(name for name, path in gem_ops_modules().items()
                     if any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                            and node.func.attr == "backward" for node in ast.walk(ast.parse(path.read_text()))))
    assert calling == ["gem_ops.train.engine"]


def test_cited_markdown_files_are_in_the_project():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    missing = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".txt", ".toml", ".yaml", ".cfg") or not path.is_file():
            continue
        # Documents are named in capitals (README.md, ...), with or without a folder.
        for cited in re.findall(r"(?<![\w.])((?:[\w-]+/)*[A-Z][A-Z0-9_-]*\.md)\b", path.read_text(errors="replace")):
            if not any((base / cited).is_file() for base in (ROOT, path.parent)):
                missing.append(f"{name} cites {cited}")
    assert not missing, missing
