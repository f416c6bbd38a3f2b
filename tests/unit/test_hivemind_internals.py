"""The private parts of hivemind that wanswarm.node relies on are still there.

node/stage/progress_guard.py screens the progress records hivemind's ProgressTracker reads
by replacing the tracker's ``_parse_swarm_progress_data`` on the live object and re-parsing
under its lock. hivemind has no public hook for this, and pyproject.toml pins
hivemind==1.1.12; each check names the attribute so that an upgrade that moves one fails
here with a clear message. No DHT is started: the checks read the classes.
"""

from __future__ import annotations

import inspect
from typing import Any

import hivemind
import pytest
from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.utils.timed_storage import ValueWithExpiration

USED_BY = "node/stage/progress_guard.py"


def test_pinned_version() -> None:
    assert hivemind.__version__ == "1.1.12", f"{USED_BY} was checked against hivemind 1.1.12"


def test_tracker_parser_and_state() -> None:
    parse = getattr(ProgressTracker, "_parse_swarm_progress_data", None)
    assert parse is not None, f"{USED_BY}: ProgressTracker._parse_swarm_progress_data is gone"
    assert list(inspect.signature(parse).parameters) == ["self", "metadata"]
    source = inspect.getsource(ProgressTracker)
    # the fetcher calls the parser through the instance (so an instance attribute replaces it)
    assert "self.global_progress = self._parse_swarm_progress_data(metadata)" in source
    for attr in ("lock_global_progress", "local_progress", "training_progress_key", "dht"):
        assert f"self.{attr}" in source, f"{USED_BY}: ProgressTracker.{attr} is gone"


def test_progress_record_fields() -> None:
    fields = set(LocalTrainingProgress.__fields__)
    assert fields == {
        "peer_id", "epoch", "samples_accumulated", "samples_per_second", "time", "client_mode"
    }, f"{USED_BY} screens these fields of a progress record"
    assert "value" in ValueWithExpiration.__dataclass_fields__


class _DroppingProcess:
    """A DHT process that answers every request with ``outcome`` as its exception, after
    ``delay_s`` from another thread (as hivemind's MPFuture is settled), or at once."""

    def __init__(self, outcome: BaseException, delay_s: float) -> None:
        self.outcome, self.delay_s = outcome, delay_s

    def is_alive(self) -> bool:
        return True

    def run_coroutine(self, fn: object, return_future: bool) -> Any:
        import concurrent.futures
        import threading

        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def settle() -> None:
            if future.set_running_or_notify_cancel():  # not if the caller gave up
                future.set_exception(self.outcome)

        if self.delay_s == 0:
            settle()
        else:
            threading.Timer(self.delay_s, settle).start()
        return future


@pytest.mark.parametrize("delay_s", [0.0, 0.05], ids=["settled", "settled-while-awaited"])
def test_a_request_the_dht_process_dropped_is_a_dht_error_not_the_callers_end(
    delay_s: float,
) -> None:
    """hivemind's DHT process may garbage-collect the task that runs a request; the
    GeneratorExit thrown into it comes back as the request's outcome. Raised by an await
    while the task waits, a GeneratorExit goes past every except of the coroutines in
    between: CPython closes them and raises it in the task's outermost coroutine (it ended
    a daemon's housekeeping twice). Dht._call reads the outcome instead of awaiting it: a
    DhtError, and the callers' coroutines go on."""
    import asyncio

    from wanswarm.node.errors import DhtError
    from wanswarm.node.membership.dht import Dht

    dht = Dht.__new__(Dht)
    dht._process = _DroppingProcess(GeneratorExit(), delay_s)  # type: ignore[assignment]
    steps: list[str] = []

    async def caller() -> None:
        try:
            await dht._call(lambda *_: None, 5.0, "reading our addresses")
        except DhtError as exc:
            steps.append(str(exc))

    async def housekeeping() -> None:  # the task's own coroutine, a caller further up
        await caller()
        steps.append("went on")

    asyncio.run(asyncio.wait_for(housekeeping(), 5.0))
    assert len(steps) == 2 and "dropped the request" in steps[0], steps
    assert steps[1] == "went on"


def test_a_dht_request_settled_with_an_error_or_too_late_is_a_dht_error() -> None:
    import asyncio

    from wanswarm.node.errors import DhtError, DhtTimeout
    from wanswarm.node.membership.dht import Dht

    dht = Dht.__new__(Dht)

    async def outcome(process: Any, timeout: float) -> str:
        dht._process = process
        try:
            await dht._call(lambda *_: None, timeout, "storing")
        except DhtError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    failed = asyncio.run(outcome(_DroppingProcess(KeyError("x"), 0.05), 5.0))
    assert failed.startswith("DhtError: storing failed: KeyError"), failed
    late = asyncio.run(outcome(_DroppingProcess(KeyError("x"), 2.0), 0.1))
    assert late.startswith(DhtTimeout.__name__) and "longer than 0.1s" in late, late


