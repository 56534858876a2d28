"""Prompt records for RL (`train.objective=grpo`, data kind `prompts`): read whole from `data.sources` (JSONL,
Parquet, `hfds:` as fetched), each a `prompt` (a string, or a conversation whose next turn is the assistant's: the
chat template with the generation prompt, as TRL renders it) and any other columns (the reward functions' keywords,
e.g. `solution`), tokenized once as TRL tokenizes them (`special.encode_prompt`: a string with the tokenizer's special
tokens, BOS where it adds one); the validation prompts are `data.val_source` or the last `data.val_fraction` of them. `grpo.map_records` (`MODULE:FUNCTION` or `FILE.py:FUNCTION`, TRL users' `dataset.map`) turns each record into
that form first; built in: `jaxpar.data.prompts:gsm8k` (GSM8K's `question` asked after a system prompt, the number
after its answer's `####` as `solution`). A record without a prompt, or a prompt with no room left for a whole
completion, is refused in one line naming its file and line.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from jaxpar.data import chat, records, sources as src, special
from jaxpar.config import cache_root
from jaxpar.data.common import DataError, user_function
from jaxpar.data.preprocess import model_vocab, resolve_tokenizer
from jaxpar.data.tokenizer import load_tokenizer


@dataclasses.dataclass(frozen=True)
class PromptInfo:
    """What a run records of its prompts (as `DataInfo` for documents): the tokenizer, the data's identity."""
    tokenizer_dir: str
    tokenizer_kind: str
    vocab_size: int
    identity: str


@dataclasses.dataclass
class Prompts:
    """A split's prompt records, their token ids and where each is (`FILE, line N`)."""
    records: list
    ids: list
    where: list

    def __len__(self) -> int:
        return len(self.records)

    def order(self, epoch: int, seed: int) -> np.ndarray:
        """The records' order in `epoch` (a fresh permutation per epoch, the same for a seed on every layout)."""
        return np.random.default_rng([seed, epoch]).permutation(len(self))

    def take(self, first: int, count: int, seed: int) -> list:
        """Indices of the `count` prompts from position `first` of the epochs' orders (a round: `first` = round x
        count)."""
        n, orders = len(self), {}
        for k in range(first, first + count):  # (each epoch's order drawn once)
            orders.setdefault(k // n, self.order(k // n, seed))
        return [int(orders[k // n][k % n]) for k in range(first, first + count)]


GSM8K_SYSTEM = ("Solve the problem step by step, then give the final number inside <answer></answer>, e.g. "
                "<answer>42</answer>.")


def gsm8k(record: dict) -> dict:
    """A GSM8K record (`question`, `answer` ending in `#### N`) as a conversational prompt and its `solution`."""
    return {"prompt": [{"role": "system", "content": GSM8K_SYSTEM}, {"role": "user", "content": record["question"]}],
            "solution": record["answer"].rsplit("####", 1)[-1].strip().replace(",", "")}


def _mapped(every: list, spec: str) -> list:
    if not spec:
        return every
    try:
        name, fn = user_function(spec, "grpo.map_records", "jaxpar.data.prompts:gsm8k")
    except ValueError as e:
        raise DataError(str(e)) from None
    out = []
    for rec, where in every:
        try:
            out.append((fn(rec), where))
        except Exception as e:  # noqa: BLE001 - the user's function: said in one line with its record
            raise DataError(f"{where}: grpo.map_records function {name!r} raised {type(e).__name__}: {e}.") from None
    return out


def _records(spec: str, unit_mb: int) -> list:
    out = []
    for s in src.parse_sources(spec):
        if s.kind not in ("jsonl", "parquet"):
            raise DataError(f"data.sources={spec!r}: RL reads prompt records from JSONL or Parquet files (or hfds:); "
                            f"{s.path} is read as {s.kind}.")
        for unit in src.plan_units(s, b"", unit_mb << 20):
            out += list(records.records(unit))
    return out


def _encode(rec, where: str, fmt, tok) -> np.ndarray:
    prompt = rec.get("prompt") if isinstance(rec, dict) else None
    if isinstance(prompt, list) or (isinstance(prompt, str) and prompt):
        return np.asarray(special.encode_prompt(prompt, tok, fmt, where, rec.get("tools")), np.int32)
    keys = sorted(rec)[:8] if isinstance(rec, dict) else type(rec).__name__
    raise DataError(f"{where}: a prompt record needs `prompt` (a string or a list of messages), as TRL's GRPO "
                    f"datasets have; it has {keys}.")


def read(config) -> tuple[PromptInfo, tuple[Prompts, Prompts]]:
    """(the prompts' info, (train, val) prompts) of `data.sources` and `data.val_source` / `data.val_fraction`.

    Raises:
      DataError: a source that is not records, a record without a prompt, a prompt too long for a completion."""
    d, T, room = config.data, int(config.model.seq_len), int(config.grpo.max_completion_length)
    if d.tokenizer == "bpe":
        raise DataError("train.objective='grpo' samples text with a trained tokenizer: give its tokenizer.json "
                        "(data.tokenizer=PATH, or init_from=hf:DIR, whose tokenizer is taken).")
    tok_dir, tok_id = resolve_tokenizer(d, [], {}, cache_root(config), b"")
    tok = load_tokenizer(tok_dir)
    model_vocab(config, tok.vocab_size)  # every id has a row
    train_recs = _mapped(_records(d.sources, int(d.unit_mb)), config.grpo.map_records)
    n_val = 0 if d.val_source else int(len(train_recs) * float(d.val_fraction))
    every = train_recs + (_mapped(_records(d.val_source, int(d.unit_mb)), config.grpo.map_records)
                          if d.val_source else [])
    fmt = chat.ChatFormat.from_dir(tok_dir, d.chat_template) if any(
        isinstance(r, dict) and isinstance(r.get("prompt"), list) for r, _ in every) else None
    ids = []
    for rec, where in every:
        ids.append(_encode(rec, where, fmt, tok))
        if not 0 < ids[-1].size <= T + 1 - room:
            raise DataError(f"{where}: the prompt has {ids[-1].size} tokens; with model.seq_len={T} and "
                            f"grpo.max_completion_length={room} a prompt has room for {T + 1 - room}: raise "
                            f"model.seq_len, lower grpo.max_completion_length, or shorten the prompt.")
    cut = len(train_recs) - n_val
    split = lambda a, b: Prompts([r for r, _ in every[a:b]], ids[a:b], [w for _, w in every[a:b]])  # noqa: E731
    train, val = split(0, cut), split(cut, len(every))
    if not len(train):
        raise DataError(f"data.sources={d.sources!r} holds no prompt for training ({len(train_recs)} records, "
                        f"data.val_fraction={d.val_fraction}).")
    digest = hashlib.sha256(json.dumps([[r for r, _ in every], tok_id, cut], sort_keys=True, default=str)
                            .encode()).hexdigest()[:16]
    return PromptInfo(tok_dir, tok.kind, tok.vocab_size, f"prompts-{digest}"), (train, val)


def stop_ids(info: PromptInfo, config) -> tuple:
    """The ids that end a completion (`special.end_ids`: generation_config.json's, the tokenizer's EOS, the chat
    template's end of turn)."""
    tok = load_tokenizer(info.tokenizer_dir)
    return special.end_ids(tok, special.chat_format(tok, config.data.chat_template))
