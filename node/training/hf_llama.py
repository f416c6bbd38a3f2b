"""Hugging Face Llama checkpoints: a run's model spec from one, a stage's tensors out of one,
and the run's stages written back as one.

The format is what ``LlamaForCausalLM.save_pretrained`` writes: ``config.json`` and either
``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Reading uses
only ``safetensors`` (a dependency of the daemon) and JSON: ``transformers`` is not needed
to start from a checkpoint or to export one, only to use the result. A stage opens the
files lazily and reads its own tensors (``safe_open(...).get_tensor``), never the rest.

Names: a stage's parameters are named as transformers' (llama.py), so the mapping is
``tok_emb`` <-> ``model.embed_tokens``, ``blocks.<i>.X`` <-> ``model.layers.<first + i>.X``,
``ln_f`` <-> ``model.norm``, ``head`` <-> ``lm_head``. Our head's output is multiplied by
``logit_multiplier``; its weight is the checkpoint's divided by it on the way in and
multiplied by it on the way out, so the logits are the same.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..config.runspec import ModelSpec, RunSpec
from ..errors import NodeError
from ..stage.layout import StageLayout
from .fingerprint import describe_difference, fingerprint_files

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_JSON_BYTES = 16 << 20


class PretrainedError(NodeError):
    """A pretrained checkpoint that is missing, malformed, or does not match the run spec."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise PretrainedError(f"{path} is larger than {MAX_JSON_BYTES} bytes")
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PretrainedError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PretrainedError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise PretrainedError(f"{path} is not a JSON object")
    return value


