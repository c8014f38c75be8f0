"""The import graph of src/kvpilot, read with `ast` (nothing is imported or executed).

Every `import` and `from ... import` counts, wherever it sits: module level, inside a function, under
`if TYPE_CHECKING:`. A dependency hidden in a function body is still a dependency.

Units are what the layering rules talk about: each sub-package of kvpilot (`bench`, `engine`, ...) and each
top-level module (`cli`, `llm`, ...); the package's own `__init__` is the unit `kvpilot`.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

SRC_ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "kvpilot"


@dataclass(frozen=True)
class Import:
    """One import statement's edge. `imported` is the most specific module it names (a known kvpilot
    module when `from pkg import submodule`), or a third-party name such as `torch`."""

    importer: str
    imported: str
    line: int

    def where(self) -> str:
        return f"{self.importer}:{self.line} -> {self.imported}"


def module_name(path: Path, src_root: Path = SRC_ROOT) -> str:
    parts = list(path.relative_to(src_root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve_from(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports_in(path: Path, src_root: Path, known: set[str]) -> list[Import]:
    importer = module_name(path, src_root)
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(importer, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, importer, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(importer, sub if sub in known else base, node.lineno))
    return found


def package_imports(src_root: Path = SRC_ROOT, package: str = PACKAGE) -> list[Import]:
    """Every import made by every module of `package` under `src_root`."""
    files = sorted((src_root / package).rglob("*.py"))
    known = {module_name(f, src_root) for f in files}
    return [imp for f in files for imp in _imports_in(f, src_root, known)]


def module_edges(imports: list[Import]) -> set[tuple[str, str]]:
    """(importer, imported) between kvpilot's modules, with the imports Python makes on the way: importing
    `a.b.c` first runs the `__init__` of each package above it that is not also above the importer (those run
    before the importer itself)."""
    known = {i.importer for i in imports}

    def packages_above(module: str) -> set[str]:
        parts = module.split(".")
        return {".".join(parts[:k]) for k in range(1, len(parts))}

    edges = set()
    for i in imports:
        if unit_of(i.imported) is None or i.importer == i.imported:
            continue
        edges.add((i.importer, i.imported))
        edges |= {(i.importer, p) for p in packages_above(i.imported) - packages_above(i.importer)
                  if p in known and p != i.importer}
    return edges


def unit_of(module: str) -> str | None:
    """`kvpilot.bench.api` -> `bench`; `kvpilot.cli` -> `cli`; `kvpilot` -> `kvpilot`; others -> None."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    return parts[1] if len(parts) > 1 else PACKAGE


def unit_edges(imports: list[Import]) -> dict[tuple[str, str], list[Import]]:
    """(importing unit, imported unit) -> the imports that make the edge; imports within a unit left out."""
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for imp in imports:
        src, dst = unit_of(imp.importer), unit_of(imp.imported)
        if src is not None and dst is not None and src != dst:
            edges[(src, dst)].append(imp)
    return dict(edges)


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted; sorted overall."""
    graph: dict[str, list[str]] = defaultdict(list)
    for a, b in sorted(edges):
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted({n for edge in edges for n in edge}):
        if node not in index:
            visit(node)
    return sorted(found)


def reachable_modules(imports: list[Import], roots: set[str]) -> set[str]:
    """kvpilot modules reachable from `roots` (modules) through imports, the roots included."""
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        if unit_of(imp.imported) is not None:
            graph[imp.importer].add(imp.imported)
    seen, todo = set(roots), list(roots)
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen
