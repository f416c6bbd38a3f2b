"""The hivemind DHT adapter: typed records in, typed records out (the only hivemind.dht
importer).

The hivemind DHT object stays inside this module: the daemon uses :class:`Dht`'s typed methods
and the averaging adapter asks it for a ``hivemind.Optimizer`` on the node's DHT
(:meth:`Dht.hivemind_optimizer`).

hivemind runs its DHT node in a forked process (plus a p2pd daemon) and talks to it through a
pipe; every call here sends one coroutine to that process
(``run_coroutine(..., return_future=True)``) and awaits its MPFuture with a deadline from
config. Deadlines are also applied inside the DHT process, so an abandoned call does not keep
working there. hivemind's exceptions become :class:`~wanswarm.node.errors.DhtError`.

Ownership and schema (ARCHITECTURE §3) are enforced by :class:`OwnedRecordValidator`, a hivemind
``RecordValidatorBase``: for the run's keys, a sub-key must be a peer id and its value must carry
an Ed25519 signature by that peer id's key over (key id, sub-key, value, expiration), and the
value must parse as the key's record type. So the owner of a record *is* its peer id, with the
same key as the DHT and QUIC identity (transport/identity.py). We chose this over hivemind's
RSASignatureValidator because that one needs a second (RSA) key pair whose public key is pasted
into every sub-key, which ties nothing to the peer id other peers dial; ours needs no extra key
and a peer id cannot be claimed without its private key. Every DHT node of the swarm runs the
validator, so a forged or malformed store is refused where it would be stored, and a dictionary
returned by a node that does not validate (e.g. a raw hivemind peer) is dropped as a whole by
hivemind when any of its entries fails, as if that node had not answered; honest replicas still
answer. The adapter parses again on the way out and drops (and counts) what does not match.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import multiprocessing.sharedctypes
import os
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import InvalidStateError
from functools import cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hivemind.dht import DHT, DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.utils.logging import use_hivemind_log_handler

from ...transport.identity import Identity, verify_signature
from ..config.sections import DhtConfig
from ..errors import (
    DhtError,
    DhtTimeout,
    JoinError,
    NodeError,
    ProbeError,
    RecordError,
    UnsupportedRecordVersion,
)
from ..logs import get_logger
from . import hivemind_loops
from .records import (
    MembershipRead,
    RttRecord,
    ServerRecord,
    decode_record,
    encode_record,
    rtt_key,
    seal,
    servers_key,
    signing_message,
    unseal,
)

if TYPE_CHECKING:
    from hivemind import Optimizer

log = get_logger(__name__)
T = TypeVar("T")

_SERIALIZER = DHTProtocol.serializer
# judged records remembered by the validator (a few hundred bytes each)
_VERDICT_CACHE_ENTRIES = 4096


def route_hivemind_logs() -> None:
    """Send hivemind's log records to the root logger (our format) instead of its own handler."""
    use_hivemind_log_handler("nowhere")


class OwnedRecordValidator(RecordValidatorBase):
    """Signed, owned, schema-checked sub-keys for ``{run}.servers`` and ``{run}.rtt``.

    Other keys pass untouched: the DHT is shared with hivemind's averaging, whose keys carry
    their own validation.
    """

    def __init__(self, run: str, identity: Identity) -> None:
        self._kinds: dict[bytes, type[ServerRecord] | type[RttRecord]] = {
            DHTID.generate(source=servers_key(run)).to_bytes(): ServerRecord,
            DHTID.generate(source=rtt_key(run)).to_bytes(): RttRecord,
        }
        self._identity = identity
        self._own_subkey = _SERIALIZER.dumps(identity.peer_id)
        self._verdicts: OrderedDict[tuple[bytes, bytes, bytes, float], str | None] = OrderedDict()
        # counted in the DHT process (one thread), read by the daemon: shared memory across the fork
        self._rejected = multiprocessing.sharedctypes.RawValue(ctypes.c_uint64, 0)

    @property
    def rejected(self) -> int:
        """Records refused so far (stores and lookup answers), in the DHT process."""
        return int(self._rejected.value)

    def validate(self, record: DHTRecord) -> bool:
        kind = self._kinds.get(record.key)
        if kind is None:
            return True
        # The same signed record comes back in every lookup answer (several per lookup, a
        # lookup every membership period per peer) until its owner re-announces it: judging
        # it once saves an Ed25519 verification per sighting (a fifth of the DHT process's
        # CPU in a 6-daemon demo). The cache key is the whole record, signature included.
        memo_key = (record.key, record.subkey, record.value, record.expiration_time)
        if memo_key in self._verdicts:
            self._verdicts.move_to_end(memo_key)
            reason = self._verdicts[memo_key]
        else:
            reason = self._problem(kind, record)
            self._verdicts[memo_key] = reason
            if len(self._verdicts) > _VERDICT_CACHE_ENTRIES:
                self._verdicts.popitem(last=False)
        if reason is not None:
            self._rejected.value += 1
            log.debug("refused a %s record: %s", kind.__name__, reason)
            return False
        return True

    def _problem(self, kind: type[ServerRecord] | type[RttRecord], record: DHTRecord) -> str | None:
        if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
            return "stored without a sub-key"
        try:
            owner = _SERIALIZER.loads(record.subkey)
        except Exception as exc:  # untrusted bytes: msgpack may raise anything
            return f"sub-key is not msgpack ({type(exc).__name__})"
        if not isinstance(owner, str):
            return f"sub-key is {type(owner).__name__}, not a peer id"
        try:
            value, signature = unseal(record.value)
        except RecordError as exc:
            return str(exc)
        message = signing_message(record.key, record.subkey, value, record.expiration_time)
        if not verify_signature(owner, signature, message):
            return f"signature does not match sub-key {owner!r}"
        try:
            raw = _SERIALIZER.loads(value)
            parsed = decode_record(kind, raw)
        except UnsupportedRecordVersion:
            return None  # signed by its owner, from a newer release: store it, readers skip it
        except RecordError as exc:
            return str(exc)
        except Exception as exc:
            return f"value is not msgpack ({type(exc).__name__})"
        if parsed.peer_id != owner:
            return f"record names {parsed.peer_id}, sub-key {owner}"
        return None

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._kinds or record.subkey != self._own_subkey:
            return record.value
        message = signing_message(record.key, record.subkey, record.value, record.expiration_time)
        return seal(record.value, self._identity.sign(message))

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._kinds:
            return record.value
        try:
            value, _ = unseal(record.value)
        except RecordError:
            return record.value
        return value

    @property
    def priority(self) -> int:
        # validated first and signed last: the signature covers what other validators produce
        return 20

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


