"""DiLoCo's outer payloads over real QUIC endpoints on loopback (outer_payloads.py).

hivemind's gather is stood in for by an in-process rendezvous (it hands every member the
descriptors all of them sent, as hivemind's does); the payloads cross real QUIC
connections between real endpoints. What is checked: payloads above the gather's
768 KiB cap arrive byte-exact at every member; a member serving other bytes than it
described, or one we cannot reach, makes the round missed (None), never a mean over fewer
members; a descriptor that is wrong on its face leaves its member out everywhere without a
fetch; a stranger, an unknown digest, a malformed request and a greedy member are refused.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
import torch
from wanswarm.node.stage.averaging import AveragingConfig
from wanswarm.node.stage.diloco import MAX_PAYLOAD_BYTES
from wanswarm.node.stage.outer_payloads import (
    SERVES_PER_MEMBER,
    PayloadLink,
    QuicOuterCarrier,
    check_descriptors,
    payload_kind,
    sha256_hex,
)
from wanswarm.transport.endpoint import Endpoint, PeerAddress, Request, Response
from wanswarm.transport.errors import RemoteError

from .quic_helpers import address, endpoint, run

STAGE = 1
RUN = "payloadtest_stage1_outer"
CONFIG = AveragingConfig(matchmaking_time=1.0, averaging_timeout=5.0, load_state_timeout=5.0)
SIZE = 2 * MAX_PAYLOAD_BYTES + 12_345  # beyond what the gather carries


class _Rendezvous:
    """hivemind's gather in one process: every member gets all members' data once all sent
    (``got``: the last round's; ``rounds`` keeps each round's apart)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rounds: dict[Any, dict[str, dict[str, Any]]] = {}
        self.lock = threading.Lock()

    @property
    def got(self) -> dict[str, dict[str, Any]]:
        return self.rounds[max(self.rounds)] if self.rounds else {}

    def inner(self, name: str, tamper: Callable[[dict[str, Any]], dict[str, Any]] | None = None
              ) -> _Inner:
        return _Inner(self, name, tamper)


class _Inner:
    def __init__(self, rv: _Rendezvous, name: str,
                 tamper: Callable[[dict[str, Any]], dict[str, Any]] | None) -> None:
        self.rv, self.name, self.tamper = rv, name, tamper
        self.sent: dict[str, Any] | None = None
        self.shut = False

    def start_gather(self, data: dict[str, Any], timeout: float) -> _Pending:
        self.sent = self.tamper(data) if self.tamper else data
        with self.rv.lock:
            self.rv.rounds.setdefault(data["round"], {})[self.name] = self.sent
        return _Pending(self.rv, data["round"])

    def newer_state(self, timeout: float) -> None:
        return None

    def set_priority(self, value: float) -> None:
        pass

    def shutdown(self) -> None:
        self.shut = True


class _Pending:
    def __init__(self, rv: _Rendezvous, round_: Any) -> None:
        self.rv, self.round = rv, round_

    def done(self) -> bool:
        with self.rv.lock:
            return len(self.rv.rounds[self.round]) == self.rv.n

    def result(self) -> dict[str, Any]:
        with self.rv.lock:
            return {k: dict(v) for k, v in self.rv.rounds[self.round].items()}


