"""Models and datasets by their Hugging Face Hub names, resolved into the Hugging Face cache with `huggingface_hub`.

    init_from=hf:ORG/NAME[@REVISION]           a model: config, safetensors (+ index), tokenizer, chat template
    lora.adapter=hf:ORG/NAME[@REVISION]        a PEFT adapter
    data.sources=hfds:ORG/NAME[@REVISION][:SPLIT]   a dataset's split (default `train`): its Parquet or JSONL files
    data.val_source=hfds:ORG/NAME[:SPLIT]      the same, as the validation split

A path that exists wins: `hf:DIR` with DIR a directory is that directory, as before. Downloads use the library's
own cache and settings (`HF_HOME`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE`, `HF_TOKEN`) and fetch only the files jaxpar
reads. `resolve(config, pins)` returns the config with every name replaced by its snapshot directory (or, for a
dataset, `parquet:`/`jsonl:` and the glob of the split's files there) and the commit each name resolved to; a
name pinned in `pins` (the workdir's `hub.json`, from the run's first start) resolves to that commit, so a resume
reads the same weights and data. `trainer` orders the processes so that one per host downloads (`fetch_once`).

A dataset split's files: `data.hf_data_files` when given; else the README's `configs` (the `default` config, or
the only one) `data_files` for the split; else the usual names (`SPLIT/...`, `.../SPLIT-00000-of-00001.parquet`,
`SPLIT.jsonl`, ...), Parquet preferred over JSONL.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re

import jax

from jaxpar.cluster import distributed
from jaxpar.errors import ConfigError

MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "chat_template.json", "preprocessor_config.json", "adapter_config.json", "adapter_model.safetensors")
DATA_KINDS = (("parquet", ("parquet",)), ("jsonl", ("jsonl", "json")))  # in order of preference
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # the Hub's ORG/NAME (or NAME)
MODEL_KEYS = ("init_from", "lora.adapter")
DATA_KEYS = ("data.sources", "data.val_source")
PINS = "hub.json"  # in the workdir: {name as written: the commit it resolved to at the run's first start}


class HubError(ConfigError):
    """A Hub name that cannot be resolved; the message names it, the cache and the fix."""


@dataclasses.dataclass(frozen=True)
class Name:
    """A Hub name as written (`text`): its repository, revision (None: the default branch) and split."""
    text: str
    repo: str
    revision: str | None
    kind: str  # "model" | "dataset"
    split: str = "train"

    def pinned(self, pins: dict) -> "Name":
        """This name at the commit `pins` recorded for it (a branch or tag given as @REVISION too: the commit it
        named at the first start)."""
        rev = pins.get(self.text)
        return dataclasses.replace(self, revision=rev) if rev else self


def model_name(value: str) -> Name | None:
    """`hf:ORG/NAME[@REV]` that is not an existing path -> its Name; anything else (a directory) -> None."""
    if not isinstance(value, str) or not value.startswith("hf:"):
        return None
    rest = value[len("hf:"):]
    if os.path.exists(os.path.expanduser(rest)):
        return None
    repo, _, rev = rest.partition("@")
    if not _REPO.match(repo) or repo.startswith((".", "~")):
        return None  # a path that does not exist: `hf.settings` says so
    return Name(value, repo, rev or None, "model")


def dataset_name(word: str) -> Name | None:
    """`hfds:ORG/NAME[@REV][:SPLIT]` -> its Name; another source -> None.

    Raises:
      HubError: `hfds:` with no repository name in the Hub's form."""
    if not word.startswith("hfds:"):
        return None
    rest, _, split = word[len("hfds:"):].partition(":")
    repo, _, rev = rest.partition("@")
    if not _REPO.match(repo):
        raise HubError(f"data source {word!r}: {repo!r} is not a Hub dataset name; write hfds:ORG/NAME[@REVISION]"
                       f"[:SPLIT].")
    return Name(word, repo, rev or None, "dataset", split or "train")


def names(config, datasets: bool = True) -> list[Name]:
    """Every Hub name `config` holds (models first; `datasets`: the datasets' too), each once."""
    out = [n for k in MODEL_KEYS if (n := model_name(_get(config, k)))]
    for k in DATA_KEYS if datasets else ():
        out += [n for w in str(_get(config, k)).split() if (n := dataset_name(w))]
    return list({n.text: n for n in out}.values())