# ----------------------------------------------------------------- run inside the DHT process
# These coroutines are pickled by name and executed by hivemind in its DHT process; they catch
# their own deadline so that hivemind does not log a timeout as a crash.


async def _in_dht_store(
    _dht: DHT, node: DHTNode, items: list[tuple[str, str, bytes, float]], timeout: float
) -> tuple[str, list[bool]]:
    keys, subkeys, values, expirations = (list(column) for column in zip(*items, strict=True))
    try:
        result = await asyncio.wait_for(
            node.store_many(keys, values, expirations, subkeys=subkeys), timeout
        )
    except TimeoutError:
        return "timeout", []
    pairs = zip(keys, subkeys, strict=True)
    return "ok", [bool(result.get((key, subkey))) for key, subkey in pairs]


async def _in_dht_get_dictionaries(
    _dht: DHT, node: DHTNode, keys: list[str], timeout: float
) -> tuple[str, dict[str, Any]]:
    try:
        # latest: traverse the whole beam and merge every replica's sub-keys, not the first found
        found = await asyncio.wait_for(
            node.get_many(keys, sufficient_expiration_time=float("inf")), timeout
        )
    except TimeoutError:
        return "timeout", {}
    out: dict[str, Any] = {}
    for key in keys:
        item = found.get(key)
        if item is None:
            out[key] = {}
        elif isinstance(item.value, dict):
            out[key] = {
                subkey: (entry.value, entry.expiration_time)
                for subkey, entry in item.value.items()
            }
        else:
            out[key] = None  # a plain value where a dictionary belongs
    return "ok", out


async def _in_dht_ping(_dht: DHT, node: DHTNode, peer_id: str, timeout: float) -> float | None:
    peer = PeerID.from_base58(peer_id)
    start = time.perf_counter()
    try:
        answered = await asyncio.wait_for(node.protocol.call_ping(peer), timeout)
    except TimeoutError:
        return None
    return time.perf_counter() - start if answered is not None else None


async def _in_dht_connected_peers(
    _dht: DHT, node: DHTNode, max_addrs: int
) -> dict[str, list[str]]:
    # p2pd's connections: one entry per peer, its connections' remote addresses
    out: dict[str, list[str]] = {}
    for info in await node.p2p.list_peers():
        out[info.peer_id.to_base58()] = [str(addr) for addr in info.addrs][:max_addrs]
    return out


async def _in_dht_dial(
    _dht: DHT, node: DHTNode, peers: list[tuple[str, list[str]]], timeout: float
) -> list[str]:
    """Connect to each of ``peers`` (peer id, multiaddrs without /p2p/) and ping it over the
    DHT protocol, which puts each side in the other's routing table; then look up our own id
    to fill the routing table with the answering peers' neighbours. The peers that answered."""
    from hivemind.utils.multiaddr import Multiaddr

    async def one(peer_id: str, addrs: list[str]) -> bool:
        try:
            peer = PeerID.from_base58(peer_id)
            async with asyncio.timeout(timeout):
                await node.p2p._client.connect(peer, [Multiaddr(a) for a in addrs])
                return await node.protocol.call_ping(peer) is not None
        except Exception:  # unreachable, refused, malformed: not answered
            return False

    results = await asyncio.gather(*(one(p, a) for p, a in peers))
    answered = [peer for (peer, _), ok in zip(peers, results, strict=True) if ok]
    if answered:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout):
                await node.find_nearest_nodes([node.node_id])
    return answered


