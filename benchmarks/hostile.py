"""Hostile-server benchmark: spot checks and clamped claims against one lying stage server.

Runs a small swarm in this process: stage servers (``StageServer``, the daemon's own) on
their own QUIC endpoints on 127.0.0.1, and one trainer (``Trainer``) on another, twice
with the same data, initialization and seed:

- **honest**: every server honest;
- **attacked**: one server of the middle stage lies: a ``--wrong-fraction`` of its
  ``forward`` replies are wrong (its output rolled by one position along the sequence:
  in-bounds, plausible values that no limit can refuse), a ``--huge-fraction`` are
  multiplied by 1e6 (beyond the run's ``max_activation``), and it claims 1e12 samples/s
  in its record; with ``--lie-in backward`` its forwards are honest and the dL/dx of its
  training backwards (what it sends to the stage before) are the wrong ones; with
  ``--lie-in forward_loss`` the liar is a server of the last stage whose losses are honest
  and whose dL/dx are wrong;
- **dodging** (unless ``--no-dodging``): the same liar, whose replies also promise no
  parameters (``params`` null), so that the checks comparing equal promises skip them;
  the trainer compares answers at one epoch within the looser bound;
- **dodging_without_epoch_checks**: the same, that comparison off (the baseline: the
  liar is never caught).

Replicas of a stage step together (``LockstepOptimizer``: an in-process synchronous
all-reduce; every replica of the stage joins at its next step or periodic step check and
applies the same mean gradient), so honest replicas hold bit-identical parameters within
an epoch, as hivemind's synchronous averaging leaves them. Spot checks compare answers
only within an epoch (equal promised parameters within 5%, the dodger's within 50%).

Measured:

- ``caught_after_micro_batches``: micro-batches the trainer had started when the liar was
  convicted (null if never);
- ``false_positives``: honest servers convicted, plus spot-check disagreements between
  honest replicas, in every run (the target is 0);
- ``extra_compute_fraction``: device seconds the servers spent on spot checks' second
  and third replicas / device seconds of the training hops (the attacked run);
- ``val_loss_honest``, ``val_loss_attacked``: validation loss through the swarm after
  training (the attacked run's must be within 2% of the honest run's);
- ``liar_share_before_conviction``: the liar's share of its stage's hops before it was
  caught (three replicas: about 1/3 when its claim is clamped to measurement, nearly 1
  if its claim were believed);
- ``dodging``: for both dodging runs, when the liar was first outvoted
  (``caught_after_micro_batches``) and convicted, the outvotes, its share of its stage's
  hops over the whole run, the lies it told and the validation loss.

Output: progress on stderr, then one JSON line on stdout (the last line). ::

    nice -n 10 python benchmarks/hostile.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from wanswarm.node.config.runspec import (
    BatchSpec,
    ModelSpec,
    OptimizerSpec,
    RunSpec,
    StagesSpec,
)
from wanswarm.node.protocol import Kind
from wanswarm.node.stage.optimizer import LocalOptimizer
from wanswarm.node.stage.server import StageServer
from wanswarm.node.stage.server_config import StageServerConfig
from wanswarm.node.training.data import TrainStream, validation_set
from wanswarm.node.training.routing import RouterConfig
from wanswarm.node.training.servers import ServerInfo
from wanswarm.node.training.spot_checks import SpotCheckConfig
from wanswarm.node.training.trainer import Trainer
from wanswarm.node.training.trainer_config import TrainerConfig
from wanswarm.transport.codecs import EncodedTensor, decode, encode
from wanswarm.transport.config import CongestionConfig, TransportConfig
from wanswarm.transport.endpoint import Endpoint, Handler, Request, Response
from wanswarm.transport.identity import Identity

ABSURD_CLAIM = 1e12  # samples/s the liar announces (honest servers: their benchmark's)


def bench_spec(d_model: int = 64, seq_len: int = 32, micro_batch: int = 4) -> RunSpec:
    """A small 3-stage run: fast enough for a few hundred micro-batches on 2 cores."""
    return RunSpec(
        name="hostilebench",
        model=ModelSpec(d_model=d_model, n_heads=4, n_layers=3, seq_len=seq_len),
        stages=StagesSpec(blocks_per_stage=(1, 1, 1)),
        batch=BatchSpec(micro_batch_size=micro_batch, target_batch_size=4 * micro_batch),
        optimizer=OptimizerSpec(lr=3e-3, warmup_steps=0, schedule="constant"),
    )


# ---- replicas that step together ------------------------------------------------------


class LockstepGroup:
    """The replicas of one stage: a synchronous all-reduce in one process.

    When the replicas' samples reach the target batch, each replica's device thread joins
    the step at its next ``step``/``step_if_due`` call; the last to arrive averages the
    accumulated gradients over every replica and steps every replica's optimizer with the
    same mean, while the others wait (no job runs on any replica of the stage meanwhile).
    """

    def __init__(self, target: int, timeout_s: float = 60.0) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.members: list[LockstepOptimizer] = []
        self.lock = threading.Lock()
        self.samples = 0
        self.due_epoch = 0  # the epoch every member must reach
        self._barrier: threading.Barrier | None = None

    def join(self, member: LockstepOptimizer) -> None:
        self.members.append(member)
        self._barrier = threading.Barrier(len(self.members), action=self._step_all)

    def add(self, batch: int) -> None:
        with self.lock:
            self.samples += batch
            if self.samples >= self.target and self.due_epoch == self.members[0].local_epoch:
                self.due_epoch += 1

    def wait(self) -> None:
        assert self._barrier is not None
        self._barrier.wait(self.timeout_s)

    @torch.no_grad()
    def _step_all(self) -> None:
        times = sum(m.times for m in self.members)
        for i, params in enumerate(zip(*(m.params for m in self.members), strict=True)):
            mean = sum(m.acc[i] for m in self.members) / max(times, 1)
            for p in params:
                p.grad = mean.clone()
        for m in self.members:
            m.apply()
        with self.lock:
            self.samples = 0


class LockstepOptimizer(LocalOptimizer):
    """A replica's optimizer in a ``LockstepGroup`` (the StageOptimizer contract)."""

    def __init__(self, module: nn.Module, spec: RunSpec, group: LockstepGroup) -> None:
        super().__init__(module, spec)
        self.group = group
        group.join(self)

    @property
    def params(self) -> list[nn.Parameter]:
        return self._params

    @property
    def acc(self) -> list[torch.Tensor]:
        return self._acc

    @property
    def times(self) -> int:
        return self._times

    @torch.no_grad()
    def step(self, batch_size: int) -> None:
        self.accumulate(batch_size)  # LocalOptimizer's accumulation; the group decides the step
        self.group.add(batch_size)
        self.step_if_due()

    def step_if_due(self) -> bool:
        if self.group.due_epoch <= self._epoch:
            return False
        self.group.wait()
        return True

    @property
    def num_peers(self) -> int:
        return len(self.group.members)



