"""The training protocol between trainers and stage servers: request kinds, headers, checks.

One micro-batch ``m`` of trainer ``t`` walks the stages (SWARM; the trainer drives every
hop and keeps every stage's input, so any hop can be retried on another server)::

    forward       stage 0 .. S-2   tensors [x]                 -> [y]        (no grad)
    forward_loss  stage S-1        tensors [x, targets]        -> [dL/dx]    loss in header
    backward      stage S-2 .. 0   tensors [x, dL/dy] (carried) or [dL/dy] (input cached
                                   by the server that ran the forward) -> [dL/dx] (none on stage 0)
    eval_loss     stage S-1        tensors [x, targets]        -> []         loss, no grad
    stage_info    any stage        no tensors                  -> []         load figures

In a subspace run (run spec ``[subspace]``, docs/compression.md) ``x`` and ``dL/dx`` after
stage 0 are the boundary's ``k_b`` coefficients per token instead of ``d_model`` values, and
every stage after the first also takes the micro-batch's token ids right after ``x``
(``[x, ids]``, ``[x, ids, targets]``, carried ``[x, ids, dL/dy]``; ``StageContract.ids_dtype``:
uint8 for byte-level runs), from which it rebuilds ``E_fixed[tokens] + U c``.

Every request header carries a ``HopId`` (run id, trainer peer id, micro-batch id, stage,
attempt): the server remembers which ``(trainer, micro_batch, stage)`` it has applied, so a
retried hop never accumulates gradients twice. A request for another run or stage is
refused (``wrong_run`` / ``wrong_stage``); the trainer's id must be the authenticated peer
id of the connection, so nobody can spend another trainer's ids. ``budget_s`` is how long
the trainer will wait: a server that cannot start the job within it drops it (``expired``)
instead of applying work whose answer nobody will read (and that a retry elsewhere would
then apply a second time).

Errors travel as ``RemoteError(code)`` (transport); the codes are ``ErrorCode``. Headers
are versioned pydantic models (``v``); everything from the other side is untrusted and
validated here, tensors included (dtype, shape, range), before any compute is spent.

Values, not only finiteness (docs/hostile.md): activations and gradients between stages,
losses and a micro-batch's parameter-gradient norm are bounded by the run spec's
``[limits]``. A server refuses a tensor beyond them with ``out_of_range`` before computing
on it (``StageContract``), and its own results beyond them before accumulating anything
(jobs.py); the trainer refuses a reply beyond them (``BadValues``) instead of relaying it.
A stage's output that the trainer relays to the next stage undecoded is checked here
against its header (``check_relayed``); the trainer checks its values (``max_abs``)
without keeping a decoded copy, and the next stage's endpoint and contract check them
again before that stage computes on them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Final, Literal, TypeVar

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..transport.errors import RemoteError
from ..transport.tensors import ReceivedTensor
from .config.runspec import LimitsSpec, RunSpec
from .errors import NodeError
from .membership.records import ServerState
from .training.subspace import token_id_dtype

PROTOCOL_VERSION: Final[int] = 1


class Kind(StrEnum):
    """Endpoint request kinds of the training protocol."""

    FORWARD = "forward"
    FORWARD_LOSS = "forward_loss"
    BACKWARD = "backward"
    EVAL_LOSS = "eval_loss"
    STAGE_INFO = "stage_info"


class ErrorCode(StrEnum):
    """Error codes a stage server answers with (``RemoteError.code``)."""

    BUSY = "busy"  # the queue is full: go elsewhere
    WRONG_RUN = "wrong_run"  # the server trains another run (stale record)
    WRONG_STAGE = "wrong_stage"  # the server holds another stage (it moved)
    CACHE_MISS = "cache_miss"  # the referenced input is gone: resend it
    BAD_REQUEST = "bad_request"  # malformed header or tensors
    EXPIRED = "expired"  # could not start within the trainer's budget
    NOT_READY = "not_ready"  # joining: still loading the stage's state
    DRAINING = "draining"  # leaving: no new work
    INTERNAL = "internal"  # the server failed while computing
    # a value beyond the run's [limits] (an input, or a result: loss, dL/dx, gradient
    # norm): refused before anything was computed on it or accumulated
    OUT_OF_RANGE = "out_of_range"


# Codes after which the same hop may succeed on another server of the stage.
RETRY_ELSEWHERE: Final[frozenset[str]] = frozenset(
    {
        ErrorCode.BUSY,
        ErrorCode.WRONG_RUN,
        ErrorCode.WRONG_STAGE,
        ErrorCode.EXPIRED,
        ErrorCode.NOT_READY,
        ErrorCode.DRAINING,
        ErrorCode.INTERNAL,
    }
)


class BadReply(NodeError):
    """A server's reply does not match the protocol (header or tensors)."""


