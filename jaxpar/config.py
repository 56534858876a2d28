"""The config: `base_config()` (every key at its default, from the table in `jaxpar/config_keys/`), and the small
facts every room reads (`mlp_width`, `padded_vocab`, `mesh_shape`, `step_rules`). Imports nothing of jaxpar but that
table and the error class, so every room may import it. The rules that need their owners (model, kernels, loss
scale, schedules) are `jaxpar/validate.py`, which only entry points import.

Config files in `configs/` start from `base_config()` and change what they need.
"""
from __future__ import annotations

import difflib
import math
import os
import pathlib
import re
import sys

import ml_collections

from jaxpar.config_keys import (DEFAULT_RULES, DTYPES, KEYS, MESH_AXES, NEW_RULES, OFFLOAD,  # noqa: F401
                                REMAT_POLICIES, ROUTERS)  # (re-exported)
from jaxpar.config_keys import get as _get  # noqa: F401
from jaxpar.errors import ConfigError  # noqa: F401 (re-exported: raised by every room that checks a config)


def base_config() -> ml_collections.ConfigDict:
    """Every key at its default (`config_keys.KEYS`: the one table of defaults, types, ranges and meanings)."""
    c = ml_collections.ConfigDict()
    for k in KEYS:
        *section, name = k.name.split(".")
        if section and section[0] not in c:
            c[section[0]] = ml_collections.ConfigDict()
        (c[section[0]] if section else c)[name] = k.default
    return c