def _payload(seed: int, size: int = SIZE) -> bytes:
    return torch.randint(0, 256, (size,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


def _data(payload: bytes, round_: int = 3, anchor: str = "a" * 16) -> dict[str, Any]:
    return {"round": round_, "anchor": anchor, "weight": 16.0, "payload": payload}


async def _carriers(stack: AsyncExitStack, rv: _Rendezvous, n: int, *,
                    tampers: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] | None = None,
                    book: Callable[[list[PeerAddress]], list[PeerAddress]] = lambda a: a,
                    config: AveragingConfig = CONFIG,
                    ) -> tuple[list[Endpoint], list[QuicOuterCarrier]]:
    eps = [await stack.enter_async_context(endpoint()) for _ in range(n)]
    addresses = [address(ep) for ep in eps]
    loop = asyncio.get_running_loop()
    carriers = []
    for i, ep in enumerate(eps):
        link = PayloadLink(ep, loop, lambda: book(addresses))
        inner = rv.inner(f"hm{i}", (tampers or {}).get(i))
        carrier = QuicOuterCarrier(inner, link, STAGE, RUN, config, round_timeout=10.0)
        stack.callback(carrier.shutdown)
        carriers.append(carrier)
    return eps, carriers


async def _gather_all(carriers: list[QuicOuterCarrier], payloads: list[bytes],
                      timeout: float = 30.0, round_: int = 3) -> list[dict[str, Any] | None]:
    pendings = [c.start_gather(_data(p, round_), 10.0)
                for c, p in zip(carriers, payloads, strict=True)]
    async with asyncio.timeout(timeout):
        while not all(p.done() for p in pendings):
            await asyncio.sleep(0.02)
    return [p.result() for p in pendings]


def test_members_fetch_in_one_rotation_so_no_uplink_serves_everyone_at_once() -> None:
    """With ``outer_fetches_at_once = 1`` each of four members fetches one payload at a time,
    in the order every member derives from the descriptors: the member at position i (by
    transport id) fetches from i + 1, i + 2, i + 3."""
    one_at_a_time = CONFIG.model_copy(update={"outer_fetches_at_once": 1})

    async def main() -> None:
        async with AsyncExitStack() as stack:
            rv = _Rendezvous(4)
            eps, carriers = await _carriers(stack, rv, 4, config=one_at_a_time)
            order: dict[str, list[str]] = {ep.peer_id: [] for ep in eps}
            in_flight: dict[str, int] = dict.fromkeys(order, 0)
            most: dict[str, int] = dict.fromkeys(order, 0)
            for ep in eps:
                sent = ep.request

                async def request(peer: PeerAddress, *args: Any, _me: str = ep.peer_id,
                                  _sent: Any = sent, **kwargs: Any) -> Response:
                    order[_me].append(peer.peer_id)
                    in_flight[_me] += 1
                    most[_me] = max(most[_me], in_flight[_me])
                    try:
                        return await _sent(peer, *args, **kwargs)  # type: ignore[no-any-return]
                    finally:
                        in_flight[_me] -= 1

                ep.request = request  # type: ignore[method-assign]
            payloads = [_payload(i, 200_000) for i in range(4)]
            results = await _gather_all(carriers, payloads)
            assert all(r is not None and len(r) == 4 for r in results)
            ids = sorted(order)
            for me, targets in order.items():
                i = ids.index(me)
                assert targets == [ids[(i + k) % 4] for k in (1, 2, 3)], (me, targets)
                assert most[me] == 1

    run(main())


def test_payloads_beyond_the_gather_cap_arrive_exact_at_every_member() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            rv = _Rendezvous(3)
            eps, carriers = await _carriers(stack, rv, 3)
            payloads = [_payload(i) for i in range(3)]
            results = await _gather_all(carriers, payloads)
            for carrier, result in zip(carriers, results, strict=True):
                assert result is not None
                assert set(result) == {"hm0", "hm1", "hm2"}
                for i in range(3):
                    got = result[f"hm{i}"]
                    assert got["payload"] == payloads[i]
                    assert got["round"] == 3 and got["weight"] == 16.0
                    assert got["transport_id"] == eps[i].peer_id
                assert carrier.counts["fetched"] == 2
                assert carrier.counts["fetched_bytes"] == 2 * SIZE
                assert carrier.server.counts["served"] == 2
            # what went through the gather: a descriptor, never the bytes
            for name, sent in rv.got.items():
                assert "payload" not in sent and sent["payload_len"] == SIZE, name
                assert sent["payload_sha256"] == sha256_hex(payloads[int(name[2:])])

    run(main(), timeout=90)


def test_a_member_serving_other_bytes_makes_the_round_missed() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            rv = _Rendezvous(2)
            eps, carriers = await _carriers(stack, rv, 2)

            async def forged(request: Request) -> Response:  # right length, other bytes
                return Response(header={"v": 1, "nbytes": SIZE},
                                tensors=[torch.zeros(SIZE, dtype=torch.uint8)])

            eps[1].register(payload_kind(STAGE), forged, max_bytes=0)
            results = await _gather_all(carriers, [_payload(0), _payload(1)])
            assert results[0] is None  # never a mean without the member the others used
            assert carriers[0].counts["fetch_failed.digest"] == 1
            assert carriers[0].counts["fetched"] == 0 and not carriers[0].counts["fetch_retried"]

    run(main(), timeout=90)


def test_a_fetch_refused_busy_is_tried_once_more() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            rv = _Rendezvous(2)
            eps, carriers = await _carriers(stack, rv, 2)
            refused = []

            async def busy_once(request: Request) -> Response:
                if not refused:
                    refused.append(request.peer_id)
                    raise RemoteError("busy", "the inbound budget is full")
                return await carriers[1].server.handle(request)

            eps[1].register(payload_kind(STAGE), busy_once, max_bytes=0)
            payloads = [_payload(0), _payload(1)]
            results = await _gather_all(carriers, payloads)
            assert results[0] is not None and results[0]["hm1"]["payload"] == payloads[1]
            assert refused == [eps[0].peer_id]
            assert carriers[0].counts["fetch_retried"] == 1
            assert carriers[0].counts["fetched"] == 1

    run(main(), timeout=90)


def test_a_member_we_cannot_find_or_that_withholds_makes_the_round_missed() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            rv = _Rendezvous(2)
            # member 1 is not among the stage's servers member 0 knows of
            _, carriers = await _carriers(stack, rv, 2, book=lambda a: a[:1])
            results = await _gather_all(carriers, [_payload(0, 1000), _payload(1, 1000)])
            assert results[0] is None and results[1] is not None
            assert carriers[0].counts["fetch_failed.unknown_member"] == 1

            # a member that describes bytes it does not hold: refused, round missed
            rv2 = _Rendezvous(2)
            other = _payload(9, 1000)
            lie = {1: lambda d: {**d, "payload_sha256": sha256_hex(other)}}
            _, liars = await _carriers(stack, rv2, 2, tampers=lie)
            results = await _gather_all(liars, [_payload(0, 1000), _payload(1, 1000)])
            assert results[0] is None
            assert liars[0].counts["fetch_failed.unknown_payload"] == 1

    run(main(), timeout=90)


def test_a_member_that_withholds_is_left_out_from_the_next_round_on() -> None:
    """Member 2 describes its payload but serves it to nobody: the first round is missed by
    every member; from the next, members 0 and 1 name it in their descriptors, it is left
    out everywhere alike, and they average without it; it misses its rounds alone."""

    async def main() -> None:
        async with AsyncExitStack() as stack:
            rv = _Rendezvous(3)
            eps, carriers = await _carriers(stack, rv, 3)

            async def withhold(request: Request) -> Response:
                raise RemoteError("busy", "not now")

            eps[2].register(payload_kind(STAGE), withhold, max_bytes=0)
            payloads = [_payload(i, 4000) for i in range(3)]
            first = await _gather_all(carriers, payloads, round_=1)
            assert first[0] is None and first[1] is None
            assert rv.rounds[1]["hm0"]["accuses"] == []
            second = await _gather_all(carriers, payloads, round_=2)
            for result in second[:2]:
                assert result is not None
                assert result["hm0"]["payload"] == payloads[0]
                assert result["hm1"]["payload"] == payloads[1]
                assert "payload" not in result["hm2"]  # diloco leaves it out
            assert second[2] is None
            assert rv.rounds[2]["hm0"]["accuses"] == [eps[2].peer_id]
            assert carriers[0].counts["left_out_accused"] == 1
            assert carriers[2].counts["left_out_accused_self"] == 1

    run(main(), timeout=90)


def test_a_descriptor_wrong_on_its_face_is_left_out_everywhere_without_a_fetch() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            rv = _Rendezvous(3)
            short = {2: lambda d: {**d, "payload_len": d["payload_len"] - 1}}
            _, carriers = await _carriers(stack, rv, 3, tampers=short)
            payloads = [_payload(i, 5000) for i in range(3)]
            results = await _gather_all(carriers, payloads)
            for result in results[:2]:
                assert result is not None
                assert result["hm0"]["payload"] == payloads[0]
                assert result["hm1"]["payload"] == payloads[1]
                assert "payload" not in result["hm2"]  # diloco leaves it out as malformed
            assert carriers[0].counts["fetched"] == 1 and carriers[1].counts["fetched"] == 1
            assert carriers[2].server.counts["served"] == 0

    run(main(), timeout=90)


def test_strangers_unknown_digests_bad_requests_and_greedy_members_are_refused() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            rv = _Rendezvous(2)
            eps, carriers = await _carriers(stack, rv, 2)
            payloads = [_payload(0, 3000), _payload(1, 3000)]
            results = await _gather_all(carriers, payloads)
            assert all(r is not None for r in results)
            kind = payload_kind(STAGE)
            digest = sha256_hex(payloads[0])
            server = address(eps[0])
            stranger = await stack.enter_async_context(endpoint())

            async def ask(ep: Endpoint, header: dict[str, Any], *tensors: torch.Tensor) -> str:
                try:
                    await ep.request(server, kind, header, list(tensors), timeout=10.0)
                except RemoteError as exc:
                    return exc.code
                return "served"

            good = {"v": 1, "run": RUN, "sha256": digest}
            assert await ask(stranger, good) == "not_member"
            assert await ask(eps[1], {**good, "sha256": "0" * 64}) == "unknown_payload"
            assert await ask(eps[1], {**good, "run": "another_run"}) == "unknown_payload"
            assert await ask(eps[1], {**good, "sha256": "xyz"}) == "bad_request"
            assert await ask(eps[1], {**good, "extra": 1}) == "bad_request"
            # the member fetched it once in the round: one more, then refused
            assert SERVES_PER_MEMBER == 2
            assert await ask(eps[1], good) == "served"
            assert await ask(eps[1], good) == "busy"
            counts = carriers[0].server.counts
            assert counts["errors.not_member"] == 1 and counts["errors.busy"] == 1
            assert counts["errors.bad_request"] == 2 and counts["errors.unknown_payload"] == 2

            # once shut down, the kind is no longer served
            carriers[0].shutdown()
            assert await ask(eps[1], good) not in ("served", "busy")

    run(main(), timeout=90)


def test_an_offer_older_than_the_last_two_is_gone() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            eps, carriers = await _carriers(stack, _Rendezvous(1), 1)
            server = carriers[0].server
            offers = [server.offer(RUN, _payload(i, 100)) for i in range(3)]
            assert offers[0].known.is_set()  # a request waiting on it stops waiting
            held = [o.sha256 for o in server._offers]
            assert held == [offers[1].sha256, offers[2].sha256]
            # the same bytes offered again (a retried round) replace, not duplicate
            again = server.offer(RUN, _payload(2, 100))
            assert [o.sha256 for o in server._offers] == held and again is server._offers[-1]

    run(main(), timeout=30)


def test_descriptors_are_judged_from_the_gathered_data_alone() -> None:
    ours = {"round": 3, "anchor": "a" * 16, "payload_len": 10, "payload_sha256": "0" * 64,
            "transport_id": "me"}
    ok = dict(ours, transport_id="p1")
    gathered: dict[str, Any] = {
        "me": ours, "p1": ok,
        "late": dict(ok, transport_id="p2", round=2),
        "other_anchor": dict(ok, transport_id="p3", anchor="b" * 16),
        "long": dict(ok, transport_id="p4", payload_len=11),
        "bool_len": dict(ok, transport_id="p5", payload_len=True),
        "bad_sha": dict(ok, transport_id="p6", payload_sha256="Z" * 64),
        "dup_a": dict(ok, transport_id="twin"), "dup_b": dict(ok, transport_id="twin"),
        "no_id": {k: v for k, v in ok.items() if k != "transport_id"},
        "huge_id": dict(ok, transport_id="x" * 129),
        "not_a_dict": [1, 2],
    }
    assert sorted(check_descriptors(gathered, ours, 10)) == ["me", "p1"]

    # accusations: more than half of the other kept members must name a member
    def member(tid: str, accuses: Any = None) -> dict[str, Any]:
        d = dict(ours, transport_id=tid)
        if accuses is not None:
            d["accuses"] = accuses
        return d

    honest = {t: member(t, ["x"]) for t in ("a", "b", "c")}
    group = {**honest, "x": member("x", ["a", "b"])}
    assert sorted(check_descriptors(group, ours, 10)) == ["a", "b", "c"]  # 3 of 3 name x
    # two of four others naming x is not more than half: kept
    group = {"a": member("a", ["x"]), "b": member("b", ["x"]), "c": member("c", []),
             "d": member("d"), "x": member("x", ["a"])}
    assert sorted(check_descriptors(group, ours, 10)) == ["a", "b", "c", "d", "x"]
    # a liar naming everyone has one vote, and naming itself counts for nothing
    group = {"a": member("a"), "b": member("b"), "x": member("x", ["a", "b", "x"])}
    assert sorted(check_descriptors(group, ours, 10)) == ["a", "b", "x"]
    # malformed accusations leave the describing member out, as any malformed descriptor
    for bad in ("x", ["x"] * 17, [1], [""], ["y" * 129]):
        group = {"a": member("a"), "b": member("b", bad)}
        assert sorted(check_descriptors(group, ours, 10)) == ["a"], bad
    # in a pair, one naming the other leaves the other out; naming each other, both
    assert sorted(check_descriptors({"a": member("a", ["b"]), "b": member("b")}, ours, 10)) \
        == ["a"]
    assert check_descriptors({"a": member("a", ["b"]), "b": member("b", ["a"])}, ours, 10) == {}


def test_the_daemon_link_caps_payloads_at_the_transport_message_limit() -> None:
    async def main() -> None:
        async with endpoint() as ep:
            link = PayloadLink(ep, asyncio.get_running_loop(), list)
            assert link.max_payload_bytes == ep.config.limits.max_message_bytes
            assert link.max_payload_bytes > 1000 * MAX_PAYLOAD_BYTES

    run(main(), timeout=30)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