def _rope_theta(config: dict[str, Any], path: Path) -> float:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise PretrainedError(f"{path}: rope_parameters is not an object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise PretrainedError(f"{path}: rope type {kind!r} is not supported (only 'default')")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if not isinstance(theta, int | float) or not theta > 1:
        raise PretrainedError(f"{path}: rope_theta {theta!r} is not a number above 1")
    return float(theta)


def model_fields(checkpoint: str | Path) -> dict[str, Any]:
    """The ``[model]`` fields of a run spec that match a Llama checkpoint's config.json
    (architecture, widths, heads, layers, vocabulary, RoPE base, norm epsilon, tying);
    the caller adds seq_len, pretrained and pretrained_fingerprint."""
    path = Path(checkpoint) / CONFIG_FILE
    config = _read_json(path)
    if config.get("model_type") != "llama":
        raise PretrainedError(f"{path}: model_type {config.get('model_type')!r}, not 'llama'")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise PretrainedError(f"{path}: {key} = true is not supported (no biases)")
    if config.get("hidden_act", "silu") != "silu":
        raise PretrainedError(f"{path}: hidden_act {config.get('hidden_act')!r}, not 'silu'")
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        fields = {
            "architecture": "llama",
            "vocab_size": int(config["vocab_size"]),
            "d_model": hidden,
            "n_heads": heads,
            "n_kv_heads": int(config.get("num_key_value_heads") or heads),
            "n_layers": int(config["num_hidden_layers"]),
            "intermediate_size": int(config["intermediate_size"]),
            "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "rope_base": _rope_theta(config, path),
            "positions": "rotary",
            "logit_multiplier": 1.0,
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        }
        head_dim = config.get("head_dim")
    except (KeyError, TypeError, ValueError) as exc:
        raise PretrainedError(f"{path}: missing or malformed field ({exc})") from None
    if head_dim is not None and head_dim * heads != hidden:
        raise PretrainedError(f"{path}: head_dim {head_dim} x heads {heads} != hidden {hidden}")
    return fields


def check_matches(cfg: ModelSpec, checkpoint: Path) -> None:
    """PretrainedError naming each [model] field that disagrees with the checkpoint."""
    theirs = model_fields(checkpoint)
    ours = cfg.model_dump()
    ours["n_kv_heads"] = cfg.kv_heads
    ours["intermediate_size"] = cfg.mlp_hidden
    skip = {"logit_multiplier", "tie_embeddings"}  # we may rescale the head, or untie it
    diffs = [
        f"{k}: run spec {ours[k]!r}, checkpoint {v!r}"
        for k, v in theirs.items()
        if k not in skip
        and not (ours[k] == v or (isinstance(v, float) and math.isclose(ours[k], v, rel_tol=1e-9)))
    ]
    if diffs:
        raise PretrainedError(f"model.pretrained {checkpoint} does not match: " + "; ".join(diffs))


def checkpoint_files(checkpoint: Path) -> list[tuple[Path, str]]:
    """config.json and the tensor files, as (path, name), sorted by name."""
    names = {CONFIG_FILE}
    index = checkpoint / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise PretrainedError(f"{index}: no weight_map object")
        names |= {INDEX_FILE, *(str(v) for v in weight_map.values())}
    else:
        names.add(SINGLE_FILE)
    files = []
    for name in sorted(names):
        if "/" in name or name.startswith("."):
            raise PretrainedError(f"{checkpoint}: tensor file name {name!r} is not a plain name")
        path = checkpoint / name
        if not path.is_file():
            raise PretrainedError(f"{checkpoint}: {name} is missing")
        files.append((path, name))
    return files


def _tensor_files(checkpoint: Path) -> dict[str, str]:
    """Tensor name -> file name."""
    index = checkpoint / INDEX_FILE
    if index.is_file():
        return {str(k): str(v) for k, v in _read_json(index)["weight_map"].items()}
    from safetensors import safe_open

    with safe_open(str(checkpoint / SINGLE_FILE), framework="pt") as f:
        return dict.fromkeys(f.keys(), SINGLE_FILE)


def hf_names(spec: RunSpec, stage: int) -> dict[str, str]:
    """Our parameter name -> the checkpoint's, for every tensor of ``stage``."""
    layout = StageLayout(spec.stages.blocks_per_stage)
    per_block = (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    )
    names: dict[str, str] = {}
    if layout.has_embedding(stage):
        names["tok_emb.weight"] = "model.embed_tokens.weight"
    for local, block in enumerate(layout.blocks(stage)):
        for suffix in per_block:
            names[f"blocks.{local}.{suffix}"] = f"model.layers.{block}.{suffix}"
    if layout.has_head(stage):
        names["ln_f.weight"] = "model.norm.weight"
        names["head.weight"] = "lm_head.weight"
    return names


def verify_checkpoint(spec: RunSpec) -> Path:
    """The pretrained checkpoint's directory, checked against the spec (fields and
    fingerprint); PretrainedError naming the difference otherwise."""
    cfg = spec.model
    if cfg.pretrained is None or cfg.pretrained_fingerprint is None:
        raise PretrainedError("the run spec names no pretrained checkpoint")
    checkpoint = Path(cfg.pretrained)
    if not checkpoint.is_dir():
        raise PretrainedError(f"model.pretrained {checkpoint} is not a directory")
    check_matches(cfg, checkpoint)
    try:
        actual = fingerprint_files(checkpoint_files(checkpoint))
    except OSError as exc:
        raise PretrainedError(f"cannot read {checkpoint}: {exc}") from None
    difference = describe_difference(cfg.pretrained_fingerprint, actual, f"checkpoint {checkpoint}")
    if difference:
        raise PretrainedError(difference)
    return checkpoint


def load_stage_tensors(spec: RunSpec, stage: int) -> dict[str, torch.Tensor]:
    """Stage ``stage``'s parameters from the run's pretrained checkpoint, float32, under our
    names; only this stage's tensors are read."""
    from safetensors import SafetensorError, safe_open

    checkpoint = verify_checkpoint(spec)
    where = _tensor_files(checkpoint)
    names = hf_names(spec, stage)
    if "lm_head.weight" not in where and spec.model.tie_embeddings:
        if "head.weight" in names:
            names["head.weight"] = "model.embed_tokens.weight"  # tied: the head is the embedding
    missing = sorted(theirs for theirs in names.values() if theirs not in where)
    if missing:
        raise PretrainedError(f"{checkpoint} lacks tensors: {', '.join(missing[:5])}")
    out: dict[str, torch.Tensor] = {}
    opened: dict[str, Any] = {}
    try:
        for ours, theirs in names.items():
            file = where[theirs]
            if file not in opened:
                opened[file] = safe_open(str(checkpoint / file), framework="pt")
            out[ours] = opened[file].get_tensor(theirs).to(torch.float32)
    except (SafetensorError, OSError) as exc:
        raise PretrainedError(f"cannot read tensors of {checkpoint}: {exc}") from None
    if "head.weight" in out:
        out["head.weight"] = out["head.weight"] / spec.model.logit_multiplier
    return out


def hf_config(spec: RunSpec) -> dict[str, Any]:
    """config.json of the run's model, as LlamaForCausalLM reads it."""
    cfg = spec.model
    if cfg.architecture != "llama":
        raise PretrainedError("only architecture 'llama' exports to a Hugging Face checkpoint")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "hidden_act": "silu",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "num_hidden_layers": cfg.n_layers,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "tie_word_embeddings": False,  # across stages the two ends are trained separately
        "dtype": "float32",
        "initializer_range": 0.02,
    }


def to_hf_tensors(
    spec: RunSpec, stages: dict[int, dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors from every stage's parameters (our names, per stage)."""
    out: dict[str, torch.Tensor] = {}
    for stage in range(spec.n_stages):
        if stage not in stages:
            raise PretrainedError(f"no state for stage {stage}")
        tensors = stages[stage]
        for ours, theirs in hf_names(spec, stage).items():
            if ours == "head.weight" and ours not in tensors and "tok_emb.weight" in tensors:
                ours = "tok_emb.weight"  # a tied single stage stores one matrix
            if ours not in tensors:
                raise PretrainedError(f"stage {stage} state lacks {ours}")
            value = tensors[ours].detach().to(torch.float32).contiguous().clone()
            if theirs == "lm_head.weight":
                value = value * spec.model.logit_multiplier
            out[theirs] = value
    return out


def write_checkpoint(spec: RunSpec, stages: dict[int, dict[str, torch.Tensor]], out: Path) -> None:
    """Write config.json and model.safetensors into ``out`` (created if needed)."""
    from safetensors.torch import save_file

    tensors = to_hf_tensors(spec, stages)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(spec), indent=2) + "\n", encoding="utf-8")