# ---- the liar --------------------------------------------------------------------------


class LyingRegistry:
    """The endpoint as a lying server registers on it: its replies of the kind ``lie_in``
    (``forward``: outputs; ``backward``, ``forward_loss``: the dL/dx of its training hops,
    spot checks of other replicas answered honestly) are wrong on a fraction of hops
    (rolled along the sequence) and huge on another fraction."""

    def __init__(
        self, endpoint: Endpoint, *, wrong: float, huge: float, rng: random.Random,
        dodge: bool = False, lie_in: str = "forward",
    ) -> None:
        self.endpoint = endpoint
        self.wrong, self.huge = wrong, huge
        self.lie_in = lie_in
        self.dodge = dodge  # every lying reply promises no parameters (params null)
        self.rng = rng
        self.lies = 0
        self.replies = 0

    def register(self, kind: str, handler: Handler, *, allow_nonfinite: bool = False) -> None:
        if kind == str(Kind(self.lie_in)):
            handler = self._lying(handler)
        self.endpoint.register(kind, handler, allow_nonfinite=allow_nonfinite)

    def _lying(self, handler: Handler) -> Handler:
        async def lie(request: Request) -> Response:
            reply = await handler(request)
            if request.header.get("check"):  # checking another replica: honest, unseen
                return reply
            self.replies += 1
            if self.dodge:
                reply = Response({**reply.header, "params": None}, reply.tensors, reply.codec)
            draw = self.rng.random()
            if draw >= self.wrong + self.huge or not reply.tensors:
                return reply
            enc = reply.tensors[0]
            assert isinstance(enc, EncodedTensor)
            y = decode(enc)  # (B, T, C)
            bad = y * 1e6 if draw >= self.wrong else torch.roll(y, shifts=1, dims=1)
            self.lies += 1
            return Response(reply.header, [encode(bad, enc.spec)], reply.codec)

        return lie


# ---- one run ---------------------------------------------------------------------------


