"""DHT records: strict schemas, versions, size bounds, the signed envelope and the validator."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wanswarm.node.errors import RecordError, UnsupportedRecordVersion
from wanswarm.node.membership.records import (
    MAX_RECORD_BYTES,
    QuicAddress,
    RttEntry,
    RttRecord,
    ServerRecord,
    decode_record,
    encode_record,
    seal,
    signing_message,
    unseal,
)
from wanswarm.transport.identity import Identity

ALICE = Identity.generate()
BOB = Identity.generate()


def _server(peer_id: str = ALICE.peer_id, **fields: object) -> ServerRecord:
    return ServerRecord.model_validate({"peer_id": peer_id, "state": "online", **fields})


def test_round_trip() -> None:
    record = _server(
        stage=2,
        throughput=1234.5,
        queue=3,
        quic=QuicAddress(host="203.0.113.7", port=4433),
        version="0.1.0",
    )
    assert decode_record(ServerRecord, encode_record(record)) == record
    rtt = RttRecord(peer_id=ALICE.peer_id, rtts={BOB.peer_id: RttEntry(srtt_ms=12.5, min_ms=10.0)})
    assert decode_record(RttRecord, encode_record(rtt)) == rtt


def _raw(**changes: object) -> bytes:
    body = json.loads(encode_record(_server()))
    body.update(changes)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "raw",
    [
        _raw(stage="1"),  # strict: no str -> int coercion
        _raw(stage=True),
        _raw(stage=-1),
        _raw(state="dead"),
        _raw(peer_id="not base58 0OIl"),
        _raw(throughput=-1.0),
        _raw(queue=1.5),
        _raw(extra_field=1),
        _raw(v=0),
        _raw(quic={"host": "", "port": 1}),
        _raw(quic={"host": "h", "port": 70000}),
        b'{"v": 1, "peer_id": "x", "state": "online", "throughput": NaN}',
        b"[]",
        b"not json",
        b"\xff\xfe",
    ],
)
def test_malformed_records_raise_record_error(raw: bytes) -> None:
    with pytest.raises(RecordError):
        decode_record(ServerRecord, raw)


def test_newer_version_is_unsupported_not_malformed() -> None:
    with pytest.raises(UnsupportedRecordVersion):
        decode_record(ServerRecord, _raw(v=2, new_field="from the future"))


def test_wrong_type_and_oversize_are_refused_before_parsing() -> None:
    with pytest.raises(RecordError, match="not bytes"):
        decode_record(ServerRecord, {"v": 1})
    with pytest.raises(RecordError, match="over"):
        decode_record(ServerRecord, b" " * (MAX_RECORD_BYTES + 1))
    too_many = {f"12D3KooW{i:044d}".replace("0", "a"): RttEntry(srtt_ms=1.0) for i in range(65)}
    with pytest.raises(ValueError):
        RttRecord(peer_id=ALICE.peer_id, rtts=too_many)


def test_every_truncation_is_refused() -> None:
    raw = encode_record(_server(stage=1))
    for cut in range(len(raw)):
        with pytest.raises(RecordError):
            decode_record(ServerRecord, raw[:cut])


@settings(max_examples=300)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash(raw: bytes) -> None:
    try:
        decode_record(ServerRecord, raw)
    except RecordError:
        pass


def test_seal_and_unseal() -> None:
    value, signature = b"value", bytes(range(64))
    assert unseal(seal(value, signature)) == (value, signature)
    with pytest.raises(RecordError):
        unseal(b"value without a signature" + bytes(64))
    with pytest.raises(RecordError):
        seal(value, b"short")


def test_signing_message_binds_every_field() -> None:
    base = signing_message(b"key", b"sub", b"value", 100.0)
    assert signing_message(b"key", b"sub", b"value", 100.5) != base
    assert signing_message(b"ke", b"ysub", b"value", 100.0) != base  # length prefixes
    assert signing_message(b"key", b"sub", b"valu", 100.0) != base


# ------------------------------------------------------------------ the hivemind validator

hivemind_dht = pytest.importorskip("wanswarm.node.membership.dht")
from hivemind.dht.protocol import DHTProtocol  # noqa: E402
from hivemind.dht.routing import DHTID  # noqa: E402
from hivemind.dht.validation import DHTRecord  # noqa: E402

SER = DHTProtocol.serializer
SERVERS = DHTID.generate(source="demo.servers").to_bytes()
RTT = DHTID.generate(source="demo.rtt").to_bytes()


def _signed(identity: Identity, value: bytes, subkey: object = None, key: bytes = SERVERS,
            expiration: float = 1e9) -> DHTRecord:
    """What the DHT stores after identity's node signed a record (or an attacker's attempt)."""
    validator = hivemind_dht.OwnedRecordValidator("demo", identity)
    record = DHTRecord(
        key, SER.dumps(identity.peer_id if subkey is None else subkey), SER.dumps(value), expiration
    )
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_validator_accepts_owner_signed_records_and_strips_the_signature() -> None:
    validator = hivemind_dht.OwnedRecordValidator("demo", BOB)  # any node validates anyone's record
    value = encode_record(_server())
    record = _signed(ALICE, value)
    assert validator.validate(record)
    assert SER.loads(validator.strip_value(record)) == value
    rtt = encode_record(RttRecord(peer_id=ALICE.peer_id))
    assert validator.validate(_signed(ALICE, rtt, key=RTT))
    assert validator.rejected == 0


def test_validator_refuses_forgeries_and_junk() -> None:
    validator = hivemind_dht.OwnedRecordValidator("demo", ALICE)
    good = _signed(ALICE, encode_record(_server()))
    forged = [
        # Bob cannot write Alice's sub-key: his node does not sign it, and a value he signs fails
        dataclasses.replace(_signed(BOB, encode_record(_server()), subkey=ALICE.peer_id)),
        dataclasses.replace(good, expiration_time=good.expiration_time + 1),  # extended
        dataclasses.replace(good, value=good.value[:-1] + bytes([good.value[-1] ^ 1])),  # tampered
        dataclasses.replace(good, key=RTT),  # replayed under another key (and wrong schema)
        _signed(
            BOB, encode_record(_server(peer_id=ALICE.peer_id))
        ),  # names Alice under Bob's sub-key
        _signed(ALICE, b"not json"),
        _signed(ALICE, encode_record(RttRecord(peer_id=ALICE.peer_id))),  # rtt schema under servers
        DHTRecord(
            SERVERS, SER.dumps(ALICE.peer_id), SER.dumps(encode_record(_server())), 1e9
        ),  # unsigned
        DHTRecord(SERVERS, DHTProtocol.IS_REGULAR_VALUE, good.value, 1e9),  # no sub-key
        DHTRecord(SERVERS, SER.dumps(12345), good.value, 1e9),  # sub-key that is no peer id
        DHTRecord(SERVERS, b"\xc1", good.value, 1e9),  # sub-key that is not msgpack
    ]
    for index, record in enumerate(forged):
        assert not validator.validate(record), f"forgery {index} accepted"
    assert validator.rejected == len(forged)


def test_validator_passes_newer_versions_and_other_keys() -> None:
    validator = hivemind_dht.OwnedRecordValidator("demo", BOB)
    newer = json.dumps({"v": 2, "peer_id": ALICE.peer_id, "anything": [1, 2]}).encode()
    assert validator.validate(_signed(ALICE, newer))  # stored; readers skip it
    other = DHTRecord(DHTID.generate(source="demo_stage0").to_bytes(), b"sub", b"\x01", 1e9)
    assert validator.validate(other)
    assert (
        validator.sign_value(other) == other.value and validator.strip_value(other) == other.value
    )
    # a node signs only its own sub-keys
    theirs = DHTRecord(SERVERS, SER.dumps(ALICE.peer_id), b"v", 1e9)
    assert validator.sign_value(theirs) == b"v"


def test_validator_judges_a_record_once_and_remembers_refusals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    validator = hivemind_dht.OwnedRecordValidator("demo", BOB)
    good = _signed(ALICE, encode_record(_server()))
    tampered = dataclasses.replace(good, value=good.value[:-1] + bytes([good.value[-1] ^ 1]))
    calls: list[str] = []
    real = hivemind_dht.verify_signature

    def counting(peer_id: str, signature: bytes, message: bytes) -> bool:
        calls.append(peer_id)
        return real(peer_id, signature, message)

    monkeypatch.setattr(hivemind_dht, "verify_signature", counting)
    for _ in range(5):  # the same record in five lookup answers
        assert validator.validate(good)
        assert not validator.validate(tampered)
    assert len(calls) == 2  # one verification each
    assert validator.rejected == 5  # every sighting of the forgery is still refused and counted
    # a re-announced record (new expiration, new signature) is judged afresh
    assert validator.validate(_signed(ALICE, encode_record(_server()), expiration=2e9))
    assert len(calls) == 3
