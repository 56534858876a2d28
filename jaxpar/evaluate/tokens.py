"""The model's tokenizer as lm-eval's backends use it: a `transformers` tokenizer (encode with or without special
tokens, decode, BOS/EOS, the chat template), read from the model's tokenizer directory."""
from __future__ import annotations

import os

from jaxpar.data import BPETokenizer, ByteTokenizer
from jaxpar.data.chat import chat_files


def hf_tokenizer_of(tokenizer):
    """The `transformers` form of a model's tokenizer (`data.Tokenizer`, read from its directory: `hf_tokenizer`).

    Raises:
      ValueError: a byte tokenizer (no `transformers` form)."""
    directory = getattr(tokenizer, "directory", None)
    if directory is None:
        raise ValueError("the model has a byte tokenizer: lm-eval's tasks need a `transformers` tokenizer; evaluate "
                         "a model trained with a BPE tokenizer (data.tokenizer), or one from a Hugging Face checkpoint.")
    return hf_tokenizer(directory)


def hf_tokenizer(directory: str):
    """`AutoTokenizer` of a directory with a tokenizer_config.json (a Hugging Face model, an export, a run started
    from one); else a fast tokenizer over its bare tokenizer.json (a BPE trained by jaxpar), EOS its end-of-text.

    Raises:
      ValueError: a byte tokenizer (no `transformers` form), or no tokenizer in the directory."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(directory, ByteTokenizer.FILENAME)):
        raise ValueError(f"{directory} holds a byte tokenizer: lm-eval's tasks need a `transformers` tokenizer; "
                         f"evaluate a model trained with a BPE tokenizer (data.tokenizer), or export it with one.")
    if os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(directory)
    path = os.path.join(directory, BPETokenizer.FILENAME)
    if not os.path.isfile(path):
        raise ValueError(f"no tokenizer_config.json or {BPETokenizer.FILENAME} in {directory}.")
    eot = BPETokenizer.from_file(path).eot_id
    tok = PreTrainedTokenizerFast(tokenizer_file=path, **{k: v for k, v in chat_files(directory).items()})
    if eot is not None and tok.eos_token is None:
        tok.eos_token = tok.convert_ids_to_tokens(eot)
    tok.name_or_path = directory
    return tok
