"""No Python function in src/kvpilot is longer than MAX_LINES, kernels aside (issue 44): a longer one is split
into named steps.

Measured with `ast`, from the `def` line to the last line of the body (decorators not counted, the signature
and docstring counted). The one exclusion: functions decorated with `@triton.jit` (GPU kernels: one program
per launch, where splitting costs registers and inlining control). The C++ kernels under model/layers/csrc are
not Python and not read.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvpilot"
MAX_LINES = 80


@dataclass(frozen=True)
class LongFunction:
    """A function over the limit: where it is and how long."""

    path: str
    name: str
    line: int
    lines: int

    def where(self) -> str:
        return f"{self.path}:{self.line} {self.name} ({self.lines} lines)"


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """`@triton.jit` or `@triton.jit(...)`."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) == "triton.jit":
            return True
    return False


def long_functions(source: str, path: str, limit: int = MAX_LINES) -> list[LongFunction]:
    """Every function (nested and methods included) in `source` over `limit` lines, kernels excepted."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit:
                found.append(LongFunction(path, node.name, node.lineno, lines))
    return found


def test_no_function_in_src_is_over_the_limit() -> None:
    paths = sorted(SRC.rglob("*.py"))
    assert len(paths) > 100  # the tree was found
    found = [f for p in paths for f in long_functions(p.read_text(encoding="utf-8"), str(p.relative_to(SRC)))]
    assert found == [], "split into named steps:\n" + "\n".join(f"  {f.where()}" for f in found)


def test_the_measure_counts_bodies_and_spares_only_triton_kernels() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(5))
    source = (f"def long():\n{body}\n"
              f"class C:\n    def method(self):\n{body.replace('    ', '        ')}\n"
              f"@triton.jit\ndef kernel():\n{body}\n"
              f"@triton.jit(do_not_specialize=['s'])\ndef kernel2():\n{body}\n"
              f"@functools.cache\ndef cached():\n{body}\n"
              f"def short():\n    pass\n")
    found = long_functions(source, "x.py", limit=5)
    assert sorted((f.name, f.lines) for f in found) == [("cached", 6), ("long", 6), ("method", 6)]
