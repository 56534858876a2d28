"""The documentation cannot drift from the code: every `--config.KEY` written in README.md and docs/ is a key of
`base_config()`, every `configs/*.py` and `python -m jaxpar.X` named exists, every relative link resolves, the config
reference lists exactly the keys of `base_config()` with their defaults, and the README stays a landing page."""
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from jaxpar.config import DEFAULT_RULES, _get, base_config, flat_keys, reference_table
from jaxpar.config_keys import KEYS as KEYS_TABLE

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


KEYS = {k: _get(base_config(), k) for k in flat_keys(base_config())}  # {dotted key: default}


def unknown_config_keys(text: str) -> list[str]:
    """The `--config.KEY` spellings in `text` that name no key of `base_config()`."""
    found = re.findall(r"--config\.([A-Za-z_][\w.]*[A-Za-z_0-9])", text)
    return sorted({k for k in found if k not in KEYS and not k.isupper()})  # KEY, X: placeholders


def missing_paths(text: str) -> list[str]:
    """`configs/*.py` files, `jaxpar/...` files and folders, and `python -m jaxpar.X` modules named in `text` that
    do not exist."""
    missing = [p for p in re.findall(r"\bconfigs/[\w.-]+\.py\b", text) if not (ROOT / p).exists()]
    missing += [p for p in re.findall(r"(?<![\w/.-])jaxpar/[\w/]*\w(?:\.py)?", text) if not (ROOT / p).exists()]
    for mod in re.findall(r"python3? -m (jaxpar(?:\.\w+)*)", text):
        if importlib.util.find_spec(mod) is None:
            missing.append(mod)
    return sorted(set(missing))


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def broken_links(page: pathlib.Path) -> list[str]:
    """Relative links to files that do not exist, or to a heading their page does not have."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        path, _, anchor = target.partition("#")
        if re.match(r"[a-z]+:", path):
            continue
        dest = page.parent / path if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            out.append(target)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_key_module_config_file_and_link_exists(page):
    text = page.read_text()
    assert unknown_config_keys(text) == [], f"{page.name}: --config keys that base_config() does not have"
    assert missing_paths(text) == [], f"{page.name}: configs or modules that do not exist"
    assert broken_links(page) == [], f"{page.name}: links to files that do not exist"


def test_the_check_catches_a_stale_key():
    assert unknown_config_keys("python train.py --config.model.layers=2 --config.data.corpus=x") == ["data.corpus"]
    assert missing_paths("python train.py --config configs/llama4.py; python -m jaxpar.nothing") == [
        "configs/llama4.py", "jaxpar.nothing"]
    assert missing_paths("see `jaxpar/model.py` and jaxpar/parallel/pipeline/, then jaxpar/parallel/zero.py") == [
        "jaxpar/model.py"]


def test_config_reference_is_the_key_table():
    """docs/config.md's key table is `config.reference_table()` (regenerate: python -m jaxpar.config), and
    the key table is `base_config()`: every key, with its default."""
    text = (ROOT / "docs/config.md").read_text()
    assert reference_table() in text.split("## Keys")[1], "docs/config.md: run python -m jaxpar.config"
    assert sorted(k.name for k in KEYS_TABLE) == sorted(KEYS)
    for logical, mesh in DEFAULT_RULES:  # the rules table
        shown = "none" if not mesh else f"`{mesh}`" if isinstance(mesh, str) else f"`{mesh!r}`"
        assert re.search(rf"^\| `{logical}` \| {re.escape(shown)}", text, re.M), logical


def test_every_key_rejects_a_value_of_the_wrong_kind():
    """Each key of the table refuses a value of another type, naming itself (keys left to validate excepted)."""
    wrong = {int: "x", float: "x", str: 3, bool: "yes"}
    for k in KEYS_TABLE:
        if k.kind is not None:
            assert k.error(wrong[k.kind]) is not None and k.name in k.error(wrong[k.kind]), k.name
            assert k.error(k.default) is None, k.name


def test_every_page_gives_the_test_command_ci_runs():
    """The README's test command is the one every page shows, with the extras `.ci/run` installs."""
    def shown(page):
        return set(re.findall(r"^.*pip install -e '[^']*'.*-m pytest.*$", page.read_text(), re.M))

    readme = shown(ROOT / "README.md")
    assert len(readme) == 1, readme
    extras = re.search(r"-e '(\.\[[^]]*\])'", (ROOT / ".ci/run").read_text()).group(1)
    assert f"-e '{extras}'" in next(iter(readme)), (extras, readme)
    drift = {str(p.relative_to(ROOT)): shown(p) - readme for p in PAGES if shown(p) - readme}
    assert not drift, drift


def test_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"


@pytest.mark.parametrize("cmd", [["train.py"], ["sample.py"], ["-m", "jaxpar.plan"], ["-m", "jaxpar.preprocess"],
                                 ["-m", "jaxpar.export"], ["-m", "jaxpar.generate"], ["-m", "jaxpar.evaluate"]],
                         ids=" ".join)
def test_every_command_line_names_its_guide(cmd):
    out = subprocess.run([sys.executable, *cmd, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    guides = re.findall(r"docs/[\w/-]+\.md", out.stdout + out.stderr)
    assert guides and all((ROOT / g).exists() for g in guides), (cmd, guides)


def test_the_architecture_map_names_every_folder():
    """docs/architecture.md's map has a line for each subpackage of jaxpar/ and names no folder that is gone."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    folders = sorted(p.parent.name for p in (ROOT / "jaxpar").glob("*/__init__.py"))
    mapped = re.findall(r"^  (\w+)/ ", text.split("## The map", 1)[1].split("```")[1], re.M)
    assert sorted(mapped) == folders, (mapped, folders)