async def _in_dht_visible_maddrs(_dht: DHT, node: DHTNode) -> list[str]:
    # latest: hivemind caches the first answer, taken before any relay slot was reserved
    return [str(addr) for addr in await node.get_visible_maddrs(latest=True)]


# ----------------------------------------------------------------- the adapter

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_READY_SLICE = 0.25  # seconds a thread waits on the DHT's ready-future at a time


class _DhtProcess(DHT):
    """hivemind's DHT process, detached from the daemon's process group.

    Signals sent to the whole group (Ctrl-C in a terminal, GNU timeout, systemd's
    KillMode=control-group) would otherwise kill the DHT process (and its p2pd) before the
    daemon has withdrawn its record; the daemon stops it itself at the end of the leave path.
    It is asked to die with the daemon (PR_SET_PDEATHSIG), so a SIGKILLed daemon leaves no
    orphan behind holding the state dir's files.

    ``p2pd_flags`` are added to the p2pd command line that hivemind builds in this process
    (:func:`p2p_options` says which and why).
    """

    def __init__(self, *, p2pd_flags: dict[str, Any], **kwargs: Any) -> None:
        self._p2pd_flags = dict(p2pd_flags)  # set before the fork, which DHT.__init__ does
        super().__init__(**kwargs)

    def run(self) -> None:
        os.setpgid(0, 0)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != self._parent_pid:
            return  # the daemon died before prctl took effect
        _add_p2pd_flags(self._p2pd_flags)
        self._inner_pipe = _RequestPipe(self._inner_pipe)  # type: ignore[has-type]
        super().run()

    async def _dropped_request(self) -> None:
        """What a request that could not be read runs (``_RequestPipe``): nothing."""

    async def _run_coroutine(self, coro: Callable[..., Any], future: Any) -> None:
        """hivemind's, except for a request whose caller gave up first.

        ``Dht._call`` cancels the request's future when its deadline passes. hivemind's
        version then fails to set the outcome, fails again setting that failure, and logs
        both with tracebacks at ERROR ("Can't set_result to a future that is CANCELLED",
        "Task exception was never retrieved"); the caller has already reported the timeout.
        Here the late outcome is dropped with a debug line. A failure is still handed to
        the caller, as hivemind does, which reports it (``Dht._call``)."""
        try:
            result = await coro(self, self._node)
        except BaseException as exc:  # hivemind's contract: every outcome goes back
            settle, outcome = partial(future.set_exception, exc), repr(exc)
        else:
            settle, outcome = partial(future.set_result, result), "its result"
        try:
            settle()
        except InvalidStateError:  # cancelled by the caller, which stopped waiting
            log.debug("DHT request %s: caller gave up before %s", _request_name(coro), outcome)


def _request_name(coro: Any) -> str:
    return str(getattr(getattr(coro, "func", coro), "__name__", type(coro).__name__))


class _RequestPipe:
    """The DHT process's end of its request pipe, where a request that cannot be read is
    dropped at once.

    A request carries file descriptors (its MPFuture's pipe and shared state) that the
    receiver fetches from the sender's ``multiprocessing.resource_sharer``; when the sender
    has exited (a stage's averager processes, shut down when the server moves) its requests
    still queued cannot be read. hivemind 1.1.12's loop (``DHT.run``) logs each such one and
    then sleeps ``wait_timeout`` (3 s) before reading the next: after a move, a backlog of
    them held every other DHT request of the node for minutes (announce and lookups timed
    out, the moved server never came online). Here the unreadable request is logged and
    replaced with one that does nothing, so the loop goes straight on. Its sender, gone or
    not, hears nothing either way. ``EOFError`` (every writer closed) still ends the loop.
    """

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self.dropped = 0

    def fileno(self) -> int:
        return int(self._pipe.fileno())

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self._pipe.poll(timeout))

    def recv(self) -> Any:
        try:
            return self._pipe.recv()
        except (OSError, RuntimeError) as exc:  # the exceptions DHT.run sleeps on
            self.dropped += 1
            log.warning("dropped a DHT request that cannot be read (%d so far): %r",
                        self.dropped, exc)
            return "_dropped_request", [], {}


def _add_p2pd_flags(flags: dict[str, Any]) -> None:
    """Append ``flags`` to every p2pd command line hivemind builds in this process.

    hivemind 1.1.12's ``P2P.create`` has no parameters for the relay service's limits or for
    ``-relayDiscovery``; it turns its keyword arguments into ``-name=value`` flags with the
    static ``P2P._make_process_args``, which this wraps. Called only in the forked DHT process,
    whose one p2pd is the DHT's (the averagers' processes reuse it through replicate_p2p).
    """
    if not flags:
        return
    build = P2P._make_process_args

    def with_flags(*args: Any, **kwargs: Any) -> list[str]:
        return list(build(*args, **{**kwargs, **flags}))

    P2P._make_process_args = staticmethod(with_flags)


