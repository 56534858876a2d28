"""Records of conversations and prompt/completion pairs (`jaxpar/data/chat.py`) into the token store: each record
one document of ids, with its loss mask beside it (`PREFIX-mask.bin/.idx`, one uint8 per token)."""
from __future__ import annotations

from typing import Iterator

import numpy as np

from jaxpar.data import chat, megatron, sources as src
from jaxpar.data.common import DataError
from jaxpar.data.tokens import MASK


def holds_records(source: src.Source, units) -> bool:
    """Whether a JSONL or Parquet source holds conversations or prompt/completion records (judged by its first
    record, as TRL judges a dataset): those are encoded as whole sequences with a loss mask."""
    return source.kind in ("jsonl", "parquet") and bool(units) and \
        chat.record_kind(first_record(units[0])) is not None


def packing(config, needs: str = "") -> str:
    """`data.packing` with `auto` resolved (the one rule for training, `--dry_run` and the planner): `needs`, the
    packing the objective's data requires whatever the records (`Objective.packing`: `bfd` for DPO's pairs, `concat`
    for a ViT's images); else `bfd` (whole sequences, never cut) where a source holds conversations, prompt/completion
    or preference records (`holds_records`: a JSONL or Parquet source's first record), `concat` for text.

    Raises:
      DataError: a JSONL or Parquet source of `data.sources` or `data.val_source` with no files to judge."""
    d = config.data
    if d.packing != "auto":
        return d.packing
    if needs:
        return needs
    every = src.parse_sources(d.sources) + (src.parse_sources(d.val_source) if d.val_source else [])
    sep = src.separator(d.doc_separator)
    judged = [s for s in every if s.kind in ("jsonl", "parquet")]
    return "bfd" if any(holds_records(s, src.plan_units(s, sep, int(d.unit_mb) << 20)) for s in judged) else "concat"


def with_packing(config, needs: str = ""):
    """`config` with `data.packing` resolved (`packing`): a copy when it was `auto`, else `config` itself."""
    if config.data.packing != "auto":
        return config
    resolved = packing(config, needs)
    config = config.copy_and_resolve_references()
    config.data.packing = resolved
    return config


def conversation_settings(d, tok_dir: str, any_records: bool) -> dict:
    """What encoding records depends on (part of their cache entries' key): the chat template, the special tokens,
    the rules that render and mask them (`chat.RULES`), `data.loss_on`. Checked here, before anything is written: a
    template is there and parses."""
    if d.loss_on not in ("auto", "all") and not any_records:
        raise DataError(f"data.loss_on={d.loss_on!r} needs conversations or prompt/completion records; "
                        f"data.sources={d.sources!r} holds text (use auto or all).")
    if not any_records:
        return {}
    fmt = chat.ChatFormat.from_dir(tok_dir)
    return {"chat": {"template": fmt.source, "where": fmt.where, "special": fmt.special, "rules": chat.RULES},
            "loss_on": d.loss_on}


def encode_records(unit, prefix: str, tok, settings: dict) -> dict:
    """One unit of records into the shard `prefix` and its loss mask `prefix-mask`: each record one document
    (`chat.example`; a `text` record is its tokens and the end-of-text token, every token in the loss)."""
    c = settings["chat"]
    fmt = chat.ChatFormat(tok.hf, c["template"], c["where"], c["special"])
    docs = tokens = no_loss = identical = 0
    with megatron.Writer(prefix, megatron.best_dtype(tok.vocab_size)) as w, \
            megatron.Writer(prefix + MASK, np.uint8) as wm:
        for obj, where in records(unit):
            ids, mask = _record_tokens(obj, where, fmt, tok, settings)
            w.write(ids)
            wm.write(mask)
            w.end_document()
            wm.end_document()
            docs, tokens, no_loss = docs + 1, tokens + ids.size, no_loss + (not mask.any())
            identical += chat.record_kind(obj) == "preference" and obj["chosen"] == obj["rejected"]
    return {"docs": docs, "tokens": tokens, "bytes": src.unit_bytes(unit), "no_loss": no_loss,
            "identical": identical}


def _record_tokens(obj, where: str, fmt, tok, settings: dict):
    if chat.record_kind(obj) is not None:
        return chat.example(obj, where, fmt, settings["loss_on"])
    text = obj.get(settings["field"]) if isinstance(obj, dict) else None
    if not isinstance(text, str):
        keys = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f"{where}: a record needs `messages`, `prompt` and `completion`, or the text field "
                        f"{settings['field']!r} (data.text_field); it has {keys}.")
    ids = np.asarray(tok.encode(text) + ([] if settings["eot"] is None else [settings["eot"]]), np.int32)
    keep = settings["loss_on"] in ("auto", "all")  # a text record has no assistant or completion tokens
    return ids, np.full(ids.size, keep, np.uint8)


def records(unit: src.Unit) -> Iterator[tuple[object, str]]:
    """(record, where it is: "FILE, line N" or "FILE, row N") of a JSONL or Parquet unit, in order."""
    for path, start, stop in unit.pieces():
        if unit.kind == "parquet":
            yield from _parquet_rows(path, start, stop)
            continue
        buf, off, line_no = b"", start, None
        for block in src.read_blocks(path, start, stop):
            buf += block
            lines = buf.split(b"\n")
            buf = lines.pop()
            for line in lines:
                line_no = src.line_number(path, off) if line_no is None else line_no + 1
                if line.strip():
                    yield src.parse_line(line, path, off), f"{path}, line {line_no}"
                off += len(line) + 1
        if buf.strip():
            line_no = src.line_number(path, off) if line_no is None else line_no + 1
            yield src.parse_line(buf, path, off), f"{path}, line {line_no}"


def first_record(unit: src.Unit):
    """The unit's first record (None for a unit without any)."""
    return next((obj for obj, _ in records(unit)), None)


def _parquet_rows(path: str, start: int, stop: int) -> Iterator[tuple[object, str]]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    row = sum(f.metadata.row_group(g).num_rows for g in range(start))
    for batch in f.iter_batches(batch_size=1024, row_groups=range(start, stop)):
        for obj in batch.to_pylist():
            yield obj, f"{path}, row {row}"
            row += 1
