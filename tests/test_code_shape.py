"""The runtime packages stay readable function by function: no function (nested functions counted in their own
right, not in the enclosing one) is longer than 60 lines or has more than 15 branches.

Branches, counted on the function's own body (not its nested functions, lambdas or classes): each `if`/`elif`,
`for`, `while`, `except` handler, conditional expression, `match` case and comprehension `if`, and each extra operand
of `and`/`or`. Lines: from the `def` line to the last line of the body, nested functions' lines excluded.

Run as a script to list the functions over either limit:  python tests/test_code_shape.py [PACKAGE ...]
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("coordinator", "specdec", "draft_service", "target_service")
MAX_LINES, MAX_BRANCHES = 60, 15
_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_BRANCH = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.IfExp, ast.match_case)


def _own_nodes(fn: ast.AST):
    """The function's own AST nodes: everything but the bodies of nested functions, lambdas and classes."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _NESTED):
            stack.extend(ast.iter_child_nodes(node))


def branches(fn: ast.AST) -> int:
    n = 0
    for node in _own_nodes(fn):
        if isinstance(node, _BRANCH):
            n += 1
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            n += len(node.ifs)
    return n


def lines(fn: ast.AST) -> int:
    nested = sum(node.end_lineno - node.lineno + 1 for node in _own_nodes(fn) if isinstance(node, _NESTED)
                 and not isinstance(node, ast.Lambda))
    return fn.end_lineno - fn.lineno + 1 - nested


def oversized(packages=PACKAGES) -> list[str]:
    out = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "pb" in path.relative_to(ROOT).parts:  # generated gRPC stubs
                continue
            for fn in ast.walk(ast.parse(path.read_text())):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n_lines, n_branches = lines(fn), branches(fn)
                    if n_lines > MAX_LINES or n_branches > MAX_BRANCHES:
                        out.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}: {n_lines} lines, "
                                   f"{n_branches} branches")
    return out


def test_no_function_is_over_60_lines_or_15_branches():
    assert oversized() == []


def test_the_measure_counts_what_it_says():
    fn = ast.parse("def f(a, b):\n"
                   "    if a and b or a:\n"           # if: 1, and/or: 2
                   "        x = [i for i in a if i]\n"  # comprehension if: 1
                   "    for i in b:\n"                # for: 1
                   "        pass\n"
                   "    def g():\n"                   # nested: neither its lines nor its branches
                   "        if a:\n"
                   "            pass\n"
                   "    try:\n"
                   "        pass\n"
                   "    except ValueError:\n"         # except: 1
                   "        pass\n"
                   "    return 1 if a else 2\n").body[0]  # conditional expression: 1
    assert branches(fn) == 7 and lines(fn) == 13 - 3


if __name__ == "__main__":
    print("\n".join(oversized(tuple(sys.argv[1:]) or PACKAGES)) or "none")
