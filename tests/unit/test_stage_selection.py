"""Stage selection with hundreds of simulated servers: joins, back-off, rebalancing; the
remembered stage; the daemon's rebalance loop with a fake stage server."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import hypothesis
import hypothesis.strategies
import pydantic
import pytest
from wanswarm.node.config.sections import RebalanceConfig
from wanswarm.node.membership.records import ServerState
from wanswarm.node.stage.selection import (
    MAX_STAGE_CLAIM_BYTES,
    RebalancePolicy,
    ServerLoad,
    StageClaim,
    bottleneck,
    choose_stage,
    decode_stage_claim,
    encode_stage_claim,
    join_backoff,
    keep_resumed_stage,
    next_rebalance_delay,
    plan_move,
    plan_rebalance,
    rebalance_decision,
    resume_stage,
    stage_totals,
)

ONLINE: ServerState = "online"
JOINING: ServerState = "joining"
DRAINING: ServerState = "draining"


def lognormal_peers(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.lognormvariate(0.0, 0.7) for _ in range(n)]


def join_in_turn(throughputs: list[float], n_stages: int, seed: int) -> list[ServerLoad]:
    rng = random.Random(seed)
    servers: list[ServerLoad] = []
    for i, t in enumerate(throughputs):
        servers.append(ServerLoad(f"p{i}", choose_stage(servers, n_stages, t, rng), t, ONLINE))
    return servers


def test_equal_joiners_fill_stages_evenly() -> None:
    servers = join_in_turn([1.0] * 400, 5, seed=0)
    counts = [sum(s.stage == k for s in servers) for k in range(5)]
    assert counts == [80] * 5


def test_heterogeneous_joiners_balance_throughput() -> None:
    throughputs = lognormal_peers(300, seed=1)
    totals = stage_totals(join_in_turn(throughputs, 6, seed=1), 6)
    assert max(totals) - min(totals) <= max(throughputs)
    assert min(totals) >= 0.97 * sum(throughputs) / 6


def test_choose_stage_rules() -> None:
    servers = [
        ServerLoad("a", 0, 5.0),
        ServerLoad("b", 1, 2.0),
        ServerLoad("c", 1, 9.0, DRAINING),  # leaving: not counted
        ServerLoad("d", 2, 3.0, JOINING),  # loading: counted
        ServerLoad("e", 7, 9.0),  # unknown stage: ignored
    ]
    assert stage_totals(servers, 3) == [5.0, 2.0, 3.0]
    assert choose_stage(servers, 3, 1.0, random.Random(0)) == 1
    assert (
        choose_stage(servers, 3, 1.0, random.Random(0), exclude_peer="b") == 1
    )  # stage 1 now empty
    assert choose_stage(servers[:1], 3, 1.0, random.Random(0), exclude_peer="a") in (0, 1, 2)
    # Per-stage throughput: this server is slow on stage 1, so joining stage 2 raises the
    # bottleneck more (2 -> min(5, 2, 3+...) is capped by stage 1 either way, then the
    # lower current total wins).
    assert choose_stage(servers, 3, [1.0, 0.5, 4.0], random.Random(0)) == 1
    with pytest.raises(ValueError, match="2 values for 3 stages"):
        choose_stage(servers, 3, [1.0, 2.0], random.Random(0))


def test_ties_broken_by_rng() -> None:
    picks = {choose_stage([], 4, 1.0, random.Random(seed)) for seed in range(40)}
    assert picks == {0, 1, 2, 3}
    assert choose_stage([], 4, 1.0, random.Random(7)) == choose_stage([], 4, 1.0, random.Random(7))


def simultaneous_join(
    n: int, n_stages: int, max_backoff: float, latency: float, seed: int
) -> list[int]:
    """n joiners start at t=0; each sees the records older than ``latency``. The last stage
    starts 3 servers short, so joiners that all read the same records all pick it."""
    rng = random.Random(seed)
    existing = [
        ServerLoad(f"e{k}.{i}", k, 1.0)
        for k in range(n_stages)
        for i in range(10 - 3 * (k == n_stages - 1))
    ]
    starts = sorted((join_backoff(rng, max_backoff), i) for i in range(n))
    joined: list[tuple[float, ServerLoad]] = []
    for at, i in starts:
        visible = existing + [s for t, s in joined if t + latency <= at]
        stage = choose_stage(visible, n_stages, 1.0, rng)
        joined.append((at, ServerLoad(f"j{i}", stage, 1.0, JOINING)))
    return [sum(s.stage == k for _, s in joined) for k in range(n_stages)]


def test_simultaneous_joiners_spread_with_backoff() -> None:
    without = simultaneous_join(200, 4, max_backoff=0.0, latency=1.0, seed=3)
    spread = simultaneous_join(200, 4, max_backoff=120.0, latency=1.0, seed=3)
    assert without == [0, 0, 0, 200]  # everyone read the same records
    assert max(spread) - min(spread) <= 4
    assert sum(spread) == 200


def test_join_backoff_bounds() -> None:
    rng = random.Random(0)
    delays = [join_backoff(rng, 10.0) for _ in range(1000)]
    assert 0.0 <= min(delays) and max(delays) < 10.0 and 4.0 < sum(delays) / 1000 < 6.0
    with pytest.raises(ValueError):
        join_backoff(rng, -1.0)


def test_rebalance_delay_is_jittered() -> None:
    policy = RebalancePolicy(period_s=60.0, jitter=0.25, load_s=10.0)
    delays = [next_rebalance_delay(random.Random(i), policy) for i in range(200)]
    assert 45.0 <= min(delays) < 50.0 and 70.0 < max(delays) <= 75.0


def test_policy_validation_says_what_to_change() -> None:
    with pytest.raises(pydantic.ValidationError, match="raise period_s"):
        RebalancePolicy(period_s=10.0, load_s=10.0)


def run_rounds(
    servers: list[ServerLoad], n_stages: int, policy: RebalancePolicy, rounds: int
) -> tuple[list[ServerLoad], list[int], list[float]]:
    """Every round each server asks for its decision on the same view; movers load for a round."""
    moves_per_round, bottlenecks = [], []
    for _ in range(rounds):
        plan = plan_rebalance(servers, n_stages, policy)
        moved = {m.peer_id: m for m in plan.moves}
        assert len(moved) == len(plan.moves)
        # Each server decides on its own from the same view: the planned ones move, others stay.
        for s in servers[:5] + [s for s in servers if s.peer_id in moved]:
            assert rebalance_decision(servers, n_stages, s.peer_id, policy) == moved.get(s.peer_id)
        loaded = [ServerLoad(s.peer_id, s.stage, s.throughput, ONLINE) for s in servers]
        servers = [
            ServerLoad(s.peer_id, moved[s.peer_id].to_stage, s.throughput, JOINING)
            if s.peer_id in moved
            else s
            for s in loaded
        ]
        online_per_stage = [
            sum(s.stage == k and s.state == ONLINE for s in servers) for k in range(n_stages)
        ]
        assert min(online_per_stage) >= 1, "a stage lost its last online server"
        moves_per_round.append(len(moved))
        bottlenecks.append(bottleneck(servers, n_stages))
    return servers, moves_per_round, bottlenecks


def test_rebalancing_converges_without_oscillation() -> None:
    n_stages = 5
    throughputs = lognormal_peers(300, seed=4)
    # A badly skewed start: one server in each of stages 1..4, everyone else in stage 0.
    servers = [
        ServerLoad(f"p{i}", i if i < n_stages else 0, t, ONLINE) for i, t in enumerate(throughputs)
    ]
    policy = RebalancePolicy(period_s=60.0, load_s=10.0, min_gain=0.01, max_moves=32)
    servers, moves, bottlenecks = run_rounds(servers, n_stages, policy, rounds=40)
    assert bottlenecks == sorted(bottlenecks), "the bottleneck must never fall"
    assert min(bottlenecks[-1:]) >= 0.98 * sum(throughputs) / n_stages
    first_idle = moves.index(0)
    assert all(m == 0 for m in moves[first_idle:]), f"moves resumed after settling: {moves}"
    assert sum(moves) < 2 * 300


def test_settled_swarm_stays_put_under_repeated_checks() -> None:
    servers = join_in_turn(lognormal_peers(400, seed=5), 8, seed=5)
    policy = RebalancePolicy(period_s=60.0, load_s=10.0, min_gain=0.01)
    _, moves, _ = run_rounds(servers, 8, policy, rounds=20)
    assert sum(moves) <= 8 and moves[-10:] == [0] * 10


def test_never_takes_a_stages_last_server() -> None:
    # Stage 1 has one huge server; stage 0 is starved but nobody may leave stage 1.
    servers = [ServerLoad("big", 1, 100.0), ServerLoad("small", 0, 1.0)]
    assert plan_rebalance(servers, 2, RebalancePolicy()).moves == ()
    # An empty stage is filled from a stage that keeps at least one online server.
    servers = [ServerLoad(f"p{i}", 0, 1.0) for i in range(4)] + [ServerLoad("j", 0, 1.0, JOINING)]
    plan = plan_rebalance(servers, 2, RebalancePolicy())
    assert [m.to_stage for m in plan.moves] == [1, 1]
    assert plan.bottleneck_before == 0.0 and plan.bottleneck_after == 2.0


def test_loading_cost_can_veto_a_move() -> None:
    servers = [ServerLoad(f"a{i}", 0, 1.0) for i in range(10)] + [
        ServerLoad(f"b{i}", 1, 1.0) for i in range(14)
    ]
    free = plan_rebalance(servers, 2, RebalancePolicy(load_s=0.0, min_gain=0.15))
    assert (
        len(free.moves) == 2 and free.bottleneck_after == 12.0 and free.bottleneck_amortized == 12.0
    )
    costly = plan_rebalance(servers, 2, RebalancePolicy(period_s=60.0, load_s=30.0, min_gain=0.15))
    assert costly.moves == ()  # (30 s at 10 + 30 s at 12) / 60 s = 11: only +10%
    assert plan_rebalance(
        servers, 2, RebalancePolicy(period_s=60.0, load_s=30.0, min_gain=0.1)
    ).moves


def test_equal_servers_one_mover_per_gap() -> None:
    servers = [ServerLoad(f"p{i}", 0, 1.0) for i in range(3)] + [ServerLoad("q", 1, 1.0)]
    policy = RebalancePolicy(load_s=0.0, min_gain=0.0)
    plan = plan_rebalance(servers, 2, policy)  # totals [3, 1] -> [2, 2]
    assert len(plan.moves) == 1 and plan.bottleneck_after == 2.0
    deciders = [s.peer_id for s in servers if rebalance_decision(servers, 2, s.peer_id, policy)]
    assert deciders == [plan.moves[0].peer_id]
    assert plan == plan_rebalance(
        list(reversed(servers)), 2, policy
    )  # order of records is irrelevant


def test_pinned_servers_are_never_named_and_the_gap_goes_to_a_movable_one() -> None:
    """Stage 0 holds three servers, two pinned (node.stage): the plan names the one that
    may move, even where the tie-break would have picked a pinned one, and counts the
    pinned ones as keeping stage 0 served."""
    policy = RebalancePolicy(load_s=0.0, min_gain=0.0)
    for movable_one in ("p0", "p1", "p2"):
        servers = [ServerLoad(f"p{i}", 0, 1.0, ONLINE, movable=f"p{i}" == movable_one)
                   for i in range(3)] + [ServerLoad("q", 1, 1.0)]
        plan = plan_rebalance(servers, 2, policy)
        assert [m.peer_id for m in plan.moves] == [movable_one]
        deciders = [s.peer_id for s in servers if rebalance_decision(servers, 2, s.peer_id,
                                                                     policy)]
        assert deciders == [movable_one]
    # only pinned servers where the gap could be filled from: no plan (none could carry it)
    pinned = [ServerLoad(f"p{i}", 0, 1.0, ONLINE, movable=False) for i in range(3)]
    assert plan_rebalance(pinned + [ServerLoad("q", 1, 1.0)], 2, policy).moves == ()
    # a pinned server is its stage's online server: the last movable one may leave
    servers = [ServerLoad("pin", 0, 1.0, ONLINE, movable=False), ServerLoad("m", 0, 1.0),
               ServerLoad("r", 0, 1.0, ONLINE, movable=False)]
    assert [m.peer_id for m in plan_rebalance(servers, 2, policy).moves] == ["m"]


# ------------------------------------------------------------------- plan_move


def test_plan_move_is_the_servers_own_entry() -> None:
    servers = [ServerLoad(f"p{i}", 0, 1.0) for i in range(3)] + [ServerLoad("q", 1, 1.0)]
    policy = RebalancePolicy(load_s=0.0, min_gain=0.0)
    plan = plan_rebalance(servers, 2, policy)
    (move,) = plan.moves
    assert plan_move(plan, move.peer_id) == move
    assert plan_move(plan, "q") is None and plan_move(plan, "nobody") is None


# ------------------------------------------------------------------- the remembered stage

RUN_ID = "0123456789abcdef"


def test_stage_claim_round_trip() -> None:
    raw = encode_stage_claim(RUN_ID, 2)
    assert raw == b'{"v":1,"run_id":"0123456789abcdef","stage":2}'
    assert decode_stage_claim(raw) == StageClaim(run_id=RUN_ID, stage=2)
    assert resume_stage(raw, RUN_ID, 3) == 2


def test_stage_claim_of_another_run_or_stage_is_ignored() -> None:
    raw = encode_stage_claim(RUN_ID, 2)
    assert resume_stage(raw, "fedcba9876543210", 3) is None  # the spec changed
    assert resume_stage(raw, RUN_ID, 2) is None  # the run has fewer stages now
    assert resume_stage(None, RUN_ID, 3) is None  # never claimed


def test_stage_claim_refuses_what_it_does_not_understand() -> None:
    assert decode_stage_claim(b'{"v":2,"run_id":"0123456789abcdef","stage":2}') is None
    assert decode_stage_claim(b'{"v":1,"run_id":"0123456789abcdef","stage":"2"}') is None  # strict
    assert decode_stage_claim(b'{"v":1,"run_id":"0123456789abcdef","stage":-1}') is None
    assert decode_stage_claim(b'{"v":1,"run_id":"0123456789abcdef","stage":2,"x":0}') is None
    assert decode_stage_claim(b'{"v":1,"run_id":"../../etc/passwd","stage":2}') is None
    assert decode_stage_claim(b"[]") is None and decode_stage_claim(b"\xff\xfe") is None
    padded = encode_stage_claim(RUN_ID, 2)[:-1] + b" " * MAX_STAGE_CLAIM_BYTES + b"}"
    assert decode_stage_claim(padded) is None  # oversize, though valid JSON
    with pytest.raises(ValueError, match="invalid stage claim"):
        encode_stage_claim("not-a-run-id", 0)
    with pytest.raises(ValueError, match="invalid stage claim"):
        encode_stage_claim(RUN_ID, -1)


def test_truncated_stage_claim_is_ignored() -> None:
    raw = encode_stage_claim(RUN_ID, 1)
    for n in range(len(raw)):
        assert decode_stage_claim(raw[:n]) is None, raw[:n]


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(hypothesis.strategies.binary(max_size=400))
def test_stage_claim_from_random_bytes_never_raises(raw: bytes) -> None:
    claim = decode_stage_claim(raw)
    assert claim is None or resume_stage(raw, claim.run_id, 4096) == claim.stage


def test_stage_claim_file_is_written_atomically(tmp_path: Path) -> None:
    from wanswarm.node.stage.placement import STAGE_CLAIM_FILE, read_stage_claim, write_stage_claim

    assert read_stage_claim(tmp_path) is None
    write_stage_claim(tmp_path, RUN_ID, 1)
    write_stage_claim(tmp_path, RUN_ID, 2)
    assert resume_stage(read_stage_claim(tmp_path), RUN_ID, 3) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [STAGE_CLAIM_FILE]  # no temporary left
    write_stage_claim(tmp_path / "missing", RUN_ID, 1)  # an unwritable place: logged, not raised
    assert read_stage_claim(tmp_path / "missing") is None


# ------------------------------------------------------------------- the config section


def test_rebalance_section_is_a_policy_with_daemon_fields() -> None:
    section = RebalanceConfig()
    assert isinstance(section, RebalancePolicy)
    assert section.enabled and not section.move_pinned and section.drain_timeout_s == 20.0
    with pytest.raises(pydantic.ValidationError, match="raise period_s"):
        RebalanceConfig(period_s=5.0, load_s=5.0)
    with pytest.raises(pydantic.ValidationError, match="drain_timeout_s"):
        RebalanceConfig(drain_timeout_s=0.0)
    with pytest.raises(pydantic.ValidationError, match="extra"):
        RebalanceConfig.model_validate({"period": 5.0})


# ------------------------------------------------------------------- the daemon's loop
# placement.ServerComponent with a fake stage server (no model, no hivemind) over a real Membership
# and PeerTable fed by hand: what a move announces, in which order, and a leave mid-move.

FAKE_PEERS = {  # peer id -> (stage, throughput); with ours (25 at stage 0) the plan moves us to 1
    "Qm" + "a" * 44: (0, 10.0),
    "Qm" + "b" * 44: (0, 10.0),
    "Qm" + "c" * 44: (2, 30.0),
    # stage 1 served, poorly: with it empty, a restart would not resume stage 0 at all
    "Qm" + "d" * 44: (1, 2.0),
}


class _FakeStore:
    def __init__(self) -> None:
        self.states: list[tuple[str, int | None]] = []
        self.published = asyncio.Event()

    async def publish(self, server: Any, rtt: Any, expiration: float) -> bool:
        if not self.states or self.states[-1] != (server.state, server.stage):
            self.states.append((server.state, server.stage))
        self.published.set()
        return True

    async def wait_published(self, state: str, stage: int) -> None:
        async with asyncio.timeout(10):
            while (state, stage) not in self.states:
                self.published.clear()
                await self.published.wait()

    async def read_membership(self) -> Any:
        raise AssertionError("the test feeds the peer table itself")


class _FakeStageServer:
    """Stands in for StageServer: starts online at 25 samples/s unless told to hang in loading."""

    built: ClassVar[list[_FakeStageServer]] = []
    move_built: ClassVar[asyncio.Event | None] = None  # set when the second server is built
    hang_at_stage: ClassVar[int | None] = None
    owner: ClassVar[Any] = None  # the ServerComponent, asked for its online server while loading

    def __init__(self, spec: Any, stage: int, config: Any, **kwargs: Any) -> None:
        self.stage, self.state, self.throughput, self.queue_len = stage, "joining", 0.0, 0
        self.events: list[str] = []
        self.online_while_loading: object = "unset"
        self.loading = asyncio.Event()
        _FakeStageServer.built.append(self)
        if len(_FakeStageServer.built) == 2 and _FakeStageServer.move_built is not None:
            _FakeStageServer.move_built.set()

    async def start(self, ctx: Any) -> None:
        ctx.membership.update(stage=self.stage, queue=0)
        self.online_while_loading = _FakeStageServer.owner.online_server()
        self.loading.set()
        if self.stage == _FakeStageServer.hang_at_stage:
            await asyncio.Event().wait()  # a download that never ends (until cancelled)
        self.state, self.throughput = "online", 25.0
        ctx.membership.update(throughput=self.throughput)

    async def drain(self, deadline: float) -> None:
        self.state = "draining"
        self.events.append("drain")

    async def close(self) -> None:
        self.state = "draining"
        self.events.append("close")

    def status(self) -> dict[str, Any]:
        return {"stage": self.stage, "state": self.state}


def _component_world(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **rebalance: Any
) -> tuple[Any, Any, _FakeStore]:
    from wanswarm.node.component import ComponentContext
    from wanswarm.node.config.node_config import load_config, parse_assignment
    from wanswarm.node.config.runspec import default_run_spec
    from wanswarm.node.membership.peers import PeerTable
    from wanswarm.node.membership.records import QuicAddress, ServerRecord
    from wanswarm.node.membership.tracker import Membership
    from wanswarm.node.stage import placement
    from wanswarm.transport.identity import Identity

    monkeypatch.setattr(placement, "StageServer", _FakeStageServer)
    monkeypatch.setattr(_FakeStageServer, "built", [])
    settings = {"period_s": 0.05, "jitter": 0.0, "load_s": 0.01, "min_gain": 0.05, **rebalance}
    assignments = [f"node.state_dir={tmp_path}", "node.join_backoff=0"]
    assignments += [f"rebalance.{k}={v}" for k, v in settings.items()]
    config = load_config(environ={}, overrides=[parse_assignment(a) for a in assignments])
    spec = default_run_spec()
    identity = Identity.generate()
    table = PeerTable(identity.peer_id)
    records = {
        pid: (ServerRecord(peer_id=pid, state="online", stage=stage, throughput=t,
                           quic=QuicAddress(host="127.0.0.1", port=10 + i),
                           run_id=spec.run_id), 4e9)
        for i, (pid, (stage, t)) in enumerate(FAKE_PEERS.items())
    }
    table.apply(records, {}, now=0.0, wall_now=0.0)
    store = _FakeStore()
    membership = Membership(store, config.node, identity.peer_id, table, random.Random(0))
    endpoint = SimpleNamespace(
        endpoint=SimpleNamespace(peer_id=identity.peer_id, address=("127.0.0.1", 9)),
        announced=QuicAddress(host="127.0.0.1", port=9),
    )
    component = placement.ServerComponent(
        spec, endpoint, random.Random(0),  # type: ignore[arg-type]
        config=config.stage_server, averaging=config.averaging, rebalance=config.rebalance,
        pinned_stage=config.node.stage, join_backoff=config.node.join_backoff,
    )
    monkeypatch.setattr(_FakeStageServer, "owner", component)
    tasks: list[asyncio.Task[Any]] = []

    def spawn(coro: Any, name: str) -> asyncio.Task[Any]:
        tasks.append(asyncio.get_running_loop().create_task(coro, name=name))
        return tasks[-1]

    ctx = ComponentContext(identity=identity, run="demo", state_dir=tmp_path, peers=table,
                           membership=membership, spawn=spawn, dht=None)  # type: ignore[arg-type]
    placement.write_stage_claim(tmp_path, spec.run_id, 0)  # resume at stage 0, no back-off
    return component, ctx, store


async def _wait(event: asyncio.Event) -> None:
    async with asyncio.timeout(10):
        await event.wait()


async def _start_online(component: Any, ctx: Any) -> None:
    """The daemon's part: start the component, then announce the node online."""
    _FakeStageServer.move_built = asyncio.Event()
    await component.start(ctx)
    ctx.membership.set_state("online")
    await ctx.membership.announce()