class BadValues(BadReply):
    """A server's reply holds values no honest server sends: NaN/Inf, or beyond the run's
    ``[limits]`` (an activation, a gradient, a loss)."""


def refuse(code: StrEnum, message: str) -> RemoteError:
    """The exception a handler raises to answer with ``code`` (an ``ErrorCode``, or a
    request kind's own codes)."""
    return RemoteError(str(code), message[:300])


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"


class HopId(_Wire):
    """Idempotent id of one hop: the same ``key`` is applied at most once per server."""

    run_id: str = Field(pattern=_ID_PATTERN, description="RunSpec.run_id of the trainer.")
    trainer: str = Field(pattern=_ID_PATTERN, description="Peer id of the trainer.")
    micro_batch: int = Field(ge=0, lt=2**63, description="Trainer-unique micro-batch id.")
    stage: int = Field(ge=0, le=4095, description="Stage this hop is for.")
    attempt: int = Field(
        default=0, ge=0, le=1000, description="Retry number of this hop (0 first)."
    )

    @property
    def key(self) -> tuple[str, int, int]:
        """What deduplication is keyed by (the attempt number is not part of it)."""
        return (self.trainer, self.micro_batch, self.stage)


class _Request(_Wire):
    v: Literal[1] = Field(default=1, description="Protocol version (PROTOCOL_VERSION).")
    hop: HopId
    budget_s: float = Field(
        gt=0.0, le=3600.0, description="Seconds the trainer waits for this answer."
    )


class ForwardRequest(_Request):
    """``forward``: tensors ``[x]``; answer ``[y]``."""

    keep_input: bool = Field(
        default=True,
        description="Cache x so that a backward may reference it (False for validation).",
    )


class ForwardLossRequest(_Request):
    """``forward_loss`` (last stage): tensors ``[x, targets]``; answer ``[dL/dx]``."""

    check: bool = Field(
        default=False,
        description="A spot check of another replica's forward_loss (spot_checks.py): the "
        "loss and dL/dx at this replica's parameters; nothing is accumulated or counted as "
        "applied.",
    )


class BackwardRequest(_Request):
    """``backward``: tensors ``[x, dL/dy]`` if ``input_carried`` else ``[dL/dy]``."""

    input_carried: bool = Field(description="Whether x travels with the request.")
    check: bool = Field(
        default=False,
        description="A spot check of another replica's backward (spot_checks.py): dL/dx "
        "from the carried x at this replica's parameters; nothing is accumulated, cached or "
        "counted as applied. Needs input_carried.",
    )

    @model_validator(mode="after")
    def _check_carries_its_input(self) -> BackwardRequest:
        if self.check and not self.input_carried:
            raise ValueError("a backward spot check carries its input (input_carried)")
        return self


class EvalLossRequest(_Request):
    """``eval_loss`` (last stage): tensors ``[x, targets]``; no gradients anywhere."""


class InfoRequest(_Wire):
    """``stage_info``: no tensors."""

    v: Literal[1] = Field(default=1, description="Protocol version (PROTOCOL_VERSION).")
    run_id: str = Field(pattern=_ID_PATTERN, description="RunSpec.run_id of the asker.")


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("loss must be finite")
    return value


# a loss in a reply header: mean cross-entropy, nats per token, finite
FiniteLoss = Annotated[float, AfterValidator(_finite)]


class _Reply(_Wire):
    v: Literal[1] = Field(default=1, description="Protocol version (PROTOCOL_VERSION).")
    queue_len: int = Field(ge=0, le=1_000_000, description="Jobs queued after this one finished.")
    epoch: int = Field(ge=0, lt=2**63, description="Optimizer step (local epoch) of the stage.")
    params: int | None = Field(
        default=None,
        ge=0,
        lt=2**63,
        description=(
            "Epoch of the parameters that computed this answer when they are the stage's "
            "shared ones, else null (an update half applied, a local step, DiLoCo or "
            "gossip): trainers compare two replicas' answers only at equal non-null values."
        ),
    )
    compute_s: float = Field(ge=0.0, le=86400.0, description="Seconds this job ran on the device.")