def p2p_options(config: DhtConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """hivemind ``P2P.create`` keyword arguments and extra p2pd flags for ``config``.

    Reaching peers behind NAT (docs/nat.md): p2pd's circuit relay v2 is on (``use_relay``),
    so every node can dial a relayed address and a reachable node serves as a relay within
    the ``relay_*`` limits. A node that AutoNAT finds unreachable reserves a slot on a relay
    (``use_auto_relay``) and announces ``/p2p/<relay>/p2p-circuit``, which the libp2p DHT
    hands to whoever looks the node up. The relays are ``dht.relays`` or else the initial
    peers, given as p2pd's static relays (``-relayDiscovery=0``): with discovery instead,
    libp2p's AutoRelay waits for 4 candidates or 3 minutes before its first reservation, and
    a small swarm has fewer than 4 public peers.
    """
    relays = list(config.relays or config.initial_peers)
    options: dict[str, Any] = {
        "use_relay": True,
        "use_auto_relay": config.use_relays,
        "auto_nat": True,
        "nat_port_map": config.nat_port_map,
        "force_reachability": None if config.reachability == "auto" else config.reachability,
    }
    flags: dict[str, Any] = {
        "relayService": config.relay_service,
        "relayMaxReservations": config.relay_max_reservations,
        "relayMaxCircuits": config.relay_max_circuits,
        "relayBufferSize": config.relay_buffer_kib * 1024,
        "relayDataLimit": config.relay_data_limit_mib * 1024 * 1024,
        "relayTimeLimit": f"{config.relay_time_limit:g}s",
    }
    if config.use_relays and relays:
        # p2pd refuses trusted relays without -autoRelay, so only with it
        options["trusted_relays"] = relays
        flags["relayDiscovery"] = False
    return options, flags


def others_maddrs(maddrs: list[str]) -> list[str]:
    """The multiaddrs worth giving to other hosts: loopback ones only when nothing else is left
    (a node on 127.0.0.1 alone), direct ones before relayed ones."""
    outside = [m for m in maddrs if not _is_loopback(m)] or list(maddrs)
    return sorted(outside, key=lambda m: "/p2p-circuit" in m)


def _is_loopback(maddr: str) -> bool:
    return maddr.startswith(("/ip4/127.", "/ip6/::1/", "/dns/localhost/", "/dns4/localhost/"))


def _bind_maddr(host: str, port: int) -> str:
    return f"/ip6/{host}/tcp/{port}" if ":" in host else f"/ip4/{host}/tcp/{port}"


class Dht:
    """The node's DHT: one hivemind DHT process, started before the event loop."""

    def __init__(
        self,
        process: DHT,
        config: DhtConfig,
        run: str,
        peer_id: str,
        validator: OwnedRecordValidator,
    ) -> None:
        self._process = process
        self.config = config
        self.run = run
        self.peer_id = peer_id
        self.validator = validator
        self._logged_drops: set[tuple[str, str, str]] = set()

    @classmethod
    def spawn(cls, config: DhtConfig, run: str, identity: Identity, identity_path: Path) -> Dht:
        """Fork the DHT process (call before starting the event loop: forking a process that
        runs threads and a loop is how hivemind's race reports begin). Does not wait for it."""
        validator = OwnedRecordValidator(run, identity)
        # this DHT process's loop, and those of the averager processes forked after it,
        # keep the tasks hivemind starts and drops (hivemind_loops.py says why)
        hivemind_loops.install()
        # hivemind's MPFuture binds to asyncio.get_event_loop(), which outside a running loop
        # would create (and leak) a default loop: give it one that we close right after the fork
        scratch = None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            scratch = asyncio.new_event_loop()
            asyncio.set_event_loop(scratch)
        try:
            p2p_kwargs, p2pd_flags = p2p_options(config)
            process = _DhtProcess(
                p2pd_flags=p2pd_flags,
                initial_peers=list(config.initial_peers) or None,
                start=True,
                await_ready=False,
                daemon=True,
                record_validators=[validator],
                shutdown_timeout=max(1.0, config.rpc_timeout),
                host_maddrs=[_bind_maddr(config.host, config.port)],
                announce_maddrs=list(config.announce_maddrs) or None,
                identity_path=str(identity_path),
                # hivemind's "identity already taken" probe parses the key file as RSA
                # (PeerID.from_identity) and fails on our Ed25519 key; the state dir's lock
                # keeps two daemons on one machine from sharing a key instead.
                check_if_identity_free=False,
                startup_timeout=config.bootstrap_timeout,
                wait_timeout=config.rpc_timeout,
                bootstrap_timeout=config.bootstrap_timeout,
                num_replicas=config.num_replicas,
                **p2p_kwargs,
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise JoinError(f"cannot start the DHT process: {exc}") from None
        finally:
            if scratch is not None:
                asyncio.set_event_loop(None)
                scratch.close()
        return cls(process, config, run, identity.peer_id, validator)

    def hivemind_optimizer(self, **options: Any) -> Optimizer:
        """A ``hivemind.Optimizer`` that collaborates over this DHT (averaging.py's
        CollaborativeOptimizer): ``options`` are its keyword arguments other than ``dht``."""
        return tidy_optimizer_class()(dht=self._process, **options)

    def hivemind_averager(self, factory: Callable[..., Any], **options: Any) -> Any:
        """A hivemind averager (``factory``: a ``DecentralizedAverager`` subclass, diloco.py)
        on this DHT: ``options`` are its keyword arguments other than ``dht``."""
        return factory(dht=self._process, **options)

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the DHT process ends."""
        return self._process.sentinel

    @property
    def exitcode(self) -> int | None:
        """The DHT process's exit status; None while it runs."""
        return self._process.exitcode

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def shutdown_blocking(self) -> None:
        """Stop the DHT process from outside the event loop (blocks until it has stopped)."""
        self._process.shutdown()

    async def wait_ready(self) -> None:
        """Wait until the DHT process has started and bootstrapped; JoinError otherwise."""
        loop = asyncio.get_running_loop()
        timeout = self.config.bootstrap_timeout
        deadline = loop.time() + timeout
        # The ready-future was made before the loop existed, so it is waited on from a thread,
        # in short slices: a cancelled join (a leave during start-up) leaves no thread behind
        # that the loop's shutdown would have to wait for.
        while True:
            try:
                await loop.run_in_executor(None, self._process.wait_until_ready, _READY_SLICE)
                return
            except TimeoutError:
                if loop.time() >= deadline:
                    raise JoinError(
                        f"the DHT did not start within dht.bootstrap_timeout={timeout}s"
                    ) from None
            except Exception as exc:
                raise JoinError(_describe_join_failure(exc)) from None

    async def _call(self, fn: Callable[..., Any], timeout: float, what: str) -> Any:
        if not self._process.is_alive():
            raise DhtError(f"{what}: the DHT process is not running")
        try:
            future = self._process.run_coroutine(fn, return_future=True)
        except (OSError, ValueError) as exc:
            raise DhtError(f"{what}: cannot reach the DHT process: {exc}") from None
        # The outcome is read off the future, never raised into this task by the await:
        # hivemind's DHT process can hand back a GeneratorExit as a request's outcome (it
        # garbage-collects a pending task, asyncio holding tasks weakly, and sends back what
        # was thrown into it). Raised by an await, a GeneratorExit reaches the task's own
        # coroutine whatever its callees catch: CPython closes every coroutine the task is
        # awaiting through and raises it in the outermost frame (test_hivemind_internals.py).
        # That ended the daemon from its address refresh, under load. The DHT process now
        # keeps its tasks (hivemind_loops.py); this stays as the guard for what it misses.
        outcome = asyncio.wrap_future(future)
        try:
            done, _ = await asyncio.wait({outcome}, timeout=timeout)
        finally:
            if not outcome.done():  # timed out, or this call was cancelled
                outcome.cancel()  # cancels ``future`` too
        if not done:
            raise DhtTimeout(f"{what} took longer than {timeout:.1f}s")
        if outcome.cancelled():
            raise DhtError(f"{what} failed: cancelled in the DHT process")
        failure = outcome.exception()
        if failure is None:
            return outcome.result()
        if isinstance(failure, NodeError):
            raise failure
        if isinstance(failure, Exception):
            raise DhtError(f"{what} failed: {type(failure).__name__}: {failure}") from None
        raise DhtError(f"{what} failed: the DHT process dropped the request "
                       f"({type(failure).__name__})")

    async def visible_maddrs(self) -> list[str]:
        """Multiaddrs (ending in /p2p/<peer id>) another node can pass as --initial-peers.

        Loopback addresses only when the node has nothing else (all local); relayed
        addresses (``.../p2p-circuit/p2p/<peer id>``, once a relay slot is reserved) last.
        """
        result: list[str] = await self._call(
            _in_dht_visible_maddrs, self.config.rpc_timeout, "visible_maddrs"
        )
        return others_maddrs(result)

    async def publish(self, server: ServerRecord, rtt: RttRecord, expiration: float) -> bool:
        """Store our two records (signed by the validator); True when the DHT reports both
        stored."""
        items = [
            (servers_key(self.run), self.peer_id, encode_record(server), expiration),
            (rtt_key(self.run), self.peer_id, encode_record(rtt), expiration),
        ]
        inner = self.config.request_timeout
        status, accepted = await self._call(
            partial(_in_dht_store, items=items, timeout=inner),
            inner + self.config.rpc_timeout,
            "store",
        )
        if status == "timeout":
            raise DhtTimeout(f"store took longer than dht.request_timeout={inner}s")
        return all(accepted)

    async def read_membership(self) -> MembershipRead:
        """Read ``{run}.servers`` and ``{run}.rtt``; malformed entries are dropped and logged."""
        keys = [servers_key(self.run), rtt_key(self.run)]
        inner = self.config.request_timeout
        status, found = await self._call(
            partial(_in_dht_get_dictionaries, keys=keys, timeout=inner),
            inner + self.config.rpc_timeout,
            "get",
        )
        if status == "timeout":
            raise DhtTimeout(f"lookup took longer than dht.request_timeout={inner}s")
        read = MembershipRead()
        now = time.time()  # hivemind's DHT time is the wall clock (get_dht_time)
        for key, kind in ((keys[0], ServerRecord), (keys[1], RttRecord)):
            entries = found.get(key)
            if entries is None:
                self._drop(
                    read, key, "-", "malformed",
                    "a plain value is stored where a dictionary belongs",
                )
                continue
            for subkey, (value, expiration) in entries.items():
                if not isinstance(expiration, float | int) or expiration <= now:
                    continue
                try:
                    record = decode_record(kind, value)
                except UnsupportedRecordVersion as exc:
                    self._drop(read, key, subkey, "unsupported_version", str(exc))
                    continue
                except RecordError as exc:
                    self._drop(read, key, subkey, "malformed", str(exc))
                    continue
                if record.peer_id != subkey:
                    self._drop(read, key, subkey, "forged", f"record names {record.peer_id}")
                    continue
                if isinstance(record, ServerRecord):
                    read.servers[subkey] = (record, float(expiration))
                elif isinstance(record, RttRecord):
                    read.rtts[subkey] = record
        return read

    def _drop(
        self, read: MembershipRead, key: str, subkey: object, reason: str, detail: str
    ) -> None:
        read.dropped.append(reason)
        marker = (key, repr(subkey)[:80], reason)
        if marker not in self._logged_drops:
            if len(self._logged_drops) > 1024:
                self._logged_drops.clear()
            self._logged_drops.add(marker)
            log.warning(
                "dropped a record under %s (sub-key %.80r): %s: %s", key, subkey, reason, detail
            )

    async def ping(self, peer_id: str, timeout: float) -> float:
        """Round-trip seconds of one DHT ping RPC to ``peer_id`` (timed in the DHT process)."""
        try:
            PeerID.from_base58(peer_id)
        except ValueError as exc:
            raise ProbeError(f"not a peer id: {peer_id!r}") from exc
        rtt = await self._call(
            partial(_in_dht_ping, peer_id=peer_id, timeout=timeout), timeout + 1.0, "ping"
        )
        if rtt is None:
            raise ProbeError(f"{peer_id} did not answer a ping within {timeout}s")
        return float(rtt)

    async def connected_peers(self, max_addrs: int = 8) -> dict[str, list[str]]:
        """The peers the DHT's libp2p daemon is connected to: peer id -> remote addresses."""
        found = await self._call(
            partial(_in_dht_connected_peers, max_addrs=max_addrs),
            self.config.rpc_timeout, "listing connected peers",
        )
        return dict(found)

    async def dial(self, peers: list[tuple[str, tuple[str, ...]]], timeout: float) -> list[str]:
        """Connect to and ping ``peers`` (peer id, multiaddrs), all at once, each within
        ``timeout`` s (address_book.py); the peer ids that answered."""
        if not peers:
            return []
        request = [(peer_id, list(addrs)) for peer_id, addrs in peers]
        answered = await self._call(
            partial(_in_dht_dial, peers=request, timeout=timeout), 2 * timeout + 2.0,
            "dialing remembered peers",
        )
        return list(answered)

    async def shutdown(self, timeout: float) -> None:
        """Stop the DHT process (and its p2pd), killing it if it overruns ``timeout``."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await loop.run_in_executor(None, self._process.shutdown)
        if self._process.is_alive():
            log.warning("DHT process did not stop within %.1fs; killing it", timeout)
            self._process.kill()
            await loop.run_in_executor(None, self._process.join, 5.0)


def _describe_join_failure(exc: BaseException) -> str:
    text = str(exc)
    if "bootstrap failed" in text or "failed to connect to bootstrap peers" in text:
        return (
            "none of the initial peers answered; check dht.initial_peers "
            "(or omit them to start a new swarm)"
        )
    if "already taken" in text:
        return (
            "this node's identity is already in use by another running peer "
            "(same state dir copied?)"
        )
    return f"the DHT failed to start: {type(exc).__name__}: {text}"



def others_records(metadata: Any, own_peer_id: bytes) -> dict[bytes, tuple[int, float]]:
    """The other (non-client) replicas' progress records: peer id -> (epoch, samples);
    ``metadata`` is the tracker's DHT value (subkey -> ``ValueWithExpiration`` of a
    ``LocalTrainingProgress`` dict), already screened (stage/progress_guard.py). Anything
    that is not such a record is skipped; of two records of one peer id, the one further on
    counts."""
    out: dict[bytes, tuple[int, float]] = {}
    if not isinstance(metadata, dict):
        return out
    for item in metadata.values():
        value = getattr(item, "value", None)
        if not isinstance(value, dict) or value.get("client_mode") is True:
            continue
        peer = value.get("peer_id")
        if not isinstance(peer, bytes) or peer == own_peer_id:
            continue
        epoch, samples = value.get("epoch"), value.get("samples_accumulated")
        if (isinstance(epoch, bool) or not isinstance(epoch, int)
                or isinstance(samples, bool) or not isinstance(samples, (int, float))
                or not math.isfinite(samples) or samples < 0):
            continue
        record = (epoch, float(samples))
        out[peer] = max(record, out.get(peer, record))
    return out


def others_samples(metadata: Any, own_peer_id: bytes) -> dict[int, float]:
    """The samples of :func:`others_records`, summed by epoch."""
    return sum_by_epoch(others_records(metadata, own_peer_id))


def sum_by_epoch(records: dict[bytes, tuple[int, float]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for epoch, samples in records.values():
        out[epoch] = out.get(epoch, 0.0) + samples
    return out


_PROGRESS_KEY_ATTR = "_wanswarm_progress_key"


def progress_signing_key(dht: Any) -> Any:
    """The RSA key that signs this DHT's progress records: one per hivemind DHT, made at the
    first call.

    hivemind's tracker signs its records through the DHT process's RSASignatureValidator,
    and a DHT keeps the first such validator it is given (``merge_with`` drops later
    ones), which signs only records whose owner is its own key. A tracker with any other
    key stores unsigned records, which every node refuses: after a stage move, the node's
    second optimizer, built with a key of its own, was invisible to the replicas of its
    new stage (no averaging round, its pushes refused as ``unknown``; docs/gpu.md). Not
    hivemind's process-wide key either: two replicas on two DHTs in one process (tests)
    would then publish under one owner and overwrite each other's records."""
    key = getattr(dht, _PROGRESS_KEY_ATTR, None)
    if key is None:
        from hivemind.utils.crypto import RSAPrivateKey

        key = RSAPrivateKey()
        setattr(dht, _PROGRESS_KEY_ATTR, key)
    return key


@cache
def tidy_optimizer_class() -> type:
    """``hivemind.Optimizer`` whose progress tracker closes the event loop it runs on.

    hivemind 1.1.12's ``ProgressTracker.run`` makes an event loop for its thread and never
    closes it: after the tracker's shutdown the loop and its self-pipe sockets linger until the
    garbage collector finds them, which then warns about an unclosed loop and sockets in
    whatever code happens to run (a later test, under pytest's unraisable-exception check).
    The loop is closed here when the thread's work is done, after cancelling the tasks hivemind
    leaves pending; the run itself is hivemind's (tests/unit/test_hivemind_internals.py pins
    what this relies on). Every ``hivemind.Optimizer`` we build comes from this class, the
    tests' too.

    The tracker also takes a ``hold_epoch`` callable: while it answers True, the tracker
    says the epoch is not ready to end, so that hivemind's ``step`` accumulates instead of
    beginning the next epoch's step (averaging.py holds while the previous epoch's delayed
    round still runs: hivemind would wait for it on the caller's thread). With
    ``exact_epochs`` an epoch ends when the samples the other replicas reported plus this
    replica's own, as they are now, reach ``target_batch_size`` (or a replica is at a later
    epoch), not when hivemind's estimate of them does: that estimate extrapolates every
    replica's samples per second since its last report, and ended the tiny run's epochs after
    about 46 of 64 samples (averaging.py). Built with a ``push_book``, the tracker also pushes
    this replica's count to the other replicas over libp2p as it changes and takes theirs,
    not only through the DHT (stage/progress_push.py, stage/progress_channel.py)."""
    from hivemind import Optimizer
    from hivemind.optim.progress_tracker import ProgressTracker

    from ..stage.progress_channel import ProgressChannel
    from ..stage.progress_push import PushBook

    class ClosingProgressTracker(ProgressTracker):
        hold_epoch: Callable[[], bool] | None = None
        exact_epochs = False
        # the other replicas' records, peer id -> (epoch, samples), as of the last fetch
        replica_records: dict[bytes, tuple[int, float]] = {}  # noqa: RUF012 (replaced)
        push_book: PushBook | None = None  # the constructor's push_book
        channel: ProgressChannel | None = None  # run, with a push_book

        def __init__(
            self, *args: Any, push_book: PushBook | None = None,
            pushes_after: threading.Event | None = None,
            departed: Callable[[], Collection[bytes]] | None = None, **kwargs: Any,
        ) -> None:
            # set before hivemind's constructor starts the thread, whose run reads them
            self.push_book = push_book
            # the replicas known to have stopped serving the stage (the membership's
            # server records say so within node.record_ttl, where their progress records
            # live on for hivemind's metadata_expiration): their records do not count
            self.departed = departed
            self.departed_records = 0
            # the channel starts once this is set (None: at once). The optimizer sets it
            # when its averagers are forked: the channel's setup calls into the DHT and
            # p2pd from this thread, and a fork while another thread holds a lock there
            # leaves the child averager waiting on it for good (a test's optimizer hung
            # in the averager's start)
            self.pushes_after = pushes_after
            super().__init__(*args, **kwargs)

        def _parse_swarm_progress_data(self, metadata: Any) -> Any:
            metadata = self._without_departed(metadata)
            self.replica_records = others_records(
                metadata, bytes(self.local_progress.peer_id)
            )
            return super()._parse_swarm_progress_data(metadata)

        def _without_departed(self, metadata: Any) -> Any:
            """``metadata`` less the records of replicas that stopped serving the stage:
            neither this tracker's counts nor hivemind's (its number of peers decides
            whether a step looks for a round at all) wait for a replica that died."""
            gone = self.departed() if self.departed is not None else ()
            if not gone or not isinstance(metadata, dict):
                self.departed_records = 0
                return metadata
            kept = {
                subkey: item for subkey, item in metadata.items()
                if not (isinstance(value := getattr(item, "value", None), dict)
                        and value.get("peer_id") in gone)
            }
            self.departed_records = len(metadata) - len(kept)
            return kept

        @property
        def others_samples(self) -> dict[int, float]:
            """The other replicas' samples by epoch: their DHT records, or their pushes
            where those are further on."""
            records = self.replica_records
            gone = self.departed() if self.departed is not None else ()
            if gone:
                # as of now, not of the last read: a step holds the tracker, and no read
                # happens while it waits for its round (averaging.py gives the round up
                # once nobody is left)
                records = {peer: r for peer, r in records.items() if peer not in gone}
            book = self.push_book
            if book is None:
                return sum_by_epoch(records)
            return book.merged(records, time.monotonic())

        def report_local_progress(
            self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True
        ) -> None:
            super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
            channel = self.channel
            if channel is not None:
                channel.notify()

        @property
        def ready_to_update_epoch(self) -> bool:
            if self.hold_epoch is not None and self.hold_epoch():
                return False
            return self.due_without_hold()

        def due_without_hold(self) -> bool:
            """Whether the epoch is over as the counts stand now, whatever ``hold_epoch``
            says (the hold itself asks this: averaging.py's start-up hold)."""
            if self.exact_epochs:
                return self.epoch_end_reason() is not None
            return bool(super().ready_to_update_epoch)

        def epoch_end_reason(self) -> str | None:
            """With ``exact_epochs``, why the epoch is over as the counts stand now
            (``global``: the DHT shows a later epoch; ``ahead``: a replica's count, pushed
            or fetched, is at a later epoch; ``target``: the samples reached the target),
            or None while it is not."""
            local = self.local_progress
            others = self.others_samples
            if self.global_epoch > local.epoch:
                return "global"
            # a replica already past our epoch (its push can say so before the DHT does):
            # the epoch is over, and its samples no longer count in it
            if any(epoch > local.epoch for epoch in others):
                return "ahead"
            # our own samples as they are now, not as our last published record had them
            # (hivemind's sum takes that record at each fetch and adds our samples since
            # the fetch: what we accumulated between publishing and fetching is missed)
            fresh = others.get(local.epoch, 0.0) + local.samples_accumulated
            reported = self.global_progress.samples_accumulated
            if max(fresh, reported) >= self.target_batch_size:
                return "target"
            return None

        def run(self) -> None:
            loop = asyncio.new_event_loop()
            hivemind_loops.keep_tasks(loop)  # hivemind_loops.py: its store and get tasks
            asyncio.set_event_loop(loop)
            work = [self._progress_reporter(), self._progress_fetcher()]
            if self.push_book is not None:
                self.channel = ProgressChannel(self)
                work.append(self.channel.run())
            try:
                loop.run_until_complete(asyncio.gather(*work))
                self.shutdown_complete.set()
            finally:
                try:
                    # hivemind leaves its DHT getter task pending at shutdown: cancel what
                    # is left, so that no task is destroyed pending with the closed loop
                    left = asyncio.all_tasks(loop)
                    for task in left:
                        task.cancel()
                    loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
                    loop.run_until_complete(loop.shutdown_asyncgens())
                    loop.run_until_complete(loop.shutdown_default_executor())
                finally:
                    asyncio.set_event_loop(None)
                    loop.close()

    class TidyOptimizer(Optimizer):
        tracker_class = ClosingProgressTracker

        def _make_state_averager(self, **kwargs: Any) -> Any:
            # hivemind's own, with the state averager whose parameter rounds meet only
            # rounds of their epoch (stage/exact_allreduce.py)
            from ..stage.exact_allreduce import EpochKeyedStateAverager

            return EpochKeyedStateAverager(
                dht=self.dht,
                prefix=f"{self.run_id}_state_averager",
                min_matchmaking_time=self.matchmaking_time,
                allreduce_timeout=self.allreduce_timeout,
                shutdown_timeout=self.shutdown_timeout,
                offload_optimizer=self.offload_optimizer,
                custom_gradients=self.offload_optimizer,
                status_loglevel=self.status_loglevel,
                next_chunk_timeout=self.next_chunk_timeout,
                client_mode=self.client_mode,
                auxiliary=self.auxiliary,
                start=True,
                **kwargs,
            )

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._averagers_forked = threading.Event()
            try:
                super().__init__(*args, **kwargs)
            finally:
                self._averagers_forked.set()  # the tracker's push channel may start

        def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> Any:
            kwargs["private_key"] = progress_signing_key(self.dht)
            return ClosingProgressTracker(
                dht=self.dht,
                prefix=self.run_id,
                target_batch_size=target_batch_size,
                client_mode=self.client_mode,
                status_loglevel=self.status_loglevel,
                start=True,
                pushes_after=self._averagers_forked,
                **kwargs,
            )

    return TidyOptimizer