def test_tracker_run_and_factory_used_by_the_dht_adapter() -> None:
    """node/membership/dht.py replaces ProgressTracker.run (to close its event loop) and
    builds the tracker through Optimizer._make_progress_tracker: both must be as copied."""
    where = "node/membership/dht.py"
    run = inspect.getsource(ProgressTracker.run)
    assert "loop = asyncio.new_event_loop()" in run, f"{where}: ProgressTracker.run changed"
    assert "asyncio.gather(self._progress_reporter(), self._progress_fetcher())" in run, where
    assert "self.shutdown_complete.set()" in run, where
    make = getattr(hivemind.Optimizer, "_make_progress_tracker", None)
    assert make is not None, f"{where}: Optimizer._make_progress_tracker is gone"
    assert list(inspect.signature(make).parameters) == ["self", "target_batch_size", "kwargs"]
    source = inspect.getsource(make)
    for arg in ("dht=self.dht", "prefix=self.run_id", "client_mode=self.client_mode",
                "status_loglevel=self.status_loglevel", "start=True"):
        assert arg in source, f"{where}: Optimizer._make_progress_tracker no longer passes {arg}"


def test_what_the_progress_channel_uses_of_hivemind() -> None:
    """node/stage/progress_channel.py replicates the DHT's p2pd client, registers a binary
    stream handler and opens streams through the daemon's control protocol itself."""
    from hivemind.dht import DHT
    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings import control, p2pclient, utils
    from hivemind.proto import p2pd_pb2

    where = "node/stage/progress_channel.py"
    assert callable(getattr(DHT, "_get_p2p_daemon_listen_maddr", None)), where
    assert callable(getattr(DHT, "run_coroutine", None)), where
    for name in ("replicate", "add_binary_stream_handler", "remove_binary_stream_handler"):
        assert callable(getattr(P2P, name, None)), f"{where}: P2P.{name} is gone"
    assert "self._client" in inspect.getsource(P2P), f"{where}: P2P._client is gone"
    assert "control: ControlClient" in inspect.getsource(p2pclient.Client), where
    assert "self.daemon_connector" in inspect.getsource(control.ControlClient), where
    for name in ("raise_if_failed", "read_pbmsg_safe", "write_pbmsg"):
        assert callable(getattr(utils, name, None)), f"{where}: {name} is gone"
    request = p2pd_pb2.Request(
        type=p2pd_pb2.Request.STREAM_OPEN,
        streamOpen=p2pd_pb2.StreamOpenRequest(peer=b"x", proto=["p"]),
    )
    assert request.streamOpen.proto == ["p"]
    # how hivemind's own stream open reads the reply (ours is the same, plus the close)
    source = inspect.getsource(control.ControlClient.stream_open)
    assert "raise_if_failed(resp)" in source and "STREAM_OPEN" in source, where


def test_the_local_gradient_fallback_the_optimizer_counts() -> None:
    """node/stage/averaging.py counts the steps hivemind takes on a replica's own gradients
    by wrapping ``Optimizer._load_local_gradients_into_optimizer`` on the instance."""
    where = "node/stage/averaging.py"
    fallback = getattr(hivemind.Optimizer, "_load_local_gradients_into_optimizer", None)
    assert callable(fallback), f"{where}: Optimizer._load_local_gradients_into_optimizer is gone"
    source = inspect.getsource(hivemind.Optimizer._average_gradients_and_load_into_optimizer)
    assert "self._load_local_gradients_into_optimizer()" in source, where


def test_a_dropped_address_request_does_not_end_the_daemons_housekeeping() -> None:
    """The daemon's address refresh, whose DHT request hivemind dropped while it waited,
    logs a warning and keeps its addresses; the coroutine that called it goes on."""
    import asyncio

    from wanswarm.node.daemon import Daemon
    from wanswarm.node.membership.dht import Dht

    dht = Dht.__new__(Dht)
    dht._process = _DroppingProcess(GeneratorExit(), 0.05)  # type: ignore[assignment]
    dht.config = type("Config", (), {"rpc_timeout": 5.0})()  # type: ignore[assignment]
    daemon = Daemon.__new__(Daemon)
    daemon.dht = dht
    daemon.dht_addrs = ["/ip4/192.0.2.1/tcp/1/p2p/x"]

    async def main() -> list[str]:
        await daemon._refresh_addrs()
        await asyncio.sleep(0)  # the coroutine goes on after it
        return daemon.dht_addrs

    assert asyncio.run(asyncio.wait_for(main(), 5.0)) == ["/ip4/192.0.2.1/tcp/1/p2p/x"]


