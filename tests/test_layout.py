"""The repository's layout, read from the source with ast (nothing imported): a short top level (the scripts a user
runs, model.py and the folders), helpers/ below the scripts, imports pointing one way (no circles anywhere), fused_ops
in layers (the portable core imports none of the Hopper kernels, FP8 or the speed machinery; hopper/ never imports
fp8/; env.py is a leaf), and no product file too long to read."""

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"train", "sample", "prepare", "export", "bench", "bench_mlp", "bench_classifier"}
MAX_TOP_LEVEL = 8
MAX_LINES = 500
LONG_ALLOWED = {"fused_ops/hopper/pingpong.py"}  # the Gluon kernel: one warp-specialized kernel, read as a whole
PRODUCT = ("", "helpers", "fused_ops", "fused_ops/hopper", "fused_ops/fp8")
CORE = ["env", "casts", "activations", "numerics", "tuning", "matmul", "linear_act", "dgrad", "layernorm", "ops", "mlp",
        "backends", "classifier", "adamw"]
NOT_IN_CORE = ("hopper", "fp8", "graphs", "precompile", "layers")


def product_files(folders=PRODUCT):
    """Repo-relative paths of the product's .py files: the top level and its packages (not tests/, lab/, configs/)."""
    return sorted(os.path.relpath(p, ROOT) for f in folders for p in glob.glob(os.path.join(ROOT, f, "*.py")))


def module_name(path):
    name = path[:-3].replace(os.sep, ".")
    return name.removesuffix(".__init__")


def imports_of(path, modules):
    """The product modules path imports (at the top, or inside a function), by module name."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y, from . import y
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            # from a import b: the module a.b where there is one, else a (b is a name in it)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # fused_ops.mlp.fused_mlp -> fused_ops.mlp
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):  # not its own package
                found.add(target)
    return found


def cycles(graph):
    """Every strongly connected component of more than one module (Tarjan's algorithm), sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def import_graph(folders):
    files = product_files(folders)
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) for p in files}


def closure(graph, name):
    """Every module `name` imports, directly or through others."""
    seen, todo = set(), [name]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_no_import_circles():
    """Imports point one way: scripts -> helpers -> model.py -> fused_ops, and inside fused_ops core -> hopper ->
    fp8 -> graphs / layers (a module importing its own package's __init__ does not count)."""
    graph = import_graph(PRODUCT)
    assert cycles(graph) == [], cycles(graph)


def test_the_fused_ops_core_imports_no_hardware_fp8_or_speed_machinery():
    graph = import_graph(PRODUCT)
    for name in CORE:
        bad = {m for m in closure(graph, f"fused_ops.{name}") if m.split(".")[1:2] and m.split(".")[1] in NOT_IN_CORE}
        assert not bad, f"fused_ops.{name} imports {sorted(bad)}"


def test_hopper_never_imports_fp8_and_env_is_a_leaf():
    graph = import_graph(PRODUCT)
    for name in [m for m in graph if m.startswith("fused_ops.hopper")]:
        assert not {m for m in closure(graph, name) if m.startswith("fused_ops.fp8")}, name
    assert graph["fused_ops.env"] == set()


def test_helpers_never_import_a_script():
    graph = import_graph(("", "helpers"))
    for module, imported in graph.items():
        if module.startswith("helpers"):
            assert not imported & SCRIPTS, (module, imported & SCRIPTS)
    assert not graph["model"] & SCRIPTS


def test_the_top_level_is_short():
    top = [p for p in product_files(("",))]
    assert len(top) <= MAX_TOP_LEVEL, top
    assert {module_name(p) for p in top} >= SCRIPTS | {"model"}


def test_no_product_file_is_too_long():
    long = {}
    for path in product_files():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES and path not in LONG_ALLOWED:
            long[path] = n
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_kernel_constants_are_constexpr_instances():
    """A module-level constant a kernel reads must be `NAME = tl.constexpr(value)`: Triton 3.6 (the GPU image's)
    refuses the annotated form `NAME: tl.constexpr = value` at compile time, while newer Triton and the interpreter
    accept it, so only a GPU run would find it."""
    annotated = []
    for path in product_files(("fused_ops", "fused_ops/hopper", "fused_ops/fp8")):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        annotated += [f"{path}:{node.lineno}" for node in tree.body
                      if isinstance(node, ast.AnnAssign) and "constexpr" in ast.unparse(node.annotation)]
    assert not annotated, f"annotated constexpr globals (write NAME = tl.constexpr(value)): {annotated}"
