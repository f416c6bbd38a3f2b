"""Content fingerprints of files: what a run spec pins so that peers use the same bytes.

A fingerprint reads a bounded sample of each file (``SAMPLES`` chunks of ``CHUNK`` bytes at
evenly spaced offsets, first and last included), so it costs the same for a 2 GB dataset
as for a 2 MB one; it is written ``<files>f-<bytes>b-<hash>`` (e.g.
``3f-1048576b-0123456789abcdef``): the file count and total size in the clear, so that a
mismatch can say what differs, then 16 hex characters of SHA-256 over every file's
relative name, size and sampled chunks. Two sets of files with the same fingerprint may
still differ outside the sampled chunks; a changed, added, removed, renamed, grown or
shrunk file changes it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CHUNK = 64 * 1024
SAMPLES = 8
PATTERN = r"^[0-9]{1,9}f-[0-9]{1,19}b-[0-9a-f]{16}$"
_PARSE = re.compile(r"^([0-9]+)f-([0-9]+)b-([0-9a-f]{16})$")


@dataclass(frozen=True)
class Fingerprint:
    """Files, total bytes and the sampled hash of a set of files."""

    n_files: int
    n_bytes: int
    digest: str  # 16 hex

    def __str__(self) -> str:
        return f"{self.n_files}f-{self.n_bytes}b-{self.digest}"

    @classmethod
    def parse(cls, text: str) -> Fingerprint:
        """The fingerprint written ``<files>f-<bytes>b-<hash>``; ValueError otherwise."""
        match = _PARSE.match(text)
        if match is None:
            raise ValueError(f"not a fingerprint: {text!r} (want <files>f-<bytes>b-<16 hex>)")
        return cls(int(match[1]), int(match[2]), match[3])


def _sample_hash(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        if size <= CHUNK * SAMPLES:
            digest.update(f.read())
        else:
            step = (size - CHUNK) // (SAMPLES - 1)
            for i in range(SAMPLES):
                f.seek(i * step)
                digest.update(f.read(CHUNK))
    return digest.hexdigest()


def fingerprint_files(files: Sequence[tuple[Path, str]]) -> Fingerprint:
    """Fingerprint of ``files`` given as (path, name relative to the data root), in order.
    Raises OSError when a file cannot be read."""
    digest = hashlib.sha256(b"wanswarm-fingerprint-v1\n")
    total = 0
    for path, name in files:
        size = path.stat().st_size
        total += size
        digest.update(f"{name}\0{size}\0{_sample_hash(path, size)}\n".encode())
    return Fingerprint(len(files), total, digest.hexdigest()[:16])


def describe_difference(expected: str, actual: Fingerprint, what: str) -> str:
    """One sentence saying how ``actual`` differs from the ``expected`` fingerprint."""
    try:
        want = Fingerprint.parse(expected)
    except ValueError:
        return f"{what}: the run spec's fingerprint {expected!r} is malformed"
    if want == actual:
        return ""
    head = f"{what} differs from the run's (ours {actual}, the run spec's {want}): "
    if want.n_files != actual.n_files:
        return head + f"{actual.n_files} files here, {want.n_files} in the run"
    if want.n_bytes != actual.n_bytes:
        return head + (
            f"same number of files but {actual.n_bytes} bytes here, {want.n_bytes} in the run"
        )
    return head + "same files and sizes, but the content (or a file name) differs"
