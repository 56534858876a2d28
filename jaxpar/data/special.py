"""Where a checkpoint's text begins and ends, as its own files say: one rule for every caller that builds prompts or
stop sets (`python -m jaxpar.generate`, `sample.py`, evaluation, GRPO).

- **End ids** (`end_ids`): the union of `generation_config.json`'s `eos_token_id` (an int or a list: Qwen2.5/Qwen3
  declare `<|im_end|>` and `<|endoftext|>`, Llama 3.1 three ids), the tokenizer's end of sequence
  (`tokenizer_config.json`'s `eos_token`; a bare tokenizer.json's end-of-text token) and the chat template's end of
  turn. transformers' `generate` stops at the first of the first two; the third ends a reply the template closes.
  A model with none of them is said once (its completions end only at their token budget or a stop string).
- **Prompts** (`encode_prompt`): a string is encoded with the tokenizer's special tokens (its tokenizer.json
  post-processor: Llama's, Mistral's and Gemma's BOS), as TRL (`processing_class(text=prompts)`), vLLM and jaxpar's
  SFT encode it; a conversation is rendered by the chat template with the generation prompt and encoded without
  them (the template writes them).

`generation_config.json` travels with the tokenizer: it is copied beside the tokenizer.json into the data cache and a
run's `tokenizer/` (so a run, and its exports, keep the end ids of the checkpoint it started from), and a Hugging
Face export writes the union as its own `generation_config.json`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxpar.data import chat
from jaxpar.data.common import DataError

GENERATION_CONFIG = "generation_config.json"
_SAID: set = set()  # the directories whose missing end ids were said


def generation_eos(directory) -> list[int]:
    """`eos_token_id` of DIR/generation_config.json as a list (none: []).

    Raises:
      DataError: the file is not JSON, or its `eos_token_id` is neither an int nor a list of ints."""
    path = Path(directory) / GENERATION_CONFIG if directory else None
    if path is None or not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except ValueError as e:
        raise DataError(f"{path} is not JSON ({e}); fix or remove it.") from None
    eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(eos, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
        raise DataError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}.")
    return eos


def _tokenizer_eos(tok, directory) -> int | None:
    """The tokenizer's end of sequence: tokenizer_config.json's `eos_token`, else its end-of-text token."""
    name = chat._token_text(chat._read_config(Path(directory)).get("eos_token")) if directory else None
    hf = getattr(tok, "hf", None)
    found = hf.token_to_id(name) if name and hf is not None else None
    return found if found is not None else tok.eot_id


def end_ids(tok, fmt=None, say: bool = True) -> tuple[int, ...]:
    """The ids that end a completion of the model whose tokenizer is `tok` (`data.Tokenizer`, its files in
    `tok.directory`) and chat format `fmt` (`chat.ChatFormat` or None), sorted; ids past the vocabulary dropped.
    With `say`, a model with none is said once on stderr."""
    directory = getattr(tok, "directory", None)
    ids = set(generation_eos(directory))
    eos = _tokenizer_eos(tok, directory)
    ids |= {eos} if eos is not None else set()
    ids |= set(fmt.stop_ids) if fmt is not None else set()
    ids = tuple(sorted(i for i in ids if 0 <= i < tok.vocab_size))
    if not ids and say and str(directory) not in _SAID:
        _SAID.add(str(directory))
        print(f"jaxpar: the model's tokenizer ({directory or tok.kind}) declares no end of sequence "
              f"({GENERATION_CONFIG}'s eos_token_id, tokenizer_config.json's eos_token or a chat template's end of "
              f"turn): completions end only at their token budget or a stop string.", file=sys.stderr)
    return ids


def chat_format(tok, given: str = ""):
    """The chat format of the tokenizer's directory (`chat.ChatFormat`: its template, or `given`'s, and special
    tokens), or None when it has none that reads (no template, no tokenizer.json: a byte tokenizer)."""
    directory = getattr(tok, "directory", None)
    try:
        return None if directory is None else chat.ChatFormat.from_dir(directory, given)
    except DataError:
        return None


def generation_config(tok, bos_id: int | None) -> dict:
    """What an export writes as its generation_config.json: the end ids (`end_ids`, an int when one) and BOS;
    {} when the model declares no end."""
    ends = end_ids(tok, chat_format(tok), say=False)
    if not ends:
        return {}
    return ({} if bos_id is None else {"bos_token_id": bos_id}) | {"eos_token_id": ends[0] if len(ends) == 1
                                                                   else list(ends)}


def encode_prompt(prompt, tok, fmt=None, where: str = "", tools=None) -> list[int]:
    """A prompt's ids: a string with the tokenizer's special tokens; a conversation (a list of messages) rendered
    by `fmt`'s chat template with the generation prompt, without them, given `tools` (the record's functions' JSON
    schemas, `messages.check_tools`).

    Raises:
      DataError: a conversation with no chat template, or a malformed one (naming `where`)."""
    if isinstance(prompt, str):
        return list(tok.encode(prompt, add_special_tokens=True))
    if fmt is None:
        raise DataError(f"{where}: a conversational prompt needs a chat template; the tokenizer has none (give one "
                        f"with --config.data.chat_template=FILE).")
    fmt = fmt.with_tools(chat.check_tools(tools, where))
    return fmt.prompt(chat.check_messages(prompt, "prompt", where)).tolist()