def test_daemon_moves_when_the_plan_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wanswarm.node.stage.placement import read_stage_claim
    from wanswarm.node.swarm_node import own_server_info

    component, ctx, store = _component_world(tmp_path, monkeypatch)

    async def scenario() -> None:
        await _start_online(component, ctx)
        assert ctx.membership.own_record().movable
        (old,) = _FakeStageServer.built
        assert old.stage == 0 and old.online_while_loading is None
        assert component.online_server() is old
        assert _FakeStageServer.move_built is not None
        await _wait(_FakeStageServer.move_built)
        new = _FakeStageServer.built[1]
        await _wait(new.loading)
        assert new.online_while_loading is None  # no server of ours between the stages
        # the move's last step: announce online (it counts the move before it waits again)
        await store.wait_published("online", 1)
        assert component.status()["moves"] == 1
        assert component.online_server() is new and new.state == "online"
        own = own_server_info(component.endpoint, component)
        assert own is not None and own[0] == 1 and own[1].port == 9 and own[1].state == "online"
        await component.drain(asyncio.get_running_loop().time() + 5)
        await component.close()
        assert old.events == ["drain", "close"]
        assert new.stage == 1 and new.events == ["drain", "close"]

    asyncio.run(scenario())
    status = component.status()
    assert status["moves"] == 1 and status["stage"] == 1
    move = status["last_move"]
    assert (move["from"], move["to"]) == (0, 1)
    assert move["bottleneck_before"] == 2.0 and move["bottleneck_after"] == 20.0
    assert move["total_s"] >= move["load_s"] >= 0.0
    assert resume_stage(read_stage_claim(tmp_path), component.spec.run_id, 3) == 1
    # published in order: joining at 0, online, draining at 0, joining at 1, online at 1
    assert store.states == [
        ("joining", 0), ("online", 0), ("draining", 0), ("joining", 1), ("online", 1)
    ]


