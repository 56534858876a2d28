"""`python -m jaxpar.preprocess --sources S --tokenizer T --out PREFIX [--format megatron|tokens]`: any jaxpar data
source(s) as one Megatron `PREFIX.bin/.idx` pair (or a jaxpar token directory). The command line of
`jaxpar.data.preprocess.main`, kept outside `jaxpar.data` so `-m` runs a module the package has not imported yet."""
import sys

from jaxpar.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
