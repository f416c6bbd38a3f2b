"""Tokenizers: byte-level (the default, nothing to download) or a Hugging Face ``tokenizers``
JSON file named by the run spec, and training a byte-level BPE one from the run's data.

A run that names ``data.tokenizer`` pins its SHA-256 (``data.tokenizer_sha256``, part of the
run id); loading checks it, and that its vocabulary fits ``model.vocab_size``. The
``tokenizers`` package is imported only then (the ``models`` or ``data`` extra). ``encode``
returns int64 numpy arrays, so that packing windows costs no Python loop per token.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..config.runspec import RunSpec
from ..errors import NodeError

EXTRA_HINT = "pip install 'wanswarm[data]' (or 'wanswarm[models]')"
NEWLINE = 10


class TokenizerError(NodeError):
    """The run's tokenizer is missing, differs from the spec's hash, or does not fit it."""


class Tokenizer(Protocol):
    """What the data stream needs of a tokenizer."""

    vocab_size: int
    separator: np.ndarray  # (k,) int64: appended after every document

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text``, (n,) int64."""
        ...


class ByteTokenizer:
    """UTF-8 bytes: one token per byte, vocabulary 256; documents end with a newline."""

    vocab_size = 256
    separator = np.array([NEWLINE], dtype=np.int64)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


class HFTokenizer:
    """A ``tokenizers`` JSON file; documents end with ``eos_token`` (or a newline's tokens)."""

    def __init__(self, inner: Any, eos_token: str | None) -> None:
        self.inner = inner
        self.vocab_size = int(inner.get_vocab_size(with_added_tokens=True))
        if eos_token is None:
            self.separator = np.asarray(inner.encode("\n").ids, dtype=np.int64)
        else:
            eos = inner.token_to_id(eos_token)
            if eos is None:
                raise TokenizerError(f"data.eos_token {eos_token!r} is not in the tokenizer")
            self.separator = np.array([eos], dtype=np.int64)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.inner.encode(text).ids, dtype=np.int64)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _tokenizers_module() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(f"this run names a tokenizer file: {EXTRA_HINT}") from None
    return tokenizers


def load_tokenizer(spec: RunSpec) -> Tokenizer:
    """The run's tokenizer, checked against the spec; TokenizerError naming what differs."""
    data = spec.data
    if data.tokenizer is None:
        return ByteTokenizer()
    path = Path(data.tokenizer)
    try:
        actual = sha256_file(path)
    except OSError as exc:
        raise TokenizerError(f"cannot read data.tokenizer {path}: {exc.strerror or exc}") from None
    if actual != data.tokenizer_sha256:
        raise TokenizerError(
            f"data.tokenizer {path} has SHA-256 {actual}, the run spec pins "
            f"{data.tokenizer_sha256}: this is another tokenizer than the run's"
        )
    tokenizers = _tokenizers_module()
    try:
        inner = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises plain Exception for a bad file
        raise TokenizerError(
            f"data.tokenizer {path} is not a tokenizers JSON file: {exc}"
        ) from None
    tokenizer = HFTokenizer(inner, data.eos_token)
    if tokenizer.vocab_size > spec.model.vocab_size:
        raise TokenizerError(
            f"data.tokenizer {path} has {tokenizer.vocab_size} tokens, more than "
            f"model.vocab_size = {spec.model.vocab_size}"
        )
    return tokenizer


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    out: Path,
    special_tokens: tuple[str, ...] = ("<|endoftext|>",),
    min_frequency: int = 2,
) -> dict[str, Any]:
    """Train a byte-level BPE tokenizer on ``texts`` (offline) and save it as JSON to ``out``.

    Returns what a run spec needs: the file, its SHA-256 and its vocabulary size."""
    tokenizers = _tokenizers_module()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Canonical JSON (sorted keys), so that training twice on the same data gives the same
    # file and hash.
    text = json.dumps(json.loads(tokenizer.to_str()), sort_keys=True, ensure_ascii=False)
    out.write_text(text + "\n", encoding="utf-8")
    return {
        "tokenizer": str(out),
        "tokenizer_sha256": sha256_file(out),
        "vocab_size": int(tokenizer.get_vocab_size(with_added_tokens=True)),
    }