class ForwardReply(_Reply):
    """Answer to ``forward``: tensors ``[y]``."""

    cached: bool = Field(description="Whether the server kept x for a backward reference.")


class LossReply(_Reply):
    """Answer to ``forward_loss``: tensors ``[dL/dx]`` (none on a single-stage run)."""

    loss: FiniteLoss = Field(description="Mean cross-entropy, nats per token.")
    duplicate: bool = Field(description="Already applied: gradients were not accumulated again.")


class BackwardReply(_Reply):
    """Answer to ``backward``: tensors ``[dL/dx]``, none on stage 0."""

    duplicate: bool = Field(description="Already applied: gradients were not accumulated again.")


class EvalReply(_Reply):
    """Answer to ``eval_loss``: no tensors."""

    loss: FiniteLoss = Field(description="Mean cross-entropy, nats per token.")


class InfoReply(_Wire):
    """Answer to ``stage_info``: what the server would announce in its record, live."""

    v: Literal[1] = Field(default=1, description="Protocol version (PROTOCOL_VERSION).")
    run_id: str = Field(pattern=_ID_PATTERN)
    stage: int = Field(ge=0, le=4095)
    state: ServerState
    queue_len: int = Field(ge=0, le=1_000_000)
    queue_capacity: int = Field(ge=0, le=1_000_000)
    throughput: float = Field(ge=0.0, description="Samples/s of forward+backward.")
    epoch: int = Field(ge=0, lt=2**63)
    samples_accumulated: int = Field(ge=0, description="Samples in the current epoch, this peer.")


_M = TypeVar("_M", bound=BaseModel)


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    loc = ".".join(str(part) for part in first["loc"]) or "(header)"
    return f"{loc}: {first['msg']}"


def parse_request(model: type[_M], header: Mapping[str, Any]) -> _M:
    """Validate a request header (peer input); ``bad_request`` on anything malformed."""
    if not isinstance(header, Mapping):
        raise refuse(ErrorCode.BAD_REQUEST, "header is not an object")
    try:
        return model.model_validate(dict(header))
    except ValidationError as exc:
        raise refuse(ErrorCode.BAD_REQUEST, f"{model.__name__}: {_describe(exc)}") from None


def parse_reply(model: type[_M], header: Mapping[str, Any]) -> _M:
    """Validate a reply header (server input); ``BadReply`` on anything malformed."""
    if not isinstance(header, Mapping):
        raise BadReply("reply header is not an object")
    try:
        return model.model_validate(dict(header))
    except ValidationError as exc:
        raise BadReply(f"{model.__name__}: {_describe(exc)}") from None


def to_header(message: BaseModel) -> dict[str, Any]:
    """A header model as the plain dict the endpoint sends."""
    return message.model_dump(mode="json")


# ---- value bounds (pure) ------------------------------------------------------------------


def max_abs(t: torch.Tensor) -> float:
    """Largest |value| of a tensor in one pass: NaN if it holds a NaN, inf if an Inf, 0.0
    when empty or not floating point (token ids are range-checked instead)."""
    if not t.is_floating_point() or t.numel() == 0:
        return 0.0
    return float(t.detach().abs().amax())  # amax propagates NaN


def within(value: float, bound: float) -> bool:
    """Whether ``value`` is finite and ``|value| <= bound`` (NaN never is)."""
    return math.isfinite(value) and abs(value) <= bound


def describe_excess(value: float, bound: float, what: str) -> str:
    """Why ``value`` (a max |value|, a loss or a norm) is refused under ``bound``."""
    if not math.isfinite(value):
        return f"{what} is not finite ({value})"
    return f"{what} reaches {value:.4g}, beyond the run's limit {bound:.4g}"


def check_result(value: float, bound: float, what: str) -> None:
    """A value a server computed (loss, dL/dx's max |value|, a gradient norm) before it is
    used: ``out_of_range`` unless finite and within ``bound``."""
    if not within(value, bound):
        raise refuse(ErrorCode.OUT_OF_RANGE, describe_excess(value, bound, what))


