"""The sizes docs/architecture.md records: the longest functions and the largest modules of the package.

    python benchmarks/code_size.py            # 15 of each, as Markdown tables
    python benchmarks/code_size.py --top 30

Lines are physical lines of the source as committed (after `ruff format`), docstrings and comments
included: what a reader scrolls through.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ampkit"


def functions(root: Path = SRC) -> list[tuple[int, str]]:
    """(lines, "module:qualified.name") of every function and method."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(root.parent).with_suffix("").as_posix().replace("/", ".")

        _walk(tree, f"{rel}:", out)
    return sorted(out, reverse=True)


def _walk(node: ast.AST, prefix: str, out: list[tuple[int, str]]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((child.end_lineno - child.lineno + 1, f"{prefix}{child.name}"))
            _walk(child, f"{prefix}{child.name}.", out)
        elif isinstance(child, ast.ClassDef):
            _walk(child, f"{prefix}{child.name}.", out)


def modules(root: Path = SRC) -> list[tuple[int, str]]:
    """(lines, path) of every module."""
    return sorted(
        (
            (len(p.read_text().splitlines()), p.relative_to(root).as_posix())
            for p in root.rglob("*.py")
        ),
        reverse=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--top", type=int, default=15)
    top = p.parse_args().top
    print("| longest functions | lines |\n|---|---:|")
    for n, name in functions()[:top]:
        print(f"| `{name}` | {n} |")
    print("\n| largest modules | lines |\n|---|---:|")
    for n, name in modules()[:top]:
        print(f"| `{name}` | {n} |")


if __name__ == "__main__":
    main()