def config_beside(config_file: str, name: str) -> ml_collections.ConfigDict:
    """`get_config()` of the config file `name` in the folder of `config_file` (a config file's `__file__`): for a
    config that starts from another one (ml_collections loads a config file without its folder on the path)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(config_file)), name)
    spec = importlib.util.spec_from_file_location(os.path.splitext(name)[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def mlp_width(config) -> int:
    return config.model.mlp or 4 * config.model.embed


def cache_root(config) -> pathlib.Path:
    """Where prepared data and compiled programs are cached: `config.data.cache_dir`, else `$JAXPAR_CACHE`, else
    `~/.cache/jaxpar`."""
    root = config.data.cache_dir or os.environ.get("JAXPAR_CACHE") or "~/.cache/jaxpar"
    return pathlib.Path(os.path.expanduser(root))


def padded_vocab(vocab_size: int, tensor: int) -> int:
    """Smallest multiple of lcm(128, tensor) >= vocab_size (Megatron's `make-vocab-size-divisible-by`)."""
    m = 128 * tensor // math.gcd(128, tensor)
    return -(-vocab_size // m) * m


def mesh_shape(config, num_devices: int) -> dict[str, int]:
    """Resolve `data = -1` into the devices left over; returns the sizes of `MESH_AXES`, in its order."""
    t, s, e, c, d = (int(config.mesh[a]) for a in ("tensor", "stage", "expert", "context", "data"))
    for name, v in (("tensor", t), ("stage", s), ("expert", e), ("context", c)):
        if v < 1:
            raise ConfigError(f"mesh.{name}={v}: must be >= 1.")
    rest = t * s * e * c
    extra = (f" x mesh.expert={e}" if e > 1 else "") + (f" x mesh.context={c}" if c > 1 else "")
    named = f"mesh.tensor={t} x mesh.stage={s}" + extra
    if d == -1:
        if num_devices % rest:
            raise ConfigError(f"{named} = {rest} does not divide the {num_devices} devices; pick sizes whose product "
                              f"divides {num_devices}.")
        d = num_devices // rest
    if d < 1 or d * rest != num_devices:
        raise ConfigError(
            f"layout data={d} x tensor={t} x stage={s}" + extra.replace("mesh.", "") +
            f" = {d * rest} devices, but {num_devices} are present; set --config.mesh.data=-1 to use the rest, or "
            f"make the product {num_devices}.")
    sizes = {"data": d, "stage": s, "expert": e, "context": c, "tensor": t}
    return {a: sizes[a] for a in MESH_AXES}


def nearest_multiples(value: int, m: int) -> str:
    """The multiples of `m` nearest `value` on either side: "4 or 8" for (6, 4); "8" for (2, 8) (0 is no size)."""
    lo, hi = value // m * m, -(-value // m) * m
    return " or ".join(str(x) for x in dict.fromkeys((lo, hi)) if x > 0)


def step_rules(config) -> tuple:
    """`config.rules` with model.sequence_parallel applied (`act_seq` -> `tensor`); a rules table written before the
    expert axis gets its rules (`NEW_RULES` at their defaults, the batch also split over `expert`)."""
    rules = tuple(tuple(r) for r in config.rules)
    names = dict(rules)
    rules += tuple(r for r in DEFAULT_RULES if r[0] in NEW_RULES and r[0] not in names)
    batch = tuple(a for a in ((names.get("batch"),) if isinstance(names.get("batch"), str)
                              else names.get("batch") or ()))
    if "batch" in names and "expert" not in batch:
        rules = tuple(("batch", batch + ("expert",)) if n == "batch" else (n, a) for n, a in rules)
    if not config.model.sequence_parallel:
        return rules
    return tuple((n, "tensor") if n == "act_seq" else (n, a) for n, a in rules)


RENAMED = {"data.corpus": "data.sources"}  # keys of older jaxpar versions: their names now


def flat_keys(config, prefix: str = "") -> list[str]:
    """The dotted keys of a config (`rules` is one key)."""
    out = []
    for k, v in config.items():
        if isinstance(v, ml_collections.ConfigDict) and k != "rules":
            out += flat_keys(v, prefix + k + ".")
        else:
            out.append(prefix + k)
    return out


def unknown_keys(keys) -> list[str]:
    """One message per key of `keys` that `base_config()` does not have, naming its new name or the nearest key."""
    known = set(flat_keys(base_config()))
    errs = []
    for k in keys:
        if k in known or k.split(".")[0] == "rules":
            continue
        near = RENAMED.get(k) or _nearest(k, sorted(known))
        hint = f"; it is now {near}" if k in RENAMED else (f"; did you mean {near}?" if near else "")
        errs.append(f"{k}: no such config key{hint} (every key: docs/config.md).")
    return errs


def _nearest(key: str, known: list[str]) -> str | None:
    """The known key `key` most likely meant: one it begins (optim.zero -> optim.zero_stage), else the closest
    spelling in its own section, else anywhere."""
    longer = [k for k in known if k.startswith(key)]
    if longer:
        return min(longer, key=len)
    section = [k for k in known if k.rsplit(".", 1)[0] == key.rsplit(".", 1)[0]]
    return next(iter(difflib.get_close_matches(key, section, 1, 0.6) or difflib.get_close_matches(key, known, 1, 0.6)),
                None)


def check_command_line(argv) -> None:
    """`--config.KEY=VALUE` arguments naming no key: one line each, before ml_collections meets them (its error is a
    traceback). Raises ConfigError."""
    keys = [m.group(1) for a in argv if (m := re.match(r"--config\.([^=\s]+)", a))]
    errs = unknown_keys(keys)
    if errs:
        raise ConfigError(" ".join(f"--config.{e}" for e in errs))


# ---- docs/config.md's key table, from the key table ------------------------------------------------------------

def _cell(v) -> str:
    return "`DEFAULT_RULES`" if v is DEFAULT_RULES else f"`{v!r}`"


def reference_table() -> str:
    """The Markdown table of every key (docs/config.md, section "Keys")."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{k.name}` | {_cell(k.default)} | {k.meaning} |" for k in KEYS]
    return "\n".join(rows) + "\n"


def write_reference(path) -> bool:
    """Replace the table of `path`'s "## Keys" section with `reference_table()`; True when it changed."""
    path = pathlib.Path(path)
    text = path.read_text()
    head, rest = text.split("## Keys\n", 1)
    start = rest.index("| key |")
    end = rest.index("\n\n", start) + 1
    new = head + "## Keys\n" + rest[:start] + reference_table() + rest[end:]
    path.write_text(new)
    return new != text


if __name__ == "__main__":  # python -m jaxpar.config [docs/config.md]
    target = sys.argv[1] if len(sys.argv) > 1 else "docs/config.md"
    print(f"{target}: {'rewritten' if write_reference(target) else 'up to date'}")
