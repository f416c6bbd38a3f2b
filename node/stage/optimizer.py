"""A stage's optimizer: the contract a server steps, the AdamW and schedule, the solo one.

A stage server drives its optimizer through :class:`StageOptimizer`, on its device thread:
``step`` after each backward, ``step_if_due`` while idle, ``export_state`` and
``import_state`` for checkpoints and state transfer. Two implementations keep that
contract: :class:`LocalOptimizer` here, for a stage with no peers to average with (a solo
run, the in-process pipeline and tests), which accumulates to ``target_batch_size`` and
steps; and averaging.py's ``CollaborativeOptimizer``, hivemind's collaborative Optimizer
over the stage's replicas.

Both build the same AdamW (:func:`make_adamw`: a :class:`ClippedAdamW` with its state
initialized, ``optimizer.grad_clip`` applied to the gradients of the whole stage right
before each step; in a DiLoCo or gossip run whose spec asks for it,
:func:`make_inner_optimizer` gives the inner steps Decent-DP's AccumAdam instead,
:class:`AccumAdamW`) and the same learning-rate schedule (:func:`make_schedule`:
``OptimizerSpec.lr_multiplier(local_epoch)``).

Checkpoints. ``export_state`` returns the stage's state as named CPU tensors (the module's
state_dict and the optimizer's state, named as in state_tensors.py) plus JSON-able optimizer
metadata; ``import_state`` installs such a state, all or nothing: names, shapes, dtypes,
finite values, the epoch and param_groups are checked first
(``CheckpointError``), then parameters, optimizer state, the lr schedule and the epoch are
set. The hyperparameters stay the run spec's: a state brings tensors and counters only, and
the learning rate is the spec's schedule at the installed epoch. Both optimizers number parameters
the same way (torch's state_dict order over ``param_groups``), so either reads the other's
checkpoints.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from enum import Enum
from typing import Any, Protocol

import torch
from torch import nn

from ..config.runspec import OptimizerSpec, RunSpec
from ..training.model import param_groups
from .constraint import SubspaceConstraint
from .state_tensors import (
    check_fits,
    checked_epoch,
    checked_param_groups,
    module_tensors,
    optimizer_meta,
    optimizer_tensors,
    snapshot,
)


class Caught(Enum):
    """How a catch-up (:class:`CatchUpFetch`) ended; true only when a state was installed.

    The difference between the false ones decides whether the averaging library's own
    download may be tried after ours (resync.py): it trusts the one donor announcing the
    most, so it is tried only where our transport heard from no donor at all (donors that
    keep refusing give a stand-in through ours instead)."""

    INSTALLED = "installed"  # the state a quorum of the donors holds, ahead of ours
    NOT_BEHIND = "not_behind"  # what most of the donors that answered hold is not ahead
    REFUSED = "refused"  # donors answered, but no state ahead could be trusted or fetched
    UNREACHED = "unreached"  # no donor to ask, or none answered

    def __bool__(self) -> bool:
        return self is Caught.INSTALLED


class CatchUpFetch(Protocol):
    """The stage server's catch-up (state.py's ``resync``): download the state a quorum of
    the stage's replicas holds, from all of them or ``only`` those (by peer id), and install
    it if it is ahead of ours (:class:`Caught`, true if installed). ``stand_in``: where no
    quorum agrees, the state of the donors at their lower median epoch held by most of them
    (``choose_stand_in``), still only if ahead of ours and through the same checks."""

    def __call__(self, only: Collection[str] | None = None, stand_in: bool = False
                 ) -> Caught: ...


class StageOptimizer(Protocol):
    """What a stage server needs from its optimizer. Every method runs on the device thread."""

    def step(self, batch_size: int) -> None:
        """``batch_size`` samples' gradients were added to ``.grad``: take them (and clear them)."""

    def step_if_due(self) -> bool:
        """Called periodically while no micro-batch arrives: take the collaboration's epoch step
        if it is due (a synchronous all-reduce needs every replica, busy or not); True if
        this replica stepped."""

    def load_state_from_peers(self) -> bool:
        """Download the stage's state from its peers; False if there was nobody to ask."""

    def catch_up_with(self, fetch: CatchUpFetch) -> None:
        """When this replica falls behind its stage's epoch, call ``fetch`` (on the device
        thread: our download and install, resync.py) instead of the averaging library's own
        download; a no-op where no library downloads on its own."""

    def is_behind(self, epoch: int, meta: dict[str, Any]) -> bool:
        """Whether a state of the stage (``export_state``'s epoch and meta) that its
        replicas agree on is ahead of this replica's: a catch-up installs only such a
        state. By epoch, except in DiLoCo (by outer round)."""

    @property
    def local_epoch(self) -> int:
        """Optimizer steps taken (the collaboration's epoch this replica is at)."""

    @property
    def samples_accumulated(self) -> int:
        """Samples accumulated by this replica in the current epoch."""

    @property
    def num_peers(self) -> int:
        """Replicas of the stage that reported progress recently (this one included)."""

    def is_synchronized(self) -> bool:
        """Whether this replica is at the collaboration's epoch (or one behind)."""

    def flush(self) -> None:
        """Wait for background averaging or steps and apply their results."""

    def shutdown(self) -> None:
        """Leave the collaboration; the optimizer is unusable afterwards."""

    def background_busy(self) -> bool:
        """Whether a background averaging round or delayed step is still running (so that
        ``export_state`` would wait for it)."""

    def params_version(self) -> int | None:
        """The epoch of the parameters the served module holds now, if they are the stage's
        shared ones (replicas reporting the same version hold the same parameters, up to
        averaging's rounding); None when this replica promises nothing: an update is half
        copied in, a local step set it apart, or its mode trains each replica on its own
        (params_version.py). Replies carry it for trainers' spot checks."""

    def hold_for_snapshot(self, waiting: bool) -> None:
        """A state donor's snapshot waits (True, repeated while it polls) until
        ``background_busy`` is over, or no longer (False): meanwhile no new epoch may start
        background work."""

    def export_state(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        """``(epoch, tensors, meta)``: the stage's state as private CPU copies (names as
        in state_tensors.py)."""

    def import_state(
        self, epoch: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> None:
        """Install a state from ``export_state`` (possibly another replica's); ``CheckpointError``
        before anything changes when it does not fit."""

    def averaging_status(self) -> dict[str, Any]:
        """Flat JSON-able fields for ``wanswarm status``: ``mode`` (allreduce, diloco, solo),
        ``last_round``, ``participants``, ``bytes_sent`` and what else the mode has."""

    def export_checkpoint(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        """What this replica's checkpoints hold: ``export_state`` plus whatever is this
        replica's own and not shared with the stage (DiLoCo's inner state and residuals);
        ``import_state`` takes it too."""


# ---------------------------------------------------------------------------- AdamW, schedule


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that clips the global gradient norm of all its parameters before each step, and
    in a subspace run projects the stage's residual writers back onto the subspace after it
    (constraint.py)."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        max_grad_norm: float,
        constraint: SubspaceConstraint | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, **kwargs)
        self.max_grad_norm = max_grad_norm
        self.constraint = constraint

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.max_grad_norm > 0:
            grads = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)
        loss = super().step(closure)
        if self.constraint is not None:
            self.constraint.apply_(self.param_groups)
        return loss


class AccumAdamW(torch.optim.Optimizer):
    """Decent-DP's AccumAdam (Wang et al., ICLR 2025, Algorithm 4) with AdamW's decoupled
    weight decay, the stage's gradient clipping and the subspace constraint of
    :class:`ClippedAdamW`.

    Step ``t`` (1-based) with gradient ``g`` (clipped), committed moments ``m``, ``v`` and
    ``k = ceil(t / s)`` moment updates so far (this one included)::

        p     <- p (1 - lr wd)
        a     <- a + g / s                                   # the moments' accumulator
        m'    =  beta1 m + (1 - beta1) g                     # this step's moments, not kept
        v'    =  beta2 v + (1 - beta2) g^2
        p     <- p - lr (m' / (1 - beta1^k)) / (sqrt(v' / (1 - beta2^k)) + eps)
        every s-th step: m <- beta1 m + (1 - beta1) a;  v <- beta2 v + (1 - beta2) a^2;  a <- 0

    so every step moves the parameters with its own gradient, while the moments advance once
    per ``s`` steps on the mean of their gradients: with few samples per step (a DiLoCo or
    gossip replica's inner steps on its share of the batch) ``v`` no longer squares single
    noisy gradients. ``s = 1`` is AdamW. State per parameter: ``step``, ``exp_avg``,
    ``exp_avg_sq``, ``accum`` (all tensors: checkpoints and state transfer carry them).
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        accum_steps: int = 4,
        max_grad_norm: float = 0.0,
        constraint: SubspaceConstraint | None = None,
    ) -> None:
        if accum_steps < 1:
            raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "accum_steps": accum_steps}
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.constraint = constraint
        for group in self.param_groups:  # state up front, as make_adamw's (hivemind ships it)
            for p in group["params"]:
                self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "accum": torch.zeros_like(p, memory_format=torch.preserve_format),
                }

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.max_grad_norm > 0:
            grads = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd, s = group["lr"], group["eps"], group["weight_decay"], group["accum_steps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                state["step"] += 1
                t = int(state["step"].item())
                k = -(-t // s)  # moment updates so far, this one included
                if wd:
                    p.mul_(1.0 - lr * wd)
                accum = state["accum"]
                accum.add_(g, alpha=1.0 / s)
                m = state["exp_avg"].mul(beta1).add_(g, alpha=1.0 - beta1)
                v = state["exp_avg_sq"].mul(beta2).addcmul_(g, g, value=1.0 - beta2)
                denom = v.div_(1.0 - beta2**k).sqrt_().add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1.0 - beta1**k))
                if t % s == 0:
                    state["exp_avg"].mul_(beta1).add_(accum, alpha=1.0 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(accum, accum, value=1.0 - beta2)
                    accum.zero_()
        if self.constraint is not None:
            self.constraint.apply_(self.param_groups)
        return loss


def make_inner_optimizer(
    spec: RunSpec, groups: Iterable[Any], constraint: SubspaceConstraint | None = None
) -> torch.optim.Optimizer:
    """The optimizer of a stage's own steps: the run's AdamW (:func:`make_adamw`), or in a
    DiLoCo or gossip run with ``averaging.inner_optimizer = "accum_adamw"`` an
    :class:`AccumAdamW` with the same hyperparameters, state likewise initialized."""
    averaging = spec.averaging  # its validator keeps accum_adamw out of allreduce runs
    if averaging.inner_optimizer == "adamw":
        return make_adamw(spec.optimizer, groups, constraint)
    return AccumAdamW(
        groups,
        accum_steps=averaging.accum_steps,
        max_grad_norm=spec.optimizer.grad_clip,
        constraint=constraint,
        **spec.optimizer.adamw_kwargs(),
    )


def make_adamw(
    spec: OptimizerSpec, groups: Iterable[Any], constraint: SubspaceConstraint | None = None
) -> ClippedAdamW:
    """AdamW for one stage with its state already initialized, without changing parameters.

    hivemind needs optimizer state tensors up front (it averages and ships them) and would
    otherwise create them with a real zero-gradient step, which applies weight decay once.
    We create them with a step at lr = 0 and reset the step counters, which leaves both the
    parameters and Adam's bias correction exactly as if no step had happened.
    """
    opt = ClippedAdamW(
        groups, max_grad_norm=spec.grad_clip, constraint=constraint, **spec.adamw_kwargs()
    )
    saved = []
    for group in opt.param_groups:
        saved.append(group["lr"])
        group["lr"] = 0.0
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    torch.optim.AdamW.step(opt)  # unclipped: the gradients are zero anyway
    for group, lr in zip(opt.param_groups, saved, strict=False):
        group["lr"] = lr
        for p in group["params"]:
            opt.state[p]["step"].zero_()
    return opt


def make_schedule(
    spec: OptimizerSpec, opt: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup then cosine or constant: step k (0-based) runs at lr * lr_multiplier(k)."""
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, spec.lr_multiplier)
    # hivemind fast-forwards the schedule to the epoch of a downloaded state before any
    # optimizer step of this process; torch would warn that the schedule "skipped" its first
    # value, which is exactly what we want there (the state did take those steps elsewhere)
    opt._opt_called = True  # type: ignore[attr-defined]
    return schedule


