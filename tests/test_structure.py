"""The shape of the code (issue 13): no function in jaxpar/ over 80 lines, counted from `def` to its last line with
nested functions and docstrings; only the model module names the per-layer subtree."""
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
