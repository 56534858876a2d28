"""The batch command line's records: JSONL prompts in, JSONL completions out (`python -m jaxpar.generate`).

An input record is `{"prompt": "..."}` or `{"messages": [...]}` (the checkpoint's chat template with the generation
prompt), with optional `id`, `tools` (the functions' JSON schemas the chat template is given, as TRL's `tools` column)
and per-record `max_new_tokens` (int), `temperature` (number) and `stop` (a string or a list of strings); other fields
pass through. An output record is the input's fields plus `completion` (text),
`completion_ids`, `logprobs` (each token's under the sampling distribution), `finish_reason` (`stop` | `length`);
with `--n` > 1 each of those is a list of n.
"""
from __future__ import annotations

import json
import os

TYPES = {"prompt": (str,), "messages": (list,), "max_new_tokens": (int,), "temperature": (int, float),
         "stop": (str, list), "id": (str, int), "tools": (list, str)}


def read(path: str) -> list[tuple[int, dict]]:
    """(line number, record) of every non-blank line of `path`. Raises ValueError naming the line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON record ({e.msg}).") from None
            out.append((n, check(rec, f"{path}:{n}")))
    return out


def check(rec, where: str) -> dict:
    """`rec` if it is a record of the kinds above, else ValueError naming `where`, the field and its type."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record is a JSON object, got {type(rec).__name__}.")
    if ("prompt" in rec) == ("messages" in rec):
        raise ValueError(f"{where}: a record holds exactly one of \"prompt\" or \"messages\".")
    for k, types in TYPES.items():
        if k in rec and (not isinstance(rec[k], types) or isinstance(rec[k], bool)):
            names = " or ".join({"str": "a string", "list": "a list", "int": "an integer",
                                 "float": "a number"}[t.__name__] for t in types)
            raise ValueError(f"{where}: field {k!r} must be {names}, got {type(rec[k]).__name__}.")
    stop = rec.get("stop", [])
    if isinstance(stop, list) and not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"{where}: field 'stop' must list non-empty strings.")
    return rec


def done_count(path: str) -> int:
    """Records already complete in OUT (a resumed run skips them); a last line cut by an interruption is dropped."""
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    good = []
    for line in lines:
        try:
            json.loads(line)
            good.append(line)
        except json.JSONDecodeError:
            break
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(g + "\n" for g in good))
    return len(good)


def output(rec: dict, completions: list, n: int) -> dict:
    """The output record of `rec` and its n completions."""
    fields = {"completion": [c.text for c in completions], "completion_ids": [c.tokens for c in completions],
              "logprobs": [c.logprobs for c in completions], "finish_reason": [c.finish_reason for c in completions]}
    return {**rec, **{k: v if n > 1 else v[0] for k, v in fields.items()}}