def set_schedule_epoch(schedule: Any, opt: torch.optim.Optimizer, epoch: int) -> None:
    """Put a LambdaLR at ``epoch`` as if it had stepped once per epoch (hivemind's convention,
    ``_update_scheduler``): each group's lr becomes its base lr (the run spec's) times the
    schedule's multiplier at ``epoch``, exactly what ``epoch`` steps of the schedule give. The
    lr of an installed state is never taken from the state itself."""
    schedule.last_epoch = epoch
    schedule._step_count = epoch + 1
    for group, base, multiplier in zip(
        opt.param_groups, schedule.base_lrs, schedule.lr_lambdas, strict=True
    ):
        group["lr"] = base * multiplier(epoch)
    schedule._last_lr = [group["lr"] for group in opt.param_groups]



# ---------------------------------------------------------------------------- solo


class LocalOptimizer:
    """A stage's optimizer with nobody to average with: accumulate, then step (same contract).

    Accumulation mirrors hivemind's GradientAverager: each micro-batch's gradient is added
    with weight ``batch_size / first_batch_size`` and the sum is divided by the number of
    micro-batches, so one step sees the mean gradient of ``target_batch_size`` samples.
    """

    def __init__(self, module: nn.Module, spec: RunSpec) -> None:
        self._module = module
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._target = spec.batch.target_batch_size
        wd = spec.optimizer.weight_decay
        constraint = SubspaceConstraint.for_stage(module, wd)
        self._opt = make_inner_optimizer(spec, param_groups(module, wd), constraint)
        for p in self._params:
            p.grad = None  # make_adamw leaves zero gradients behind
        self._schedule = make_schedule(spec.optimizer, self._opt)
        self._acc = [torch.zeros_like(p) for p in self._params]
        self._samples = 0
        self._times = 0
        self._anchor: int | None = None
        self._epoch = 0

    @torch.no_grad()
    def accumulate(self, batch_size: int) -> None:
        """Add the ``.grad`` of ``batch_size`` samples to the accumulator (and clear it)."""
        if self._anchor is None:
            self._anchor = batch_size
        alpha = batch_size / self._anchor
        for p, acc in zip(self._params, self._acc, strict=False):
            if p.grad is not None:
                acc.add_(p.grad, alpha=alpha)
                p.grad = None
        self._samples += batch_size
        self._times += 1

    @torch.no_grad()
    def step(self, batch_size: int) -> None:
        self.accumulate(batch_size)
        if self._samples < self._target:
            return
        for p, acc in zip(self._params, self._acc, strict=False):
            p.grad = acc.div_(self._times)
        self.apply()

    @torch.no_grad()
    def apply(self) -> None:
        """Take the optimizer step with the gradients in ``.grad``, then start a new epoch
        (gradients cleared, accumulator zeroed)."""
        self._opt.step()
        self._schedule.step()
        self._epoch += 1
        for p, acc in zip(self._params, self._acc, strict=False):
            p.grad = None
            acc.zero_()
        self._samples = self._times = 0
        self._anchor = None

    def step_if_due(self) -> bool:
        return False  # no peers: its own micro-batches complete each epoch

    def load_state_from_peers(self) -> bool:
        return False

    def catch_up_with(self, fetch: CatchUpFetch) -> None:
        pass  # alone: never behind

    def is_behind(self, epoch: int, meta: dict[str, Any]) -> bool:
        return epoch > self._epoch

    @property
    def local_epoch(self) -> int:
        return self._epoch

    @property
    def samples_accumulated(self) -> int:
        return self._samples

    @property
    def num_peers(self) -> int:
        return 1

    def is_synchronized(self) -> bool:
        return True

    def flush(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def background_busy(self) -> bool:
        return False

    def params_version(self) -> int | None:
        return self._epoch  # every step lands at once; no partner to drift from

    def hold_for_snapshot(self, waiting: bool) -> None:
        return None

    def export_state(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        live = module_tensors(self._module) | optimizer_tensors(self._opt)
        return self._epoch, snapshot(live), optimizer_meta(self._opt)

    def export_checkpoint(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        return self.export_state()

    def averaging_status(self) -> dict[str, Any]:
        return {"mode": "solo"}

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` (a state adopted from peers): the schedule follows; the
        parameters, the AdamW moments and the accumulated gradients stay."""
        self._epoch = checked_epoch(epoch)
        set_schedule_epoch(self._schedule, self._opt, self._epoch)

    @torch.no_grad()
    def import_state(
        self, epoch: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> None:
        epoch = checked_epoch(epoch)
        live = module_tensors(self._module) | optimizer_tensors(self._opt)
        check_fits(live, tensors)
        groups = checked_param_groups(self._opt, meta)
        for name, tensor in live.items():
            tensor.copy_(tensors[name])
        for group, values in zip(self._opt.param_groups, groups, strict=True):
            group.update(values)
        set_schedule_epoch(self._schedule, self._opt, epoch)
        self._epoch = epoch
        for p, acc in zip(self._params, self._acc, strict=True):
            p.grad = None
            acc.zero_()  # gradients accumulated toward the old epoch do not carry over
        self._samples = self._times = 0
        self._anchor = None