def resolve(config, pins: dict, local_only: bool = False, weights: bool = True, datasets: bool = True):
    """(a copy of `config` with every Hub name replaced by where it is in the cache, {name: commit}).

    `pins`: {name: commit} to resolve to (a resume's); `local_only`: never download (the name must be in the cache:
    another process of this host fetched it); `weights`: a model's weights too (False: its config and tokenizer,
    what `--dry_run` reads); `datasets`: the datasets too (False: left as named, as `--dry_run` needs none).

    Raises:
      HubError: a name not on the Hub or not in the cache (offline), a revision that does not exist, no files of
        the split; nothing is written.
    """
    sources = str(config.data.sources).split()  # `data.hf_data_files` is their pattern, not the validation's
    found = {n.text: fetch(n.pinned(pins), str(config.data.hf_data_files) if n.text in sources else "", local_only,
                           weights) for n in names(config, datasets)}
    if not found:
        return config, {}
    config = config.copy_and_resolve_references()
    for k in MODEL_KEYS:
        if _get(config, k) in found:
            _set(config, k, ("hf:" if k == "init_from" else "") + found[_get(config, k)][0])
    for k in DATA_KEYS:
        _set(config, k, " ".join(found[w][0] if w in found else w for w in str(_get(config, k)).split()))
    return config, {text: commit for text, (_, commit) in found.items()}


def fetch(name: Name, data_files: str = "", local_only: bool = False, weights: bool = True) -> tuple[str, str]:
    """(where `name` is: a model's snapshot directory, or a dataset split's `KIND:GLOB`, its commit)."""
    if name.kind == "model":
        files = MODEL_FILES if weights else [f for f in MODEL_FILES if "safetensors" not in f]
        snap = _download(name, list(files), local_only)
        return snap, os.path.basename(snap)
    if data_files:
        patterns = [data_files]
    else:
        card = os.path.join(_download(name, ["README.md"], local_only), "README.md")
        patterns = card_patterns(card, name) or default_patterns(name.split)
    snap = _download(name, ["README.md"] + _allow(patterns), local_only)
    return split_source(snap, patterns, name), os.path.basename(snap)


def _download(name: Name, allow: list[str], local_only: bool) -> str:
    import huggingface_hub as hub
    from huggingface_hub import constants, errors

    kind = "model" if name.kind == "model" else "dataset"
    try:
        return hub.snapshot_download(name.repo, repo_type=kind, revision=name.revision, allow_patterns=allow,
                                     local_files_only=local_only)
    except errors.RevisionNotFoundError:
        raise HubError(f"{name.text}: the {kind} {name.repo} has no revision {name.revision!r}; give a branch, tag "
                       f"or commit it has.") from None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as e:
        raise HubError(f"{name.text}: the Hub has no {kind} {name.repo} that this token may read "
                       f"({type(e).__name__}); check the name, or log in (`hf auth login`, HF_TOKEN) for a gated or "
                       f"private one.") from None
    except errors.LocalEntryNotFoundError:
        where = constants.HF_HUB_CACHE
        if constants.is_offline_mode() or local_only:
            why = "HF_HUB_OFFLINE=1 forbids downloading" if constants.is_offline_mode() else "it was not fetched"
            raise HubError(f"{name.text}: the {kind} {name.repo}" + (f"@{name.revision}" if name.revision else "")
                           + f" is not in the Hugging Face cache ({where}) and {why} it; download it first "
                           f"(`hf download {name.repo}" + (" --repo-type dataset" if kind == "dataset" else "")
                           + "`) or unset HF_HUB_OFFLINE.") from None
        raise HubError(f"{name.text}: the Hub cannot be reached and the {kind} is not in the Hugging Face cache "
                       f"({where}); check the network (HF_ENDPOINT) or download it where there is one.") from None


def card_patterns(card: str, name: Name) -> list[str]:
    """The split's `data_files` globs from the dataset card's `configs` (the `default` config or the only one)."""
    if not os.path.isfile(card):
        return []
    from huggingface_hub.repocard import metadata_load

    configs = (metadata_load(card) or {}).get("configs") or []
    config = next((c for c in configs if c.get("config_name") == "default"), configs[0] if len(configs) == 1 else None)
    files = (config or {}).get("data_files")
    if isinstance(files, (str, list)) and files and not isinstance(files[0] if isinstance(files, list) else 0, dict):
        files = [{"split": "train", "path": files}]  # no split named: all of it is train
    for entry in files or []:
        if entry.get("split") == name.split:
            return [entry["path"]] if isinstance(entry["path"], str) else list(entry["path"])
    return []


def default_patterns(split: str) -> list[str]:
    """The usual places of a split's files (as the `datasets` library looks for them), as globs."""
    return [f"{split}/**/*", f"**/{split}/**/*", f"**/{split}", f"**/{split}[-._0-9]*", f"**/*[-._0-9]{split}[-._0-9]*"]