def test_leave_during_a_move_closes_what_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wanswarm.node.swarm_node import own_server_info

    component, ctx, store = _component_world(tmp_path, monkeypatch)
    monkeypatch.setattr(_FakeStageServer, "hang_at_stage", 1)

    async def scenario() -> None:
        await _start_online(component, ctx)
        assert _FakeStageServer.move_built is not None
        await _wait(_FakeStageServer.move_built)
        old, new = _FakeStageServer.built
        await _wait(new.loading)  # loading stage 1 when the leave comes
        assert own_server_info(component.endpoint, component) is None  # nothing to route to
        ctx.membership.set_state("draining")  # the daemon's leave path, then its drain and close
        await component.drain(asyncio.get_running_loop().time() + 5)
        await component.close()
        assert ctx.membership.state == "draining"
        assert old.events == ["drain", "close"]
        assert new.events == ["close"]  # never served: closed without a drain

    asyncio.run(scenario())
    assert component.status()["moves"] == 0
    assert store.states[-1] == ("joining", 1)  # nothing announced after the leave began


def test_pinned_server_does_not_rebalance_unless_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wanswarm.node.config.node_config import load_config, parse_assignment

    component, _, _ = _component_world(tmp_path, monkeypatch)
    pinned = load_config(environ={}, overrides=[parse_assignment(f"node.state_dir={tmp_path}"),
                                                parse_assignment("node.stage=0")])
    component.pinned_stage, component.rebalance = pinned.node.stage, pinned.rebalance
    assert component.status()["rebalance"]["enabled"] is False
    component.rebalance = pinned.rebalance.model_copy(update={"move_pinned": True})
    assert component.status()["rebalance"]["enabled"] is True


