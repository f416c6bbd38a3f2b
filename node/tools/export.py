"""``wanswarm export``: a run's stages assembled into one Hugging Face Llama checkpoint.

The stages' latest state is read from stage checkpoints (node/stage/checkpoint.py) in one or
more state directories, e.g. those of the servers of one machine, or directories copied
from several machines: for each stage the newest checkpoint of the run that verifies, over
every directory given. The result is ``config.json`` + ``model.safetensors`` (hf_llama.py),
plus ``tokenizer.json`` when the run names a tokenizer; ``transformers`` loads it with
``LlamaForCausalLM.from_pretrained`` (and ``PreTrainedTokenizerFast(tokenizer_file=...)``).
Stages at different epochs are exported as they are (the summary lists each one's epoch):
a swarm's stages step independently.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..config.runspec import RunSpec
from ..errors import NodeError
from ..stage.checkpoint import latest
from ..stage.state_tensors import MODEL_PREFIX
from ..training.hf_llama import PretrainedError, write_checkpoint

TOKENIZER_FILE = "tokenizer.json"


class ExportError(NodeError):
    """The run cannot be exported: a stage without a checkpoint, or a non-Llama run."""


def latest_stage_states(
    spec: RunSpec, state_dirs: Sequence[Path]
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, tuple[int, Path]]]:
    """For each stage, the parameters of its newest checkpoint across ``state_dirs`` (our
    names) and (epoch, checkpoint path); ExportError naming the stages that have none."""
    states: dict[int, dict[str, torch.Tensor]] = {}
    sources: dict[int, tuple[int, Path]] = {}
    for stage in range(spec.n_stages):
        best = None
        for state_dir in state_dirs:
            found = latest(Path(state_dir), spec.run_id, stage)
            if found is not None and (best is None or found.epoch > best.epoch):
                best = found
        if best is not None:
            states[stage] = {
                name[len(MODEL_PREFIX) :]: tensor
                for name, tensor in best.tensors.items()
                if name.startswith(MODEL_PREFIX)
            }
            sources[stage] = (best.epoch, best.path)
    missing = [s for s in range(spec.n_stages) if s not in states]
    if missing:
        raise ExportError(
            f"no checkpoint of run {spec.name}/{spec.run_id} for stage "
            f"{', '.join(map(str, missing))} in {', '.join(str(d) for d in state_dirs)}"
        )
    return states, sources


def export_run(spec: RunSpec, state_dirs: Sequence[Path], out: Path) -> dict[str, Any]:
    """Write the Hugging Face checkpoint of the run into ``out``; returns a summary."""
    if spec.model.architecture != "llama":
        raise ExportError("only architecture 'llama' runs export to a Hugging Face checkpoint")
    states, sources = latest_stage_states(spec, state_dirs)
    try:
        write_checkpoint(spec, states, Path(out))
    except PretrainedError as exc:
        raise ExportError(str(exc)) from None
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None
    if spec.data.tokenizer is not None:
        try:
            shutil.copyfile(spec.data.tokenizer, Path(out) / TOKENIZER_FILE)
        except OSError as exc:
            raise ExportError(
                f"cannot copy the tokenizer {spec.data.tokenizer}: {exc.strerror or exc}"
            ) from None
    return {
        "out": str(out),
        "run_id": spec.run_id,
        "epochs": {str(s): epoch for s, (epoch, _) in sorted(sources.items())},
        "checkpoints": {str(s): str(path) for s, (_, path) in sorted(sources.items())},
    }
