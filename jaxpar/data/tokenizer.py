"""Tokenizers: `ByteTokenizer` (UTF-8 bytes) and `BPETokenizer` (HuggingFace `tokenizers`), saved as JSON."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from jaxpar.data.common import DataError, read_json, write_json


class Tokenizer(Protocol):
    """Text <-> token ids. `vocab_size` bounds every id that `encode` returns."""

    kind: str  # "byte" or "bpe"
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...  # with: BOS where it adds one

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...  # int ids per text

    eot_id: int | None  # the end-of-text id appended to every document, or None (the byte tokenizer has none)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...  # without: special tokens out

    def save(self, directory: str | os.PathLike) -> None: ...

    def to_hf(self): ...  # the same ids as a Hugging Face `tokenizers.Tokenizer` (what an HF export writes)


class ByteTokenizer:
    """The UTF-8 bytes of the text: 256 ids, nothing to train or download. Saved as `byte_tokenizer.json`."""

    kind = "byte"
    vocab_size = 256
    FILENAME = "byte_tokenizer.json"
    eot_id = None  # all 256 ids are bytes: documents are told apart by the document index alone

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))  # (no special tokens to add)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Invalid UTF-8 and ids outside [0, 256) (e.g. padded-vocab ids from a model) decode to U+FFFD (there are
        no special tokens to skip)."""
        return bytes(int(i) if 0 <= int(i) < 256 else 0xFF for i in ids).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        write_json(Path(directory) / self.FILENAME, {"kind": "byte", "vocab_size": 256, "encoding": "utf-8"})

    @staticmethod
    def to_hf():
        """The same ids as a Hugging Face `tokenizers.Tokenizer` (byte-level BPE without merges: byte b is id b),
        for exports that `transformers` loads."""
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        # GPT-2's byte -> printable character table (Radford et al. 2019's encoder.py, `bytes_to_unicode`)
        keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
        chars = {b: chr(b) for b in keep}
        chars.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in chars)})
        tok = HFTokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return tok


class BPETokenizer:
    """A HuggingFace `tokenizers.Tokenizer` (byte-level BPE when trained here). Saved as `tokenizer.json`."""

    kind = "bpe"
    FILENAME = "tokenizer.json"
    EOT = "<|endoftext|>"  # the end-of-text token a tokenizer trained here gets (GPT-2's spelling)
    EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")  # GPT-2, Llama 3, Llama 2 / Mistral, Gemma

    def __init__(self, tokenizer, directory: str | None = None):
        self.hf, self.directory = tokenizer, directory  # directory: where its tokenizer.json was read (chat files)
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.eot_id = next((vocab[t] for t in self.EOT_NAMES if t in vocab), None)

    @classmethod
    def train(cls, texts: Sequence[str], vocab_size: int, special: Sequence[str] = ()) -> "BPETokenizer":
        """Train byte-level BPE on `texts` (deterministic; the vocab may come out smaller on a tiny corpus); id 0 is
        the end-of-text token `EOT`, the `special` tokens (a chat template's markers) follow it."""
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), show_progress=False,
                                      special_tokens=[cls.EOT, *special],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "BPETokenizer":
        """Raises DataError if `path` is missing or not a `tokenizers` JSON file."""
        from tokenizers import Tokenizer as HFTokenizer

        if not Path(path).is_file():
            raise DataError(f"tokenizer file {path} does not exist; give a path to a tokenizer.json, or 'byte'/'bpe'.")
        try:
            return cls(HFTokenizer.from_file(str(path)), str(Path(path).parent))
        except Exception as e:  # the Rust side raises a plain Exception
            raise DataError(f"cannot read tokenizer file {path} ({e}); it must be a HuggingFace tokenizer.json.") from e

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of `text`; `add_special_tokens`: with what the tokenizer.json's post-processor adds (BOS)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids per text (`tokenizers`' batch encoder without offsets, on RAYON_NUM_THREADS threads)."""
        fast = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return [np.asarray(e.ids, np.int64) for e in fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; `skip_special_tokens`: without the special tokens (`transformers`' `decode` of the
        same name: what TRL shows reward functions)."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | os.PathLike) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.hf.save(str(Path(directory) / self.FILENAME))

    def to_hf(self):
        return self.hf


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Read a tokenizer saved by `save(dir)`: a directory, or a `byte_tokenizer.json`/`tokenizer.json` file.

    Raises:
      DataError: nothing readable at `path`.
    """
    p = Path(path)
    if p.is_dir():
        if (p / ByteTokenizer.FILENAME).is_file():
            p = p / ByteTokenizer.FILENAME
        elif (p / BPETokenizer.FILENAME).is_file():
            p = p / BPETokenizer.FILENAME
        else:
            raise DataError(f"no {ByteTokenizer.FILENAME} or {BPETokenizer.FILENAME} in {p}.")
    if p.name == ByteTokenizer.FILENAME:
        spec = read_json(p)
        if spec.get("kind") != "byte" or spec.get("vocab_size") != 256:
            raise DataError(f"{p} is not a byte tokenizer spec: {spec}.")
        return ByteTokenizer()
    return BPETokenizer.from_file(p)
