"""The shape of the code: no function in jaxpar/ over 80 lines, counted from `def` to its last line with nested
functions and docstrings; only the model module names the per-layer subtree; imports flow one way (no cycle)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxpar"
MAX_LINES = 80


def test_no_function_over_80_lines():
    long = []
    for f in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    long.append(f"{f.relative_to(ROOT.parent)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "\n".join(long)


def test_only_the_model_names_the_layer_subtree():
    hits = [f"{f.relative_to(ROOT.parent)}:{i}" for f in sorted(ROOT.rglob("*.py"))
            if f.name != "model.py" and f.parent.name != "model"
            for i, line in enumerate(f.read_text().splitlines(), 1) if '"blocks"' in line or "'blocks'" in line]
    assert not hits, hits


def test_every_subpackage_is_installed():
    import tomllib

    listed = set(tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT.parent).parts) for p in ROOT.rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to pyproject.toml's packages"


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """{jaxpar module: the jaxpar modules it imports}, imports inside functions included; `from P import m` of a
    submodule m is an edge to P.m (what Python runs), a name from a package's `__init__` an edge to the package."""
    files = {module_name(f, root): f for f in root.rglob("*.py")}
    graph = {m: set() for m in files}
    for mod, f in files.items():
        for node in ast.walk(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in files]
                targets = subs + ([node.module] if len(subs) < len(node.names) else [])
            graph[mod] |= {t for t in targets if t in files and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_flow_one_way():
    """No import cycle among jaxpar's modules, counting imports inside functions (none may dodge a cycle): config
    imports nothing of jaxpar; `validate` imports the owners of the rules and only entry points import it."""
    found = cycles(import_graph())
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
    graph = import_graph()
    assert graph["jaxpar.config"] <= {"jaxpar.errors", "jaxpar.config_keys"}, graph["jaxpar.config"]
    assert graph["jaxpar.config_keys"] == set(), graph["jaxpar.config_keys"]
    importers = {m for m, deps in graph.items() if "jaxpar.validate" in deps}
    assert importers <= {"jaxpar.trainer", "jaxpar.compiled", "jaxpar.export", "jaxpar.hf", "jaxpar.plan.space",
                         "jaxpar.plan.measure"}, importers


def test_the_cycle_check_catches_a_cycle(tmp_path):
    pkg = tmp_path / "jaxpar"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from jaxpar import b\n")
    (pkg / "b.py").write_text("def f():\n    from jaxpar.a import g  # inside a function: still a cycle\n")
    assert cycles(import_graph(pkg)) == [["jaxpar.a", "jaxpar.b"]]


def test_no_test_module_imports_another():
    """Shared fixtures and helpers live in tests/helpers.py, tests/hf_checks.py and tests/conftest.py, not in other
    test modules."""
    tests = pathlib.Path(__file__).resolve().parent
    bad = [f"{f.name}: {n}" for f in sorted(tests.glob("test_*.py")) for node in ast.walk(ast.parse(f.read_text()))
           if isinstance(node, (ast.Import, ast.ImportFrom))
           for n in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
           if n.startswith("test_")]
    assert not bad, bad


def inner_imports(root: pathlib.Path = ROOT) -> list[str]:
    """`import jaxpar...` statements inside functions, outside the command lines' `__main__` modules (which import
    after setting the device count) and train.py."""
    out = []
    for f in sorted(root.rglob("*.py")):
        if f.name == "__main__.py":
            continue
        for fn in ast.walk(ast.parse(f.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if any(n.split(".")[0] == "jaxpar" for n in names):
                    out.append(f"{f.relative_to(root.parent)}:{node.lineno}")
    return out


def test_no_jaxpar_import_inside_a_function():
    """Every jaxpar import is at the top of its module, where the import graph (and a reader) sees it."""
    assert inner_imports() == [], "move these imports to the module's top"