@dataclass(frozen=True)
class StageContract:
    """What a stage's tensors must look like, from the run spec (pure)."""

    run_id: str
    stage: int
    n_stages: int
    vocab_size: int
    d_model: int
    seq_len: int
    max_batch: int
    limits: LimitsSpec
    # activations per token on the wire into and out of this stage: d_model, or the
    # boundary's subspace width k_b (d_model where there is no such boundary)
    in_width: int = 0
    out_width: int = 0
    # the token ids' wire dtype when the stage's requests carry them (a subspace run: every
    # stage after the first rebuilds E_fixed[tokens] + U c), else None
    ids_dtype: torch.dtype | None = None

    @classmethod
    def from_spec(cls, spec: RunSpec, stage: int) -> StageContract:
        if not 0 <= stage < spec.n_stages:
            raise ValueError(f"stage {stage} out of range: the run has {spec.n_stages} stages")
        d_model = spec.model.d_model
        widths = boundary_widths(spec)
        carries_ids = spec.subspace.enabled and stage > 0
        return cls(
            run_id=spec.run_id,
            stage=stage,
            n_stages=spec.n_stages,
            vocab_size=spec.model.vocab_size,
            d_model=d_model,
            seq_len=spec.model.seq_len,
            max_batch=spec.batch.micro_batch_size,
            limits=spec.limits,
            in_width=widths[stage - 1] if stage > 0 else d_model,
            out_width=widths[stage] if stage < spec.n_stages - 1 else d_model,
            ids_dtype=token_id_dtype(spec.model.vocab_size) if carries_ids else None,
        )

    @property
    def n_inputs(self) -> int:
        """Tensors that make up the stage's input on the wire: ``[x]`` or ``[x, ids]``."""
        return 1 if self.ids_dtype is None else 2

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.n_stages - 1

    # ---- ids ------------------------------------------------------------------------

    def check_hop(self, hop: HopId, sender: str) -> None:
        """Refuse a hop for another run or stage, or one claiming another trainer's id."""
        if hop.run_id != self.run_id:
            raise refuse(
                ErrorCode.WRONG_RUN, f"this server trains run {self.run_id}, not {hop.run_id}"
            )
        if hop.stage != self.stage:
            raise refuse(
                ErrorCode.WRONG_STAGE, f"this server holds stage {self.stage}, not {hop.stage}"
            )
        if hop.trainer != sender:
            raise refuse(ErrorCode.BAD_REQUEST, "hop.trainer is not the sender's peer id")

    # ---- tensors --------------------------------------------------------------------

    def check_count(self, tensors: Sequence[torch.Tensor], n: int, what: str) -> None:
        if len(tensors) != n:
            raise refuse(ErrorCode.BAD_REQUEST, f"{what} takes {n} tensors, got {len(tensors)}")

    def check_input(self, x: torch.Tensor, peak: float | None = None) -> None:
        """Token ids (B, T) int64 in [0, V) on stage 0; float32 (B, T, C) elsewhere.

        ``peak``: the input's largest |value| when its payload told it on the host
        (``Request.peaks``), which spares asking the device; None: computed from ``x``."""
        if not isinstance(x, torch.Tensor):
            raise refuse(ErrorCode.BAD_REQUEST, "input is not a tensor")
        if self.first:
            if x.dtype != torch.int64 or x.dim() != 2:
                raise refuse(
                    ErrorCode.BAD_REQUEST,
                    f"stage 0 takes int64 token ids (B, T), got {x.dtype} {tuple(x.shape)}",
                )
            self._check_bt(x)
            if int(x.min()) < 0 or int(x.max()) >= self.vocab_size:
                raise refuse(ErrorCode.BAD_REQUEST, f"token ids must lie in [0, {self.vocab_size})")
        else:
            if x.dtype != torch.float32 or x.dim() != 3 or x.shape[2] != self.in_width:
                raise refuse(
                    ErrorCode.BAD_REQUEST,
                    f"stage {self.stage} takes float32 (B, T, {self.in_width}), "
                    f"got {x.dtype} {tuple(x.shape)}",
                )
            self._check_bt(x)
            self._check_values(x, self.limits.max_activation, "input", peak)

    def check_ids(self, ids: torch.Tensor, batch: int, length: int) -> None:
        """The token ids a subspace run's stage rebuilds its input with: the run's id dtype,
        (B, T) matching the input, values in [0, V)."""
        if not isinstance(ids, torch.Tensor) or ids.dtype != self.ids_dtype:
            raise refuse(ErrorCode.BAD_REQUEST, f"token ids must be a {self.ids_dtype} tensor")
        if tuple(ids.shape) != (batch, length):
            raise refuse(
                ErrorCode.BAD_REQUEST,
                f"token ids must be ({batch}, {length}), got {tuple(ids.shape)}",
            )
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise refuse(ErrorCode.BAD_REQUEST, f"token ids must lie in [0, {self.vocab_size})")

    def check_targets(self, targets: torch.Tensor, batch: int, length: int) -> None:
        """Next-byte targets: int64 (B, T) matching the input, values in [0, V)."""
        if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
            raise refuse(ErrorCode.BAD_REQUEST, "targets must be an int64 tensor")
        if tuple(targets.shape) != (batch, length):
            raise refuse(
                ErrorCode.BAD_REQUEST,
                f"targets must be ({batch}, {length}), got {tuple(targets.shape)}",
            )
        if int(targets.min()) < 0 or int(targets.max()) >= self.vocab_size:
            raise refuse(ErrorCode.BAD_REQUEST, f"targets must lie in [0, {self.vocab_size})")

    def output_shape(self, batch: int, length: int) -> tuple[int, int, int]:
        """Shape of this (non-last) stage's output and of the gradient a backward carries."""
        return (batch, length, self.out_width)

    def check_output_grad(
        self, grad: torch.Tensor, batch: int | None, length: int | None,
        peak: float | None = None,
    ) -> None:
        """dL/dy: float32 (B, T, C) (C the output's wire width); B and T must match the
        input when it is known. ``peak`` as for :meth:`check_input`."""
        if not isinstance(grad, torch.Tensor) or grad.dtype != torch.float32 or grad.dim() != 3:
            raise refuse(ErrorCode.BAD_REQUEST, "output gradient must be float32 (B, T, C)")
        if grad.shape[2] != self.out_width:
            raise refuse(ErrorCode.BAD_REQUEST, f"output gradient must have C = {self.out_width}")
        self._check_bt(grad)
        if batch is not None and length is not None and tuple(grad.shape[:2]) != (batch, length):
            raise refuse(
                ErrorCode.BAD_REQUEST,
                f"output gradient {tuple(grad.shape)} does not match input ({batch}, {length})",
            )
        self._check_values(grad, self.limits.max_gradient, "output gradient", peak)

    def _check_bt(self, t: torch.Tensor) -> None:
        batch, length = int(t.shape[0]), int(t.shape[1])
        if not 1 <= batch <= self.max_batch or not 1 <= length <= self.seq_len:
            raise refuse(
                ErrorCode.BAD_REQUEST,
                f"need 1 <= B <= {self.max_batch} and 1 <= T <= {self.seq_len}, "
                f"got {tuple(t.shape)}",
            )

    @staticmethod
    def _check_values(t: torch.Tensor, bound: float, what: str, peak: float | None) -> None:
        """NaN/Inf: ``bad_request`` (the endpoint refuses those on receipt already); a
        |value| beyond ``bound``: ``out_of_range``. ``peak``: ``t``'s largest |value| if
        known (at least it, as a payload's scales tell), else computed here."""
        peak = max_abs(t) if peak is None else peak
        if not math.isfinite(peak):
            raise refuse(ErrorCode.BAD_REQUEST, f"{what} has NaN or Inf")
        if peak > bound:
            raise refuse(ErrorCode.OUT_OF_RANGE, describe_excess(peak, bound, what))