def _allow(patterns: list[str]) -> list[str]:
    """The globs (`**` for any folders) as huggingface_hub's allow patterns (fnmatch: `*` spans folders), each
    with the extensions jaxpar reads: the download is the split's data files, a superset of what the globs find."""
    exts = [e for _, es in DATA_KINDS for e in es]
    out = []
    for p in patterns:
        p = p.replace("**/", "*").replace("**", "*")
        out += [p] if p.endswith(tuple(f".{e}" for e in exts)) else [f"{p}.{e}" for e in exts]
    return out


def split_source(snap: str, patterns: list[str], name: Name) -> str:
    """`KIND:GLOB` of the split's data files in snapshot `snap`: the first pattern that finds files of a kind jaxpar
    reads (Parquet first).

    Raises:
      HubError: no such files (the names of the files there in the message)."""
    found = [p for p in patterns if _kind_glob(snap, p)]
    if len(found) > 1 and not set(patterns) & set(default_patterns(name.split)):
        raise HubError(f"{name.text}: the split's files are under {len(found)} patterns ({', '.join(found)}); a "
                       f"source reads one glob: name one in data.hf_data_files, or blend the files as sources.")
    for pattern in patterns:
        for kind, exts in DATA_KINDS:
            for ext in exts:
                glob_ = os.path.join(snap, pattern if pattern.endswith(f".{ext}") else f"{pattern}.{ext}")
                if any(os.path.isfile(f) for f in glob.glob(glob_, recursive=True)):
                    if re.search(r"\s", glob_):
                        raise HubError(f"{name.text}: the cache path {glob_!r} holds whitespace, which data.sources "
                                       f"cannot; set HF_HUB_CACHE to a path without.")
                    return f"{kind}:{glob_}"
    have = sorted(os.path.relpath(f, snap) for f in glob.glob(os.path.join(snap, "**", "*"), recursive=True)
                  if os.path.isfile(f))
    raise HubError(f"{name.text}: no Parquet or JSONL files of split {name.split!r} in the dataset (looked for "
                   f"{', '.join(patterns)}; it has {', '.join(have[:8]) or 'none fetched'}); name the split "
                   f"(hfds:{name.repo}:SPLIT) or its files (data.hf_data_files).")


def _kind_glob(snap: str, pattern: str) -> bool:
    """Whether `pattern` finds a data file of a kind jaxpar reads in snapshot `snap`."""
    exts = [e for _, es in DATA_KINDS for e in es]
    return any(os.path.isfile(f) for e in exts
               for f in glob.glob(os.path.join(snap, pattern if pattern.endswith(f".{e}") else f"{pattern}.{e}"),
                                  recursive=True))


def _get(config, key: str):
    sect, _, k = key.rpartition(".")
    return (config[sect] if sect else config)[k]


def _set(config, key: str, value) -> None:
    sect, _, k = key.rpartition(".")
    (config[sect] if sect else config)[k] = value


def resolve_once_per_host(config, workdir: str, weights: bool = True, pins: dict | None = None,
                          datasets: bool = True):
    """`resolve` on every process, downloading once per host: process 0 first (from the commits `workdir/hub.json`
    recorded, so a resume reads the same weights and data), then the first process of each other host at process 0's
    commits, then, after a barrier, the rest from their host's cache. -> (config, {name: commit}). Process 0 says
    what each name resolved to. `pins`: the commits to use (a first call's, when this one fetches the weights)."""
    if not names(config, datasets):
        return config, {}
    path, mine = os.path.join(workdir, PINS), {}

    def first():
        recorded = pins if pins is not None else json.load(open(path)) if os.path.isfile(path) else {}
        mine["out"] = resolve(config, recorded, weights=weights, datasets=datasets)
        return mine["out"][1]

    pins = distributed.from_process_0(first, f"jaxpar/hub/pins/{weights}")
    if distributed.first_on_node() and "out" not in mine:
        mine["out"] = resolve(config, pins, weights=weights, datasets=datasets)
    distributed.barrier(f"jaxpar/hub/fetched/{weights}")
    out = mine.get("out") or resolve(config, pins, local_only=True, weights=weights, datasets=datasets)
    if jax.process_index() == 0 and not weights:
        for text, commit in pins.items():
            print(f"jaxpar: {text} -> commit {commit} (Hugging Face cache)", flush=True)
    return out


def record(workdir: str, pins: dict) -> None:
    """Keep the commits the Hub names resolved to in `workdir/hub.json` (the first start's stay: a resume's are
    the same)."""
    path = os.path.join(workdir, PINS)
    recorded = json.load(open(path)) if os.path.isfile(path) else {}
    if pins and {**pins, **recorded} != recorded:
        with open(path + ".tmp", "w") as f:
            json.dump({**pins, **recorded}, f, indent=2)
        os.replace(path + ".tmp", path)
