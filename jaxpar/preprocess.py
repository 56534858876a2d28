"""`python -m jaxpar.preprocess --sources S --tokenizer T --out PREFIX [--format megatron|tokens]`: any jaxpar data
source(s) as one Megatron `PREFIX.bin/.idx` pair (or a jaxpar token directory), so data moves between the two stacks.
The command line over `jaxpar.data.prepare` and `jaxpar.data.preprocess.write_out`: a module of its own, outside
`jaxpar.data`, so `-m` runs a module the package has not imported yet. Guide: docs/data.md."""
import argparse
import json
import sys

from jaxpar.config import base_config
from jaxpar.data import DataError, prepare
from jaxpar.data.preprocess import write_out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxpar.preprocess", description=__doc__.split("\n")[0].split(": ", 1)[1],
                                epilog="Guide: docs/data.md.")
    p.add_argument("--sources", required=True, help="a source or a blend '0.3 A 0.7 B' (see jaxpar/data/sources.py)")
    p.add_argument("--tokenizer", default="byte", help="byte | bpe | a tokenizer.json")
    p.add_argument("--out", required=True, help="PREFIX of PREFIX.bin/.idx (megatron), or a directory (tokens)")
    p.add_argument("--format", choices=("megatron", "tokens"), default="megatron")
    for key, kind in (("workers", int), ("text_field", str), ("doc_separator", str), ("bpe_vocab_size", int),
                      ("bpe_sample_mb", int), ("cache_dir", str), ("unit_mb", int)):
        p.add_argument(f"--{key}", type=kind, default=None)
    a = p.parse_args(argv)
    c = base_config()
    c.data.update(val_fraction=0.0, **{k: v for k, v in vars(a).items() if v is not None and k in c.data})
    try:
        info = prepare(c)
        write_out(info, a.out, a.format)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": a.out, "format": a.format, "documents": sum(s.num_docs for s in info.streams()),
                      "tokens": sum(s.num_tokens for s in info.streams())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
