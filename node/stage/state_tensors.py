"""A stage's training state as named tensors: how both stage optimizers export and install it.

``export_state`` and ``import_state`` (optimizer.py, averaging.py) hand the state around as
a flat mapping of names to tensors plus JSON-able metadata; checkpoints (checkpoint.py)
store it and state transfer (state_transfer.py) ships it. The names::

    model.<name>                    the stage module's state_dict
    opt.state.<param_index>.<key>   the optimizer's state tensors

The optimizer naming is torch's own ``Optimizer.state_dict()`` indexing (parameters
numbered across param_groups in order), which the solo and the collaborative optimizer
share, so a state exported by either installs into the other. A state to install may come
from a damaged or foreign checkpoint or from a hostile peer: :func:`check_fits` (names,
shapes, dtypes, finite values), :func:`check_counters` (Adam's step counters),
:func:`checked_param_groups` and :func:`checked_epoch` (at most ``MAX_EPOCH``) refuse what
does not fit the stage with :class:`CheckpointError` before anything changes.

Only tensors and bounded counters are ever taken from such a state. The hyperparameters
(lr, betas, eps, weight decay, ``maximize``, ...) are the run spec's: ``checked_param_groups``
checks the saved groups' structure but returns the live values, and the learning rate is
recomputed from the spec's schedule at the installed epoch (optimizer.py,
``set_schedule_epoch``).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..logs import get_logger
from .checkpoint import CheckpointError, check_finite
from .state_plan import MAX_EPOCH

log = get_logger(__name__)

MODEL_PREFIX = "model."
OPT_PREFIX = "opt.state."


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 (16 hex) of ``(name, tensor)`` pairs in the order given: names and raw bytes,
    so equal digests mean bit-identical tensors (replicas of a stage after a round)."""
    h = hashlib.sha256()
    for name, tensor in named:
        h.update(name.encode())
        # the tensor's bytes through the buffer protocol: no copy on the CPU
        h.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()[:16]


