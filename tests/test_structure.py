"""The shape of the code: no function in jaxpar/ over 80 lines, counted from `def` to its last line with nested
functions and docstrings; only the model package names the per-layer subtree; imports flow one way (no cycle), and
between the folders in one order (`ORDER`); about a dozen modules at the root, none that only re-exports."""
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
            if "model" not in f.relative_to(ROOT).parts[:1]
            for i, line in enumerate(f.read_text().splitlines(), 1) if '"blocks"' in line or "'blocks'" in line]
    assert not hits, hits


def test_every_subpackage_is_installed():
    """pyproject.toml discovers the packages; every folder with Python files is one (has an `__init__.py`)."""
    import tomllib

    find = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["jaxpar", "jaxpar.*"], find
    folders = {p.parent for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(d.relative_to(ROOT.parent)) for d in folders if not (d / "__init__.py").exists())
    assert not missing, f"add an __init__.py to {missing}"


# The rooms in the order imports flow: a module may import its own room and the rooms before it, never one after.
# A root module is a room of its own; a folder is one room (docs/architecture.md draws this map).
ORDER = ("config_keys", "errors", "config", "dtypes", "layout",  # what every room may read
         "data", "cluster", "parallel", "kernels", "model", "analysis", "observe", "train",  # the rooms
         "validate", "state", "formats", "compiled", "export", "generate", "evaluate", "rl",  # entry points
         "plan", "trainer", "launch", "preprocess")


def room(module: str) -> str:
    """jaxpar.parallel.pipeline.loop -> parallel; jaxpar.trainer -> trainer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def order_violations(graph: dict[str, set[str]]) -> list[str]:
    rank = {r: i for i, r in enumerate(ORDER)}
    return [f"{m} imports {d} ({room(d)} comes after {room(m)})" for m in sorted(graph) if room(m)
            for d in sorted(graph[m]) if room(d) and rank[room(d)] > rank[room(m)]]


def test_every_room_is_in_the_order():
    rooms = {room(m) for m in import_graph()} - {""}
    assert rooms == set(ORDER), f"rooms missing from ORDER: {sorted(rooms - set(ORDER))}; " \
                                f"gone from the tree: {sorted(set(ORDER) - rooms)}"


def test_imports_flow_between_rooms_in_order():
    assert order_violations(import_graph()) == []


def test_the_order_check_catches_an_import_backwards():
    graph = {"jaxpar.model.layers": {"jaxpar.train.step"}, "jaxpar.train.step": {"jaxpar.model"}, "jaxpar.model": set()}
    assert order_violations(graph) == ["jaxpar.model.layers imports jaxpar.train.step (train comes after model)"]


def test_about_a_dozen_modules_at_the_root():
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root) <= 13, root


def only_reexports(tree: ast.Module) -> bool:
    """A module whose body is a docstring, imports and `__all__` (and perhaps `if __name__ == ...`): an alias."""
    def trivial(node):
        return (isinstance(node, (ast.Import, ast.ImportFrom))
                or isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                or isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["__all__"]
                or isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))
    return bool(tree.body) and all(map(trivial, tree.body))


def test_no_module_only_reexports():
    """Each module does something; a package's `__init__` may gather its names (the package's API)."""
    shims = [str(f.relative_to(ROOT.parent)) for f in sorted(ROOT.rglob("*.py"))
             if f.name != "__init__.py" and only_reexports(ast.parse(f.read_text()))]
    assert not shims, f"alias modules: {shims}"
    assert only_reexports(ast.parse('"""doc"""\nfrom jaxpar.a import b  # noqa: F401\n'))
    assert only_reexports(ast.parse('import sys\nfrom jaxpar.a import main\nif __name__ == "__main__":\n    main()\n'))


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
    imports nothing of jaxpar (config_keys only its own modules); `validate` imports the owners of the rules and only entry points import it."""
    found = cycles(import_graph())
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
    graph = import_graph()
    assert graph["jaxpar.config"] <= {"jaxpar.errors", "jaxpar.config_keys"}, graph["jaxpar.config"]
    own = lambda m: m == "jaxpar.config_keys" or m.startswith("jaxpar.config_keys.")  # noqa: E731
    assert all(own(d) for m, deps in graph.items() if own(m) for d in deps), "config_keys imports only itself"
    importers = {m for m, deps in graph.items() if "jaxpar.validate" in deps}
    assert importers <= {"jaxpar.trainer", "jaxpar.compiled", "jaxpar.export", "jaxpar.formats.exported", "jaxpar.formats.hf", "jaxpar.plan.space",
                         "jaxpar.plan.measure", "jaxpar.plan.target"}, importers


