"""No product file imports from tests/ (read with ast, nothing imported): the scripts at the top level, model.py,
helpers/ and fused_ops/ (every subpackage) run from an installed copy without the test suite. What both need lives in
the product (fused_ops/numerics.py: EPS and rel_err, which bench_mlp.py checks its kernels by)."""

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("", "helpers", "fused_ops")


def product_files():
    """Repo-relative paths of the .py files at the top level, in helpers/ and anywhere under fused_ops/."""
    paths = glob.glob(os.path.join(ROOT, "*.py"))
    for folder in FOLDERS[1:]:
        paths += glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def is_tests(name):
    return name == "tests" or name.startswith("tests.")


def imports_from_tests(source, path="<source>"):
    """[(line, what)] for each import of the tests package in source: import tests..., from tests... import ...,
    and importlib.import_module / __import__ of a literal "tests..." name (at the top or inside a function)."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if is_tests(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and is_tests(node.module or ""):
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and is_tests(node.args[0].value):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__"):
                found.append((node.lineno, f"{name}({node.args[0].value!r})"))
    return found


def test_the_scan_sees_every_form():
    source = ("import tests\nimport tests.numerics as n\nfrom tests.numerics import EPS\nfrom tests import numerics\n"
              "def f():\n    import importlib\n    importlib.import_module('tests.numerics')\n    __import__('tests')\n"
              "import testsuite\nfrom .tests import x\nfrom helpers import errors\n")
    assert [line for line, _ in imports_from_tests(source)] == [1, 2, 3, 4, 7, 8]


def test_no_product_file_imports_from_tests():
    files = product_files()
    assert {"train.py", "bench_mlp.py", "model.py", "helpers/data.py", "fused_ops/classifier.py",
            "fused_ops/fp8/classifier.py", "fused_ops/hopper/pingpong.py"} <= set(files), files
    bad = {}
    for path in files:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            found = imports_from_tests(f.read(), path)
        if found:
            bad[path] = found
    assert not bad, f"product files importing from tests/ (move what they need into the product): {bad}"