def test_a_pinned_server_announces_that_it_does_not_move(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The others' plans must not name it (stage_selection.md): its record says so."""
    component, ctx, _ = _component_world(tmp_path, monkeypatch)
    component.pinned_stage = 1

    async def scenario() -> None:
        await _start_online(component, ctx)
        record = ctx.membership.own_record()
        assert record.stage == 1 and record.movable is False
        assert component.status()["rebalance"]["enabled"] is False
        await component.drain(asyncio.get_running_loop().time() + 5)
        await component.close()

    asyncio.run(scenario())


def test_a_restarted_server_keeps_its_stage_unless_the_swarm_filled_the_gap_it_left() -> None:
    own_old_record = ServerLoad("me", 1, 50.0, "online")  # still in the DHT after the crash
    # nobody took stage 1: resume it (our own stale record does not count as a server)
    alone = [ServerLoad("a", 0, 50.0, "online"), ServerLoad("b", 2, 50.0, "online"), own_old_record]
    assert keep_resumed_stage(alone, 3, 1, exclude_peer="me")
    # every stage served, ours too: resume (the state and checkpoint are ours)
    full = [*alone, ServerLoad("c", 1, 50.0, "online")]
    assert keep_resumed_stage(full, 3, 1, exclude_peer="me")
    # "c" moved from stage 2 to fill stage 1 and stage 2 is now empty: choose anew
    moved = [ServerLoad("a", 0, 50.0, "online"), ServerLoad("c", 1, 50.0, "joining"),
             own_old_record]
    assert not keep_resumed_stage(moved, 3, 1, exclude_peer="me")
    # an empty stage elsewhere but our stage has no other server: ours first
    assert keep_resumed_stage([ServerLoad("a", 0, 50.0, "online"), own_old_record], 3, 1,
                              exclude_peer="me")