def snapshot(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Private, contiguous CPU copies (safe to write from another thread while training goes on)."""
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state_dict under ``model.<name>`` (live views: copying into them installs)."""
    return {MODEL_PREFIX + name: t for name, t in module.state_dict().items()}


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's state as ``opt.state.<param_index>.<key>`` (live)."""
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    out = {}
    for param, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{OPT_PREFIX}{index[id(param)]}.{key}"] = value
    return out


def optimizer_meta(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's non-tensor state, JSON-able: param_groups without their parameters."""
    groups = []
    for group in opt.param_groups:
        entry = {}
        for key, value in group.items():
            if key != "params":
                entry[key] = list(value) if isinstance(value, tuple) else value
        entry["num_params"] = len(group["params"])
        groups.append(entry)
    return {"param_groups": groups}


def check_fits(expected: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """``CheckpointError`` unless ``tensors`` has exactly the names, shapes and dtypes of
    ``expected`` and holds no NaN or infinity."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [
        f"{name} {tuple(tensors[name].shape)}/{tensors[name].dtype} "
        f"(want {tuple(t.shape)}/{t.dtype})"
        for name, t in expected.items()
        if name in tensors and (tensors[name].shape != t.shape or tensors[name].dtype != t.dtype)
    ]
    problems = []
    if missing:
        problems.append(
            f"missing {', '.join(missing[:3])}"
            + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        )
    if unexpected:
        problems.append(
            f"unexpected {', '.join(unexpected[:3])}"
            + (f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else "")
        )
    if wrong:
        problems.append(
            f"mismatched {'; '.join(wrong[:3])}"
            + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
        )
    if problems:
        raise CheckpointError("checkpoint does not fit this stage: " + "; ".join(problems))
    check_finite(tensors, "state to install")


_STEP = re.compile(rf"^{re.escape(OPT_PREFIX)}[0-9]+\.step$")


def check_counters(epoch: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """``CheckpointError`` unless every Adam step counter (``opt.state.<i>.step``) is a whole
    number in ``[0, epoch]``: both optimizers take one step per epoch (and a replica that
    catches up takes the counters with the epoch), so more steps than epochs is a forged
    state, and a negative count makes Adam's bias correction blow up."""
    for name, t in tensors.items():
        if not _STEP.match(name):
            continue
        values = t.detach().reshape(-1).double()
        if values.numel() and (
            not bool(torch.isfinite(values).all())
            or float(values.min()) < 0
            or float(values.max()) > epoch
            or not bool((values == values.round()).all())
        ):
            raise CheckpointError(
                f"{name}: step counter {values[:4].tolist()} is not a whole number in [0, {epoch}]"
            )


def checked_param_groups(
    opt: torch.optim.Optimizer, meta: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The hyperparameters to install for each of ``opt``'s param_groups: always ``opt``'s own
    (the run spec's), never ``meta``'s. ``meta`` is only checked (same groups, sizes, keys
    and value types; finite numbers; else ``CheckpointError``), and values that differ from
    the spec's are logged (the learning rate aside: it follows the schedule's epoch)."""
    groups = meta.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        raise CheckpointError(
            f"checkpoint's optimizer has other param_groups (want {len(opt.param_groups)})"
        )
    out = []
    for i, (saved, live) in enumerate(zip(groups, opt.param_groups, strict=True)):
        if not isinstance(saved, dict):
            raise CheckpointError(f"param_groups[{i}] is not an object")
        if saved.get("num_params") != len(live["params"]):
            raise CheckpointError(
                f"param_groups[{i}] has {saved.get('num_params')} parameters, "
                f"want {len(live['params'])}"
            )
        keys = set(live) - {"params"}
        if set(saved) - {"num_params"} != keys:
            raise CheckpointError(
                f"param_groups[{i}] has keys {sorted(set(saved) - {'num_params'})}, "
                f"want {sorted(keys)}"
            )
        values = {}
        for key in keys:
            saved_value = _coerce(saved[key], live[key], f"param_groups[{i}].{key}")
            if key != "lr" and saved_value != live[key]:
                log.warning(
                    "param_groups[%d].%s: the installed state says %r, the run spec %r; "
                    "keeping the run spec's", i, key, saved_value, live[key],
                )
            values[key] = live[key]
        out.append(values)
    return out


def _coerce(value: Any, like: Any, where: str) -> Any:
    """``value`` (from JSON) as the type of the live ``like``; ``CheckpointError`` when it
    cannot be."""
    if isinstance(like, bool) or like is None:
        if type(value) is not type(like):
            raise CheckpointError(f"{where}: {value!r} is not like {like!r}")
        return value
    if isinstance(like, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{where}: {value!r} is not an integer")
        return value
    if isinstance(like, float):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise CheckpointError(f"{where}: {value!r} is not a finite number")
        return float(value)
    if isinstance(like, str):
        if not isinstance(value, str):
            raise CheckpointError(f"{where}: {value!r} is not a string")
        return value
    if isinstance(like, (tuple, list)):
        if not isinstance(value, list) or len(value) != len(like):
            raise CheckpointError(f"{where}: {value!r} does not have {len(like)} items")
        items = [
            _coerce(v, w, f"{where}[{j}]") for j, (v, w) in enumerate(zip(value, like, strict=True))
        ]
        return tuple(items) if isinstance(like, tuple) else items
    raise CheckpointError(f"{where}: cannot restore a value of type {type(like).__name__}")


def checked_epoch(epoch: Any) -> int:
    """A state's epoch as an int in ``[0, MAX_EPOCH]``, else ``CheckpointError`` (an absurd epoch
    must never reach the optimizer, nor through it hivemind's progress tracker)."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= MAX_EPOCH:
        raise CheckpointError(f"epoch must be an integer in [0, {MAX_EPOCH}], got {epoch!r}")
    return epoch