def test_connect_list_peers_and_ping_used_by_the_address_book() -> None:
    """node/membership/dht.py dials remembered peers through the DHT's P2P client (connect,
    then a DHT ping that puts both sides in each other's routing table, then a lookup of our
    own id) and lists the connected peers' addresses (address_book.py)."""
    from hivemind.dht import DHTNode
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings import p2pclient
    from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerInfo

    where = "node/membership/dht.py (_in_dht_dial, _in_dht_connected_peers)"
    assert list(inspect.signature(p2pclient.Client.connect).parameters) == [
        "self", "peer_id", "maddrs"], f"{where}: Client.connect changed"
    assert "self._client.list_peers()" in inspect.getsource(P2P.list_peers), where
    assert {"peer_id", "addrs"} <= set(inspect.signature(PeerInfo).parameters), where
    ping = inspect.getsource(DHTProtocol.call_ping)
    assert "update_routing_table" in ping, f"{where}: call_ping no longer updates the table"
    assert "update_routing_table" in inspect.getsource(DHTProtocol.rpc_ping), where
    assert "queries" in inspect.signature(DHTNode.find_nearest_nodes).parameters, where


def test_the_dht_loop_that_the_request_pipe_wraps() -> None:
    """node/membership/dht.py's _RequestPipe replaces ``DHT._inner_pipe`` in the DHT process:
    hivemind's loop must still read requests through it as (method, args, kwargs), run
    ``getattr(self, method)`` and sleep after the errors it cannot read past."""
    from hivemind.dht import DHT

    where = "node/membership/dht.py (_RequestPipe)"
    source = inspect.getsource(DHT.run)
    assert "loop.add_reader(self._inner_pipe.fileno()" in source, where
    assert "if not self._inner_pipe.poll():" in source, where
    assert "method, args, kwargs = self._inner_pipe.recv()" in source, where
    assert "except (OSError, ConnectionError, RuntimeError) as e:" in source, where
    assert "asyncio.create_task(getattr(self, method)(*args, **kwargs))" in source, where


def test_the_loops_that_hivemind_loops_patches() -> None:
    """node/membership/hivemind_loops.py replaces ``switch_to_uvloop`` in the modules whose
    processes make their loop with it: the DHT's and the averagers'. ``MPFuture`` must still
    hold its pending futures by weak reference only (the reason for the patch)."""
    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.dht import DHT
    from hivemind.utils.mpfuture import MPFuture

    where = "node/membership/hivemind_loops.py"
    for run in (DHT.run, DecentralizedAverager._run_internal):
        assert "loop = switch_to_uvloop()" in inspect.getsource(run), where
    weakly = "MPFuture._active_futures[self._uid] = ref(self)"
    assert weakly in inspect.getsource(MPFuture.__init__), where
    # the late outcome a kept task may fail with, logged at debug (TaskKeeper._done)
    refusal = 'raise InvalidStateError(f"Can\'t set_result to a future that is {self._state}'
    assert refusal in inspect.getsource(MPFuture.set_result), where
    assert "step.set_result(" in inspect.getsource(DecentralizedAverager._step), where


def test_the_request_runner_that_the_dht_process_replaces() -> None:
    """node/membership/dht.py's _DhtProcess._run_coroutine replaces hivemind's: requests
    reach it by that name with (coro, future), and hivemind's runs ``coro(self, node)``."""
    from hivemind.dht import DHT

    where = "node/membership/dht.py (_DhtProcess._run_coroutine)"
    assert list(inspect.signature(DHT._run_coroutine).parameters) == ["self", "coro", "future"]
    assert '("_run_coroutine", [], dict(coro=coro, future=future))' in inspect.getsource(
        DHT.run_coroutine
    ), where
    assert "await coro(self, self._node)" in inspect.getsource(DHT._run_coroutine), where


def test_the_matchmaking_size_that_a_carrier_sets_per_round() -> None:
    """node/stage/averager_carrier.py sets ``Matchmaking.target_group_size`` in the averager's
    process at the start of every ``_step`` (keywords only); hivemind must read it there, at
    a join and when refusing one, and nowhere that keeps a copy (GroupKeyManager keeps its
    own, which the carrier leaves alone)."""
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.matchmaking import Matchmaking

    where = "node/stage/averager_carrier.py"
    step = inspect.signature(DecentralizedAverager._step).parameters
    assert list(step) == ["self", "step", "future_for_init"], where
    assert all(p.kind is p.KEYWORD_ONLY for n, p in step.items() if n != "self"), where
    assert "self._matchmaking = Matchmaking(" in inspect.getsource(
        DecentralizedAverager._run_internal), where
    source = inspect.getsource(Matchmaking)
    # set once; read at a join and in refusing one (each: "is not None", then the size)
    assert source.count("self.target_group_size") == 5, where
    assert "len(self.current_followers) + 1 >= self.target_group_size" in source, where
