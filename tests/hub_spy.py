"""Run a script (train.py) with `huggingface_hub.snapshot_download` watched: every call appends a JSON line
{process, local_files_only, start, end} to $HUB_SPY_LOG (tests/test_multihost.py: one download per host).

    HUB_SPY_LOG=calls.jsonl python tests/hub_spy.py train.py --config ...
"""
import json
import os
import runpy
import sys
import time

import huggingface_hub

_real = huggingface_hub.snapshot_download


def _watched(*args, **kwargs):
    start = time.time()
    out = _real(*args, **kwargs)
    with open(os.environ["HUB_SPY_LOG"], "a") as f:
        f.write(json.dumps({"process": int(os.environ.get("JAXPAR_PROCESS_ID", 0)), "start": start, "end": time.time(),
                            "local_files_only": bool(kwargs.get("local_files_only"))}) + "\n")
    return out


huggingface_hub.snapshot_download = _watched
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
