"""The run organizer's commands: ``wanswarm tokenizer train``, ``wanswarm fingerprint`` and
``wanswarm export`` (registered by node/cli.py; the work is in the modules they call).

- ``tokenizer train --run-spec FILE --vocab-size N --out tokenizer.json``: a byte-level BPE
  tokenizer trained offline on the run's data (``tokenizers``); prints the run-spec lines
  that name it (path, SHA-256, vocabulary size).
- ``fingerprint --run-spec FILE``: the content fingerprints to pin in the run spec
  (``data.fingerprint``, and ``model.pretrained_fingerprint`` when it names a checkpoint).
- ``export --run-spec FILE --state-dir DIR [--state-dir DIR ...] --out DIR``: the stages'
  newest checkpoints assembled into a Hugging Face checkpoint (export.py).

Nothing here is imported by the daemon; this module imports nothing heavy at load time.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import ConfigError, NodeError

TOKENIZER_EPILOG = """\
example:
  wanswarm tokenizer train --run-spec run.toml --vocab-size 2048 --out tokenizer.json
  then add the printed lines to the run spec (the hash pins the file: part of the run id)
"""
EXPORT_EPILOG = """\
example:
  wanswarm export --run-spec run.toml --state-dir ~/.local/state/wanswarm --out exported/
  python -c "import transformers; transformers.LlamaForCausalLM.from_pretrained('exported')"
"""


def add_commands(sub: Any, fmt: type[argparse.HelpFormatter]) -> None:
    """Add the three commands to the CLI's subparsers."""
    tokenizer = sub.add_parser(
        "tokenizer",
        help="train a BPE tokenizer on the run's local data",
        epilog=TOKENIZER_EPILOG,
        formatter_class=fmt,
        description="Tokenizer tools for run organizers (offline).",
    )
    actions = tokenizer.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    train = actions.add_parser(
        "train",
        help="train a byte-level BPE tokenizer on the run's data files",
        description="Train a byte-level BPE tokenizer on every record of the run's data.",
    )
    train.add_argument("--run-spec", type=Path, required=True, help="the run spec TOML")
    train.add_argument("--vocab-size", type=int, required=True, help="tokens, specials included")
    train.add_argument("--out", type=Path, required=True, help="where to write tokenizer.json")
    train.add_argument(
        "--special",
        action="append",
        metavar="TOKEN",
        help="special token (repeatable; default <|endoftext|>)",
    )
    train.add_argument(
        "--min-frequency", type=int, default=2, help="least count of a merged pair (default 2)"
    )
    train.add_argument("--json", action="store_true", help="print one JSON object")

    fingerprint = sub.add_parser(
        "fingerprint",
        help="print the data and checkpoint fingerprints to pin in a run spec",
        formatter_class=fmt,
        description=(
            "Fingerprint the run's local data (and pretrained checkpoint): file count, size "
            "and a hash of a sample of every file. Peers whose files differ are refused."
        ),
    )
    fingerprint.add_argument("--run-spec", type=Path, required=True, help="the run spec TOML")

    export = sub.add_parser(
        "export",
        help="assemble the stages' checkpoints into a Hugging Face checkpoint",
        epilog=EXPORT_EPILOG,
        formatter_class=fmt,
        description=(
            "Write the newest checkpoint of every stage of a Llama-style run, found in the "
            "state directories given, as one Hugging Face checkpoint (config.json, "
            "model.safetensors, tokenizer.json)."
        ),
    )
    export.add_argument("--run-spec", type=Path, required=True, help="the run spec TOML")
    export.add_argument(
        "--state-dir",
        type=Path,
        action="append",
        required=True,
        help="a node's state directory holding stage checkpoints (repeatable)",
    )
    export.add_argument("--out", type=Path, required=True, help="output directory")


def _spec(path: Path) -> Any:
    from ..config.runspec import RunSpecError, load_run_spec

    try:
        return load_run_spec(path)
    except RunSpecError as exc:
        raise ConfigError(str(exc)) from None


def _data_section(path: Path) -> Any:
    """The run spec's [data] alone: the spec as a whole may not validate yet (its
    vocab_size already names the tokenizer being trained)."""
    import tomllib

    from pydantic import ValidationError

    from ..config.runspec import DataSpec

    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
        return DataSpec.model_validate(raw.get("data", {}))
    except (OSError, tomllib.TOMLDecodeError, ValidationError) as exc:
        raise ConfigError(f"run spec {path}: [data]: {exc}") from None


def _texts(data: Any) -> Iterator[str]:
    from ..training.data import load_corpus
    from ..training.datasets import data_files, records

    if data.format == "bytes":
        corpus = load_corpus(data)
        yield corpus.data.numpy().tobytes().decode("utf-8", errors="replace")
        return
    for path, _ in data_files(data):
        for _, text in records(data, path):
            yield text


def _tokenizer(args: argparse.Namespace) -> int:
    from ..training.tokenizer import train_bpe

    data = _data_section(args.run_spec)
    if not 257 <= args.vocab_size <= 1 << 20:
        raise ConfigError(f"--vocab-size {args.vocab_size}: give 257 to {1 << 20}")
    specials = tuple(args.special or ("<|endoftext|>",))
    result = train_bpe(_texts(data), args.vocab_size, args.out, specials, args.min_frequency)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"wrote {result['tokenizer']} ({result['vocab_size']} tokens); in the run spec:")
        print(f"[model]\nvocab_size = {result['vocab_size']}")
        print(f'[data]\ntokenizer = "{result["tokenizer"]}"')
        print(f'tokenizer_sha256 = "{result["tokenizer_sha256"]}"')
    return 0


def _fingerprint(args: argparse.Namespace) -> int:
    from ..training.datasets import data_fingerprint

    spec = _spec(args.run_spec)
    print(f'[data]\nfingerprint = "{data_fingerprint(spec.data)}"')
    if spec.model.pretrained is not None:
        from ..training.fingerprint import fingerprint_files
        from ..training.hf_llama import checkpoint_files

        try:
            found = fingerprint_files(checkpoint_files(Path(spec.model.pretrained)))
        except OSError as exc:
            raise NodeError(f"cannot read {spec.model.pretrained}: {exc}") from None
        print(f'[model]\npretrained_fingerprint = "{found}"')
    return 0


def _export(args: argparse.Namespace) -> int:
    from .export import export_run

    summary = export_run(_spec(args.run_spec), args.state_dir, args.out)
    print(json.dumps(summary))
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "tokenizer": _tokenizer,
    "fingerprint": _fingerprint,
    "export": _export,
}