def test_the_cycle_check_catches_a_cycle(tmp_path):
    pkg = tmp_path / "jaxpar"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from jaxpar import b\n")
    (pkg / "b.py").write_text("def f():\n    from jaxpar.a import g  # inside a function: still a cycle\n")
    assert cycles(import_graph(pkg)) == [["jaxpar.a", "jaxpar.b"]]


def test_no_test_module_imports_another():
    """Shared fixtures and helpers live in tests/helpers.py, tests/hf_checks.py, tests/rl_runs.py and
    tests/conftest.py, not in other test modules."""
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


def _named_constants(node, names) -> set[str]:
    """The names among `names` that `node` is (a string constant) or holds (a tuple, list or set of them)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and i.value in names}


def name_comparisons(homes: dict[str, set[str]], root: pathlib.Path = ROOT) -> list[str]:
    """Where a family's or an objective's name (a key of `homes`) is compared (`== "vit"`, `!= "dpo"`,
    `in ("gpt2", ...)`) outside its homes (paths relative to the package's parent: its own module, its registry)."""
    out = []
    for f in sorted(root.rglob("*.py")):
        where = str(f.relative_to(root.parent))
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Compare):
                for n in set().union(*(_named_constants(x, homes) for x in [node.left, *node.comparators])):
                    if where not in homes[n]:
                        out.append(f"{where}:{node.lineno} compares {n!r}")
    return out


def test_families_and_objectives_are_asked_not_named():
    """A family's or an objective's name is compared only in its own module and its registry: everyone else asks
    the object (`jaxpar/model/families/`, `jaxpar/train/objectives/`)."""
    import inspect

    from jaxpar.model import FAMILIES
    from jaxpar.train import objectives

    def home(cls, registry):
        return {str(pathlib.Path(inspect.getsourcefile(cls)).relative_to(ROOT.parent)), registry}

    homes = {n: home(type(f), "jaxpar/model/families/__init__.py") for n, f in FAMILIES.items()}
    homes |= {c.name: home(c, "jaxpar/train/objectives/__init__.py")
              for c in (*objectives.OBJECTIVES.values(), objectives.Classify)}
    assert {"gpt2", "llama", "vit", "lm", "dpo", "classify"} <= set(homes), sorted(homes)
    assert name_comparisons(homes) == []


def test_the_name_check_catches_a_comparison(tmp_path):
    pkg = tmp_path / "jaxpar"
    pkg.mkdir()
    (pkg / "a.py").write_text('def f(cfg, c):\n    return cfg.arch == "vit" or c.objective in ("lm", "x")\n')
    (pkg / "vit.py").write_text('def g(cfg):\n    return cfg.arch != "vit"\n')
    homes = {"vit": {"jaxpar/vit.py"}, "lm": {"jaxpar/lm.py"}}
    assert sorted(name_comparisons(homes, pkg)) == ["jaxpar/a.py:2 compares 'lm'", "jaxpar/a.py:2 compares 'vit'"]


def test_small_modules_and_a_small_model_face():
    """No module in jaxpar/ over 400 lines; the model package's face (`model/__init__.py`) at most 150."""
    long = [f"{f.relative_to(ROOT.parent)}: {n}" for f in sorted(ROOT.rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > 400]
    assert not long, long
    assert len((ROOT / "model" / "__init__.py").read_text().splitlines()) <= 150
