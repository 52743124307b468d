"""fused_ops' layers, read from the source with ast (nothing imported): the portable core imports none of the Hopper
kernels, FP8, or the speed machinery; hopper/ never imports fp8/; env.py is a leaf; and no import circle anywhere."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "fused_ops"
CORE = ["env", "casts", "activations", "tuning", "matmul", "linear_act", "dgrad", "layernorm", "ops", "mlp", "backends"]
NOT_IN_CORE = ("hopper", "fp8", "graphs", "precompile", "layers")


def _modules():
    """{dotted name under fused_ops ("" for the package itself): path}."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name):
    """The fused_ops modules `name` imports, at any depth of its code (lazy imports count)."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] if node.level > 1 else package
                base = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "fused_ops":
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:  # "from . import x": x may be a module
                candidate = ".".join(base + [alias.name])
                found.add(candidate if candidate in MODULES else ".".join(base))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fused_ops":
                    found.add(".".join(alias.name.split(".")[1:]))
    found = {m for m in found if m in MODULES and m != name}
    # importing a.b runs a/__init__.py first, unless a is a package `name` is in (already being imported)
    own = {".".join(name.split(".")[:i]) for i in range(len(name.split(".")) + 1)}
    for m in list(found):
        parts = m.split(".")
        found.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in MODULES and p not in own)
    return found


def _closure(name):
    seen, todo = set(), [name]
    while todo:
        for m in _imports(todo.pop()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_the_core_imports_no_hardware_fp8_or_speed_machinery():
    for name in CORE:
        bad = {m for m in _closure(name) if m.split(".")[0] in NOT_IN_CORE}
        assert not bad, f"fused_ops.{name} imports {sorted(bad)}"


def test_hopper_never_imports_fp8_and_env_is_a_leaf():
    for name in [m for m in MODULES if m.split(".")[0] == "hopper"]:
        bad = {m for m in _closure(name) if m.split(".")[0] == "fp8"}
        assert not bad, f"fused_ops.{name} imports {sorted(bad)}"
    assert _imports("env") == set()


def test_no_import_circle():
    for name in MODULES:
        if name == "":
            continue
        closure = _closure(name)
        assert name not in closure, f"fused_ops.{name} imports itself through {sorted(closure)}"