@dataclass
class RunResult:
    val_loss: float
    completed: int
    failed: int
    caught_after: int | None
    honest_convicted: int
    disagreements_honest: int
    spot_checks: int
    skipped: int
    extra_compute_fraction: float
    liar_share_before: float | None
    liar_share: float | None  # over the whole run
    outvoted: int  # answers outvoted at one epoch (banned, not convicted)
    liar_convicted: bool
    convicted_after: int | None  # micro-batches started when it was convicted
    lies: int
    evidence: list[dict[str, Any]]
    seconds: float


def _transport() -> TransportConfig:
    return TransportConfig(
        host="127.0.0.1", connect_timeout_s=5.0, handshake_timeout_s=5.0,
        congestion=CongestionConfig(algorithm="reno"),
    )


async def run_swarm(
    spec: RunSpec,
    *,
    replicas: tuple[int, ...],
    micro_batches: int,
    spot_fraction: float,
    liar_stage: int | None,
    wrong: float,
    huge: float,
    seed: int,
    log: Callable[[str], None],
    honest_claim: float | None = None,
    dodge: bool = False,
    by_epoch: bool = True,
    outvotes_to_convict: int = 3,
    lie_in: str = "forward",
) -> RunResult:
    """Train ``micro_batches`` through a swarm of ``replicas[s]`` servers per stage; the
    first server of ``liar_stage`` lies when given. The honest servers announce the
    throughput their one-iteration benchmark measured, or ``honest_claim`` (a test that
    must not depend on how loaded the machine was while they measured: the router gives an
    unmeasured peer at most 4x the lower median of the others' figures, and one honest
    server that measured itself 10x faster than the other under load takes the liar's hops).
    ``dodge``: the liar's forward replies promise no parameters (params null);
    ``by_epoch``: the trainer's spot checks compare answers at one epoch without that
    promise (``compare_same_epoch``). A dodging liar counts as caught at its first answer
    outvoted there (banned for a while: no conviction in that tier). ``lie_in``: the request
    kind whose replies the liar falsifies (``forward``, ``backward`` or ``forward_loss``)."""
    torch.manual_seed(seed)
    endpoints: list[Endpoint] = []
    servers: list[StageServer] = []
    liar: LyingRegistry | None = None
    config = StageServerConfig(device="cpu", benchmark_iterations=1, step_check_period_s=0.02)
    trainer_ep = Endpoint(Identity.generate(), _transport())
    await trainer_ep.start("127.0.0.1", 0)
    endpoints.append(trainer_ep)
    for stage, n in enumerate(replicas):
        group = LockstepGroup(spec.batch.target_batch_size)
        for r in range(n):
            ep = Endpoint(Identity.generate(), _transport())
            await ep.start("127.0.0.1", 0)
            endpoints.append(ep)
            registry: Any = ep
            if stage == liar_stage and r == 0:
                liar = registry = LyingRegistry(
                    ep, wrong=wrong, huge=huge, rng=random.Random(seed + 1), dodge=dodge,
                    lie_in=lie_in,
                )

            def make(module: nn.Module, group: LockstepGroup = group) -> LockstepOptimizer:
                return LockstepOptimizer(module, spec, group)

            servers.append(
                StageServer(spec, stage, config, endpoint=registry, make_optimizer=make)
            )
    liar_id = liar.endpoint.peer_id if liar is not None else None
    server_eps = endpoints[1:]

    def view() -> dict[int, list[ServerInfo]]:
        out: dict[int, list[ServerInfo]] = {}
        for server, ep in zip(servers, server_eps, strict=True):
            host, port = ep.address
            claim = (
                ABSURD_CLAIM if ep.peer_id == liar_id
                else server.throughput if honest_claim is None else honest_claim
            )
            out.setdefault(server.stage, []).append(
                ServerInfo(ep.peer_id, host, port, claim, server.queue_len, "online", None)
            )
        return out

    caught: list[int] = []
    trainer: Trainer | None = None
    stream = TrainStream(spec, seed=seed)

    def found_out() -> bool:
        """The liar convicted, or one of its answers outvoted (evidence of its lie)."""
        if liar_id is None or trainer is None:
            return False
        if trainer.router.is_convicted(liar_id):
            return True
        for record in trainer.spot_checker.evidence:
            answers: Any = record["answers"]
            verdict = record["verdict"]
            if verdict in ("first_lied", "second_lied"):
                if answers[0 if verdict == "first_lied" else 1]["peer"] == liar_id:
                    return True
        return False

    convicted: list[int] = []  # when the liar was convicted (a dodging liar: later)

    def data() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(micro_batches):
            if not caught and found_out():
                caught.append(i)
            if (not convicted and liar_id is not None and trainer is not None
                    and trainer.router.is_convicted(liar_id)):
                convicted.append(i)
            yield next(stream)

    trainer = Trainer(
        spec,
        TrainerConfig(
            max_in_flight=4, request_timeout_s=30.0, max_attempts=6,
            router=RouterConfig(ban_max_s=5.0),
            spot_checks=SpotCheckConfig(
                fraction=spot_fraction, compare_same_epoch=by_epoch,
                outvotes_to_convict=outvotes_to_convict,
            ),
        ),
        endpoint=trainer_ep,
        servers=view,
        rng=random.Random(seed),
        data=data(),
        spot_rng=random.Random(seed + 2),
    )
    # the liar's share of its stage's hops before it was caught: counted at each hop's send;
    # and over the whole run (a dodging liar is banned for a while, then back)
    liar_hops = [0, 0]  # [to the liar, to its stage]
    liar_hops_all = [0, 0]
    sender = trainer._pipeline.hops
    original_send = sender.send

    async def counting_send(stage: int, *args: Any, **kwargs: Any) -> Any:
        result = await original_send(stage, *args, **kwargs)
        if stage == liar_stage and not kwargs.get("spot_check"):
            liar_hops_all[1] += 1
            liar_hops_all[0] += result[1] == liar_id
            if not caught:
                liar_hops[1] += 1
                liar_hops[0] += result[1] == liar_id
        return result

    sender.send = counting_send  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        for server in servers:
            await server.open()
        await trainer.run(max_micro_batches=micro_batches)
        if not caught and found_out():
            caught.append(micro_batches)
        log(f"  trained {micro_batches} micro-batches in {time.monotonic() - started:.1f} s")
        val = await trainer.evaluate(validation_set(spec))
    finally:
        for ep in endpoints:
            await ep.close()
        for server in servers:
            await server.close()
    c = trainer.counters
    honest_ids = [ep.peer_id for ep in server_eps if ep.peer_id != liar_id]
    honest_convicted = sum(trainer.router.is_convicted(p) for p in honest_ids)
    evidence = list(trainer.spot_checker.evidence)
    # a disagreement whose answers all came from honest servers is a false positive
    disagreements_honest = sum(
        all(a["peer"] != liar_id for a in e["answers"])  # type: ignore[union-attr]
        for e in evidence
    )
    training = c.compute_s - c.spot_check_compute_s
    return RunResult(
        val_loss=val,
        completed=c.completed,
        failed=c.failed,
        caught_after=caught[0] if caught else None,
        honest_convicted=honest_convicted,
        disagreements_honest=disagreements_honest,
        spot_checks=c.spot_checks,
        skipped=c.spot_checks_skipped,
        extra_compute_fraction=c.spot_check_compute_s / training if training > 0 else 0.0,
        liar_share_before=liar_hops[0] / liar_hops[1] if liar_hops[1] else None,
        liar_share=liar_hops_all[0] / liar_hops_all[1] if liar_hops_all[1] else None,
        outvoted=trainer.spot_checker.outvoted,
        liar_convicted=liar_id is not None and trainer.router.is_convicted(liar_id),
        convicted_after=(
            convicted[0] if convicted
            else micro_batches if liar_id is not None and trainer.router.is_convicted(liar_id)
            else None
        ),
        lies=liar.lies if liar is not None else 0,
        evidence=evidence,
        seconds=time.monotonic() - started,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="Print the JSON line only at the end.")
    parser.add_argument("--micro-batches", type=int, default=400)
    parser.add_argument("--spot-fraction", type=float, default=0.1,
                        help="Fraction of hops spot-checked (forward, forward_loss, backward).")
    parser.add_argument("--wrong-fraction", type=float, default=0.1,
                        help="Fraction of the liar's replies (of the kind --lie-in names) "
                        "that are wrong.")
    parser.add_argument("--huge-fraction", type=float, default=0.02,
                        help="Fraction of the liar's replies multiplied by 1e6.")
    parser.add_argument("--replicas", type=str, default="2,3,2",
                        help="Servers per stage, comma-separated (the liar is in stage 1; "
                        "with --lie-in forward_loss, in stage 2).")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads.")
    parser.add_argument("--lie-in", choices=("forward", "backward", "forward_loss"),
                        default="forward",
                        help="Which replies the liar falsifies: its forwards' outputs, the "
                        "dL/dx of its backwards (forwards honest), or the dL/dx of the last "
                        "stage's forward_loss (its loss honest; the liar then in stage 2).")
    parser.add_argument("--no-dodging", action="store_true",
                        help="Skip the two runs where the liar also promises no parameters.")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    replicas = tuple(int(x) for x in args.replicas.split(","))
    liar_stage = 2 if args.lie_in == "forward_loss" else 1
    if len(replicas) != 3 or min(replicas) < 1 or replicas[liar_stage] < 2:
        parser.error(f"--replicas: three stages, at least 2 servers in stage {liar_stage}")
    spec = bench_spec(args.d_model, args.seq_len)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    runs: dict[str, RunResult] = {}
    plan: list[tuple[str, int | None, bool, bool]] = [  # name, liar stage, dodge, by epoch
        ("honest", None, False, True), ("attacked", liar_stage, False, True),
    ]
    if not args.no_dodging:
        plan += [("dodging", liar_stage, True, True),
                 ("dodging_without_epoch_checks", liar_stage, True, False)]
    for name, liar, dodge, by_epoch in plan:
        log(f"{name} run: {args.micro_batches} micro-batches, replicas {replicas}")
        runs[name] = asyncio.run(
            run_swarm(
                spec, replicas=replicas, micro_batches=args.micro_batches,
                spot_fraction=args.spot_fraction, liar_stage=liar,
                wrong=args.wrong_fraction, huge=args.huge_fraction, seed=args.seed, log=log,
                dodge=dodge, by_epoch=by_epoch, lie_in=args.lie_in,
            )
        )
        r = runs[name]
        log(f"  val loss {r.val_loss:.4f}; completed {r.completed}, failed {r.failed}; "
            f"spot checks {r.spot_checks} (skipped {r.skipped}); caught after {r.caught_after}; "
            f"outvoted {r.outvoted}; liar's share {r.liar_share}; lies told {r.lies}; "
            f"{r.seconds:.1f} s")
    honest, attacked = runs["honest"], runs["attacked"]
    result: dict[str, Any] = {
        "caught_after_micro_batches": attacked.caught_after,
        "false_positives": sum(
            r.honest_convicted + r.disagreements_honest for r in runs.values()
        ),  # every run's
        "extra_compute_fraction": round(attacked.extra_compute_fraction, 4),
        "val_loss_honest": round(honest.val_loss, 4),
        "val_loss_attacked": round(attacked.val_loss, 4),
        "val_loss_gap": round(attacked.val_loss / honest.val_loss - 1.0, 4),
        "liar_share_before_conviction": (
            None if attacked.liar_share_before is None else round(attacked.liar_share_before, 3)
        ),
        "lies_told": attacked.lies,
        "spot_checks": {"honest": honest.spot_checks, "attacked": attacked.spot_checks},
        "micro_batches": {
            name: {"completed": r.completed, "failed": r.failed} for name, r in runs.items()
        },
        "evidence": attacked.evidence[:2],
        # the liar also promises no parameters in every reply (params null): caught by the
        # same-epoch comparison, and never without it (the baseline)
        "dodging": {
            name.removeprefix("dodging_") if name != "dodging" else "with_epoch_checks": {
                "caught_after_micro_batches": r.caught_after,
                "convicted_after_micro_batches": r.convicted_after,
                "outvoted": r.outvoted,
                "liar_share": None if r.liar_share is None else round(r.liar_share, 3),
                "lies_told": r.lies,
                "val_loss": round(r.val_loss, 4),
                "val_loss_gap": round(r.val_loss / honest.val_loss - 1.0, 4),
            }
            for name, r in runs.items() if name.startswith("dodging")
        },
        "meta": {
            "micro_batches": args.micro_batches, "spot_fraction": args.spot_fraction,
            "wrong_fraction": args.wrong_fraction, "huge_fraction": args.huge_fraction,
            "replicas": list(replicas), "d_model": args.d_model, "seq_len": args.seq_len,
            "lie_in": args.lie_in,
            "seconds": round(honest.seconds + attacked.seconds, 1),
        },
    }
    result["target_met"] = (
        result["false_positives"] == 0
        and attacked.caught_after is not None
        and abs(result["val_loss_gap"]) <= 0.02
        and ("dodging" not in runs or runs["dodging"].caught_after is not None)
    )
    if not args.json:
        for key in ("caught_after_micro_batches", "false_positives", "extra_compute_fraction",
                    "val_loss_honest", "val_loss_attacked", "liar_share_before_conviction"):
            print(f"{key}: {result[key]}")
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
