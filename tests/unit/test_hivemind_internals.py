"""The private parts of hivemind that wanswarm.node relies on are still there.

node/stage/progress_guard.py screens the progress records hivemind's ProgressTracker reads
by replacing the tracker's ``_parse_swarm_progress_data`` on the live object and re-parsing
under its lock. hivemind has no public hook for this, and pyproject.toml pins
hivemind==1.1.12; each check names the attribute so that an upgrade that moves one fails
here with a clear message. No DHT is started: the checks read the classes.
"""

from __future__ import annotations

import inspect

import hivemind
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


def test_a_request_the_dht_process_dropped_is_a_dht_error_not_the_callers_end() -> None:
    """hivemind's DHT process may garbage-collect the task that runs a request; the
    GeneratorExit thrown into it comes back as the request's outcome (it ended a daemon's
    housekeeping once). Dht._call turns it into DhtError."""
    import asyncio
    import concurrent.futures

    from wanswarm.node.errors import DhtError
    from wanswarm.node.membership.dht import Dht

    class DroppingProcess:
        def is_alive(self) -> bool:
            return True

        def run_coroutine(self, fn: object, return_future: bool) -> concurrent.futures.Future:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_exception(GeneratorExit())
            return future

    dht = Dht.__new__(Dht)
    dht._process = DroppingProcess()  # type: ignore[assignment]

    async def main() -> str:
        try:
            await dht._call(lambda *_: None, 5.0, "reading our addresses")
        except DhtError as exc:
            return str(exc)
        return "no error"

    assert "dropped the request" in asyncio.run(main())


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
    """A GeneratorExit that still comes out of the DHT adapter (hivemind's dropped request)
    leaves the daemon's address refresh with a warning, its addresses as they were."""
    import asyncio

    from wanswarm.node.daemon import Daemon

    class DroppingDht:
        async def visible_maddrs(self) -> list[str]:
            raise GeneratorExit

    daemon = Daemon.__new__(Daemon)
    daemon.dht = DroppingDht()  # type: ignore[assignment]
    daemon.dht_addrs = ["/ip4/192.0.2.1/tcp/1/p2p/x"]

    async def main() -> list[str]:
        await daemon._refresh_addrs()
        await asyncio.sleep(0)  # the coroutine goes on after it
        return daemon.dht_addrs

    assert asyncio.run(main()) == ["/ip4/192.0.2.1/tcp/1/p2p/x"]


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
