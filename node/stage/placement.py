"""Stage placement: which stage this node's server serves, and when it moves to another.

The daemon's side of stage selection (selection.py holds the pure decisions;
docs/stage_selection.md the reasoning). :class:`ServerComponent` is the ``stage_server``
component:

- **Claim** (``_claim``): ``node.stage`` when pinned, else the stage it held before a
  restart (``<state_dir>/stage.json``, same run id; ``resume_stage``), else, after a random
  back-off and a fresh read of the records, the stage with the least total throughput
  (``choose_stage``). The claim is remembered in ``stage.json`` whenever a stage is claimed
  or moved to, and forgotten when the stage fails to open (a restart would fail again).
- **Serve** (``_serve``): build the StageServer and its collaborative optimizer (on the main
  thread, which runs the daemon's loop), which loads the stage's state from its replicas
  and benchmarks, then serves.
- **Rebalance** (``_rebalance_loop``): every ``rebalance.period_s`` (jittered), compute the
  swarm's rebalance plan from the peer table and our measured throughput, and make our move
  when the plan names us (``_move``).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

from ...transport.endpoint import PeerAddress
from ..component import ComponentContext
from ..config.runspec import RunSpec
from ..config.sections import RebalanceConfig
from ..endpoint import EndpointComponent
from ..errors import DhtError, JoinError, RecordError
from ..logs import get_logger
from ..membership.peers import PeerTable
from ..membership.records import ServerState
from ..service.statefiles import write_atomically
from .averaging import AveragingConfig
from .diloco import make_stage_optimizer
from .memory import check_fits
from .outer_payloads import PayloadLink
from .selection import (
    COUNTED_STATES,
    MAX_STAGE_CLAIM_BYTES,
    Move,
    RebalancePlan,
    ServerLoad,
    choose_stage,
    clamp_claims,
    encode_stage_claim,
    join_backoff,
    keep_resumed_stage,
    next_rebalance_delay,
    plan_move,
    plan_rebalance,
    resume_stage,
)
from .server import StageServer, resolve_device
from .server_config import StageServerConfig

log = get_logger(__name__)

# the stage this server last claimed in its run, so that a restart claims it again
STAGE_CLAIM_FILE = "stage.json"
# Throughput announced between claiming a stage and measuring it, so that servers choosing
# meanwhile count this one (selection ignores servers announcing 0).
PLACEHOLDER_THROUGHPUT = 1.0
# the servers a new server of a stage downloads the stage's state from, and those that
# take the stage's DiLoCo and gossip rounds (ReplicasOnline)
_DONOR_STATES: frozenset[ServerState] = frozenset({"online"})


def read_stage_claim(state_dir: Path) -> bytes | None:
    """The stored stage claim's bytes (``<state_dir>/stage.json``); None when absent or
    unreadable."""
    path = state_dir / STAGE_CLAIM_FILE
    try:
        with open(path, "rb") as f:
            return f.read(MAX_STAGE_CLAIM_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read %s: %s; choosing a stage anew", path, exc)
        return None


def write_stage_claim(state_dir: Path, run_id: str, stage: int) -> None:
    """Store the claim atomically (a temporary file, fsync, rename): a crash leaves the old
    claim or the new one. A failed write is logged, not fatal (a restart then chooses anew)."""
    path = state_dir / STAGE_CLAIM_FILE
    error = write_atomically(path, encode_stage_claim(run_id, stage))
    if error is not None:
        log.warning("cannot remember stage %d in %s: %s", stage, path, error)


def forget_stage_claim(state_dir: Path) -> None:
    """Delete the stored claim (a failed open): the restart chooses a stage anew rather than
    crash the same way again."""
    path = state_dir / STAGE_CLAIM_FILE
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot forget the stage claim in %s: %s", path, exc)
    else:
        log.warning("forgot the stage claim in %s: the stage failed to open", path)


class ServerComponent:
    """Claims a stage, serves it, and moves when the swarm's rebalance plan names it.

    A move (``_move``): announce ``draining``, drain the old stage's server (at most
    ``rebalance.drain_timeout_s``), close it (it leaves that stage's collaboration), remember
    and announce the new stage as ``joining`` (with the throughput the plan counted for us),
    build the new stage's server, which loads the stage's state from its peers and
    benchmarks, then announce ``online``. A leave during a move cancels the move's remaining
    steps and closes whichever server is held; the daemon's own ``draining`` is never
    overwritten. ``online_server`` is None until the new server is online.

    ``config`` and ``averaging`` configure the stage servers it builds; ``rebalance``,
    ``pinned_stage`` (node.stage) and ``join_backoff`` (node.join_backoff) the placement.
    """

    name = "stage_server"

    def __init__(
        self,
        spec: RunSpec,
        endpoint: EndpointComponent,
        rng: random.Random,
        *,
        config: StageServerConfig,
        averaging: AveragingConfig,
        rebalance: RebalanceConfig,
        pinned_stage: int | None,
        join_backoff: float,
    ) -> None:
        self.spec = spec
        self.endpoint = endpoint
        self.rng = rng
        self.config = config
        self.averaging = averaging
        self.rebalance = rebalance
        self.pinned_stage = pinned_stage
        self.join_backoff = join_backoff
        self.server: StageServer | None = None
        self.moves = 0
        self.last_move: dict[str, Any] | None = None
        self.checks = 0
        self._target: int | None = None  # the stage claimed (the one being loaded during a move)
        self._leaving = False
        self._paused = False  # wanswarm pause
        self._moving = False
        self._rebalancer: asyncio.Task[None] | None = None
        self._retiring: asyncio.Task[None] | None = None  # the old server's close, during a move

    async def start(self, ctx: ComponentContext) -> None:
        assert self.endpoint.endpoint is not None, "the endpoint component starts first"
        stage = await self._claim(ctx)
        # before the claim is announced: a stage this device cannot hold is refused here, with
        # the stages and max_in_flight that would fit (StageMemoryError), not after others
        # have counted us as its server
        check_fits(self.spec, stage, self.config, resolve_device(self.config.device))
        self._remember(ctx, stage)
        ctx.membership.update(stage=stage, throughput=PLACEHOLDER_THROUGHPUT, queue=0,
                              movable=self._rebalances())
        await ctx.membership.announce()
        await self._serve(ctx, stage)
        if self._rebalances():
            self._rebalancer = ctx.spawn(self._rebalance_loop(ctx), "rebalance")

    def online_server(self) -> StageServer | None:
        """Our stage server while it serves; None while starting or between stages."""
        server = self.server
        return server if server is not None and server.state == "online" else None

    async def _serve(self, ctx: ComponentContext, stage: int) -> None:
        """Build the stage's server and start it: load its state from peers, benchmark, serve."""
        endpoint = self.endpoint.endpoint
        assert endpoint is not None, "the endpoint component starts first"
        dht, averaging = ctx.dht, self.averaging
        # hivemind's Optimizer installs signal handlers: this runs on the main thread (the loop's).
        # Registering the request kinds on the endpoint replaces a previous server's handlers.
        self.server = StageServer(
            self.spec, stage, self.config,
            endpoint=endpoint,
            # the [averaging] mode's optimizer: hivemind's collaborative one, or DiLoCo's
            make_optimizer=lambda module: make_stage_optimizer(
                module, self.spec, stage, dht, averaging,
                others=ReplicasOnline(ctx.peers, stage, self.spec.run_id),
                departed=DepartedReplicas(ctx.peers, stage),
                # DiLoCo's outer payloads: fetched from the stage's servers over QUIC
                payloads=PayloadLink(
                    endpoint, asyncio.get_running_loop(),
                    lambda: [s.address for s in ctx.peers.servers(
                        stage=stage, run_id=self.spec.run_id
                    )],
                ),
            ),
            state_dir=Path(ctx.state_dir),
            donors=lambda: self._donors(ctx, stage),
        )
        if self._paused:  # paused before this server existed (or before a move)
            self.server.pause()
        try:
            await self.server.start(ctx)
        except Exception:
            # a stage that crashes while opening must not be claimed again at every restart
            forget_stage_claim(Path(ctx.state_dir))
            raise

    def _donors(self, ctx: ComponentContext, stage: int) -> list[PeerAddress]:
        """The online servers of ``stage`` in this run (state donors for a server opening there)."""
        return [
            s.address
            for s in ctx.peers.servers(_DONOR_STATES, stage=stage, run_id=self.spec.run_id)
        ]

    # ---- claim ----------------------------------------------------------------------

    async def _claim(self, ctx: ComponentContext) -> int:
        """The stage to serve: ``node.stage`` when set, else the stage this server held in this
        run before a restart (``stage.json``), else the least-served after a back-off."""
        n_stages = self.spec.n_stages
        pinned = self.pinned_stage
        if pinned is not None:
            if pinned >= n_stages:
                raise JoinError(
                    f"node.stage: run {self.spec.name!r} has {n_stages} stages "
                    f"(0..{n_stages - 1}), got {pinned}"
                )
            log.info("serving stage %d of %d (node.stage)", pinned, n_stages)
            return pinned
        resumed = resume_stage(read_stage_claim(Path(ctx.state_dir)), self.spec.run_id, n_stages)
        if resumed is not None:
            try:
                await ctx.membership.refresh()
            except Exception as exc:  # resume from the table as it was
                log.warning("could not re-read the records before resuming a stage: %s", exc)
            if keep_resumed_stage(self._selection_view(ctx), n_stages, resumed,
                                  exclude_peer=ctx.identity.peer_id):
                log.info(
                    "serving stage %d of %d again (held before the restart, %s)",
                    resumed, n_stages, STAGE_CLAIM_FILE,
                )
                return resumed
            log.info(
                "stage %d (held before the restart) is served by others while a stage has "
                "no server: choosing anew", resumed,
            )
        delay = join_backoff(self.rng, self.join_backoff)
        log.info("choosing a stage in %.1fs", delay)
        # a deliberate spread of simultaneous joins, not a synchronisation
        await asyncio.sleep(delay)
        try:
            await ctx.membership.refresh()
        except Exception as exc:  # a failed read leaves the table as it was: choose from it
            log.warning("could not re-read the records before choosing a stage: %s", exc)
        stage = choose_stage(self._selection_view(ctx), n_stages, PLACEHOLDER_THROUGHPUT, self.rng)
        log.info("claiming stage %d of %d", stage, n_stages)
        return stage

    def _remember(self, ctx: ComponentContext, stage: int) -> None:
        self._target = stage
        write_stage_claim(Path(ctx.state_dir), self.spec.run_id, stage)

    def _selection_view(self, ctx: ComponentContext, *, clamp: bool = True) -> list[ServerLoad]:
        """The other servers as stage selection counts them (joining and online), their
        claims capped relative to the others' (``clamp_claims``) unless ``clamp`` is off."""
        view = [
            ServerLoad(s.peer.peer_id, s.stage, s.record.throughput, s.record.state,
                       s.record.movable)
            for s in ctx.peers.servers(COUNTED_STATES, run_id=self.spec.run_id)
        ]
        if not clamp:
            return view
        return clamp_claims(view, self.spec.n_stages, self.rebalance.max_claim_ratio)

    # ---- rebalancing ----------------------------------------------------------------

    def _rebalances(self) -> bool:
        return self.rebalance.enabled and (self.pinned_stage is None or self.rebalance.move_pinned)

    async def _rebalance_loop(self, ctx: ComponentContext) -> None:
        """Every ``rebalance.period_s`` (jittered): compute the plan, make our move if it
        names us."""
        while not self._leaving:
            # the check's period, jittered
            await asyncio.sleep(next_rebalance_delay(self.rng, self.rebalance))
            decision = self._decide(ctx)
            if decision is not None:
                await self._move(ctx, *decision)

    def _decide(self, ctx: ComponentContext) -> tuple[Move, RebalancePlan] | None:
        """Our move in the plan computed from the records and our own measured throughput."""
        server = self.server
        if (
            self._leaving
            or self._paused
            or server is None
            or server.state != "online"
            or ctx.membership.state != "online"
        ):
            return None  # only a serving node moves: never while joining, moving or leaving
        self.checks += 1
        me = ctx.identity.peer_id
        view = [s for s in self._selection_view(ctx, clamp=False) if s.peer_id != me]
        view.append(ServerLoad(me, server.stage, server.throughput, "online"))
        # capped with our own figure in the view: every server caps the same view
        view = clamp_claims(view, self.spec.n_stages, self.rebalance.max_claim_ratio)
        plan = plan_rebalance(view, self.spec.n_stages, self.rebalance)
        move = plan_move(plan, me)
        if plan.moves and move is None:
            log.debug(
                "rebalance plan moves %d other server(s): bottleneck %.2f -> %.2f",
                len(plan.moves), plan.bottleneck_before, plan.bottleneck_after,
            )
        return None if move is None else (move, plan)

    async def _move(self, ctx: ComponentContext, move: Move, plan: RebalancePlan) -> None:
        old = self.server
        assert old is not None and old.stage == move.from_stage
        loop = asyncio.get_running_loop()
        began, began_unix = loop.time(), time.time()
        log.info(
            "moving from stage %d to stage %d: swarm bottleneck %.2f -> %.2f samples/s "
            "(%.2f over a period counting the load)", move.from_stage, move.to_stage,
            plan.bottleneck_before, plan.bottleneck_after, plan.bottleneck_amortized,
        )
        self._moving = True
        try:
            if not await self._announce_state(ctx, "online", "draining"):
                return
            await old.drain(loop.time() + self.rebalance.drain_timeout_s)
            drained = loop.time()
            # the old server leaves its collaboration; shielded so that a leave arriving now
            # lets the close finish (close() awaits the same task)
            self.server = None
            self._retiring = asyncio.ensure_future(old.close())
            await asyncio.shield(self._retiring)
            self._retiring = None
            self._remember(ctx, move.to_stage)
            # until measured at the new stage, announce what the plan counted for us there
            ctx.membership.update(stage=move.to_stage, throughput=move.throughput, queue=0)
            if not self._enter_state(ctx, "draining", "joining"):
                return
            closed = loop.time()
            # "joining" is published while the new stage loads: a store can take the DHT's
            # whole request timeout under load, and the load does not need it to have landed.
            # It is awaited before "online" is published, which must land last.
            joining = asyncio.ensure_future(self._publish_state(ctx, "joining"))
            try:
                await self._serve(ctx, move.to_stage)
                await joining
            finally:
                joining.cancel()
            if not await self._announce_state(ctx, "joining", "online"):
                return
            online = loop.time()
        finally:
            self._moving = False
        self.moves += 1
        self.last_move = {
            "from": move.from_stage,
            "to": move.to_stage,
            "at_unix": round(began_unix, 3),
            "throughput": round(move.throughput, 3),
            "bottleneck_before": round(plan.bottleneck_before, 3),
            "bottleneck_after": round(plan.bottleneck_after, 3),
            "bottleneck_amortized": round(plan.bottleneck_amortized, 3),
            "drain_s": round(drained - began, 3),
            "close_s": round(closed - drained, 3),
            "load_s": round(online - closed, 3),
            "total_s": round(online - began, 3),
        }
        log.info(
            "moved to stage %d in %.1fs (drain %.1fs, close %.1fs, load %.1fs)", move.to_stage,
            online - began, drained - began, closed - drained, online - closed,
        )

    async def _announce_state(
        self, ctx: ComponentContext, expected: ServerState, state: ServerState
    ) -> bool:
        """Set our announced state and publish it, unless the node left ``expected`` meanwhile
        (the daemon announced ``draining`` for a leave): then the move stops here (False)."""
        if not self._enter_state(ctx, expected, state):
            return False
        await self._publish_state(ctx, state)
        return True

    def _enter_state(self, ctx: ComponentContext, expected: ServerState,
                     state: ServerState) -> bool:
        """Set our announced state, unless the node left ``expected`` meanwhile."""
        if self._leaving or ctx.membership.state != expected:
            log.info("stage move stopped before announcing %s: the node is leaving", state)
            return False
        ctx.membership.set_state(state)
        return True

    async def _publish_state(self, ctx: ComponentContext, state: ServerState) -> None:
        try:
            await ctx.membership.announce()
        except (DhtError, RecordError) as exc:  # the announce loop retries on its own period
            log.warning("announcing %s failed: %s", state, exc)

    # ---- component seam -------------------------------------------------------------

    def pause(self) -> None:
        """``wanswarm pause``: our server refuses work and announces no throughput; no moves
        (a paused node must not pull a stage's throughput away by leaving it)."""
        self._paused = True
        if self.server is not None:
            self.server.pause()

    def resume(self) -> None:
        self._paused = False
        if self.server is not None:
            self.server.resume()

    async def drain(self, deadline: float) -> None:
        self._leaving = True
        task = self._rebalancer
        if task is not None and not task.done():
            # a move in progress stops at its next step; what it holds is closed below
            task.cancel()
            remaining = max(0.0, deadline - asyncio.get_running_loop().time())
            await asyncio.wait({task}, timeout=remaining)
        server = self.server
        if server is not None and server.state != "joining":  # a joining server has served nothing
            await server.drain(deadline)

    async def close(self) -> None:
        if self._retiring is not None:
            await self._retiring
        if self.server is not None:
            await self.server.close()

    def status(self) -> dict[str, Any]:
        if self.server is not None:
            out = self.server.status()
        else:  # between stages (or not started): the fields readers of a server's status expect
            out = {"stage": self._target, "state": "joining", "queue": 0, "throughput": 0.0}
        out.update(
            moves=self.moves,
            last_move=self.last_move,
            rebalance={
                "enabled": self._rebalances(),
                "checks": self.checks,
                "moving": self._moving,
            },
        )
        return out


__all__ = [
    "PLACEHOLDER_THROUGHPUT",
    "STAGE_CLAIM_FILE",
    "ServerComponent",
    "forget_stage_claim",
    "read_stage_claim",
    "write_stage_claim",
]


class ReplicasOnline:
    """How many other servers of ``stage`` (in the run ``run_id``) are ``online``: the
    replicas that may join the stage's next averaging round (DiLoCo, gossip: its group's
    target, and whether a round alone may skip matchmaking). One still ``joining`` loads
    its state and takes no round before it is online; one ``draining`` is leaving."""

    def __init__(self, table: PeerTable, stage: int, run_id: str) -> None:
        self.table = table
        self.stage = stage
        self.run_id = run_id

    def __call__(self) -> int:
        return len(self.table.servers(_DONOR_STATES, stage=self.stage, run_id=self.run_id))


class DepartedReplicas:
    """The peer ids, as hivemind's progress records carry them (bytes), of the replicas that
    stopped serving ``stage`` (``PeerTable.gone_from``). Called from the stage's progress
    tracker thread: it reads the table's ``gone``, which the loop replaces and never
    changes, and keeps its own cache of conversions."""

    def __init__(self, table: PeerTable, stage: int) -> None:
        self.table = table
        self.stage = stage
        self._bytes: dict[str, bytes] = {}

    def __call__(self) -> frozenset[bytes]:
        from hivemind.p2p import PeerID

        out = set()
        for peer_id in self.table.gone_from(self.stage):
            raw = self._bytes.get(peer_id)
            if raw is None:
                try:
                    raw = PeerID.from_base58(peer_id).to_bytes()
                except ValueError:
                    continue
                if len(self._bytes) >= 1024:  # peers gone long ago: start over
                    self._bytes.clear()
                self._bytes[peer_id] = raw
            out.add(raw)
        return frozenset(out)