def boundary_widths(spec: RunSpec) -> tuple[int, ...]:
    """Activations per token on the wire at each boundary ``b`` (between stage b and b + 1):
    ``d_model``, or the subspace's ``k_b`` in a subspace run."""
    n = spec.n_stages - 1
    k = spec.subspace.k
    if k is None:
        return (spec.model.d_model,) * n
    return (k,) * n if isinstance(k, int) else tuple(k)


def check_relayed(
    tensors: Sequence[object], shape: tuple[int, ...], dtype: torch.dtype, what: str
) -> ReceivedTensor:
    """The single tensor of a reply, to relay undecoded: a ReceivedTensor whose header
    gives the expected shape and dtype; else BadReply.

    Checked on its receipt already: its codec, payload length and codec header bytes.
    Not checked here: its values (scales, NaN/Inf), which whoever decodes it checks (the
    next stage's endpoint refuses a bad payload before anything is computed on it).
    """
    if len(tensors) != 1:
        raise BadReply(f"{what}: expected 1 tensor, got {len(tensors)}")
    t = tensors[0]
    if not isinstance(t, ReceivedTensor) or t.dtype != dtype or t.shape != shape:
        got = f"{t.dtype} {t.shape}" if isinstance(t, ReceivedTensor) else type(t).__name__
        raise BadReply(f"{what}: expected {dtype} {shape}, got {got}")
    return t
