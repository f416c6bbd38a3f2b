"""The identity handshake state machines and their wire format (no sockets)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wanswarm.transport.errors import AuthenticationError, PeerIdMismatch
from wanswarm.transport.handshake import (
    Accept,
    ChannelBinding,
    ClientHandshake,
    Finish,
    Hello,
    Proof,
    ServerHandshake,
    decode_auth,
    encode_auth,
)
from wanswarm.transport.identity import Identity

CLIENT, SERVER, OTHER = Identity.generate(), Identity.generate(), Identity.generate()


def _binding(exporter: bytes = b"e" * 32) -> ChannelBinding:
    return ChannelBinding(exporter, "wanswarm/1", b"o" * 8, b"c" * 8, b"s" * 8)


def _run(
    client: ClientHandshake, server: ServerHandshake
) -> tuple[bytes, bytes, bytes, bytes]:
    hello = client.hello()
    proof = server.receive_hello(hello)
    finish = client.receive_proof(proof)
    accept = server.receive_finish(finish)
    client.receive_accept(accept)
    return hello, proof, finish, accept


def test_both_sides_authenticate() -> None:
    client = ClientHandshake(CLIENT, SERVER.peer_id, _binding(), os.urandom(32))
    server = ServerHandshake(SERVER, _binding(), os.urandom(32), CLIENT.peer_id)
    _run(client, server)
    assert client.done and server.client_id == CLIENT.peer_id


@pytest.mark.parametrize(
    "message",
    [
        Hello(b"n" * 32, CLIENT.peer_id, SERVER.peer_id),
        Proof(b"m" * 32, SERVER.peer_id, b"s" * 64),
        Finish(b"f" * 64),
        Accept(),
    ],
)
def test_messages_round_trip_and_truncation(message: object) -> None:
    data = encode_auth(message)  # type: ignore[arg-type]
    assert decode_auth(data) == message
    for cut in range(len(data)):
        with pytest.raises(AuthenticationError):
            decode_auth(data[:cut])
    with pytest.raises(AuthenticationError, match="trailing"):
        decode_auth(data + b"\x00")


def test_unknown_version_and_type() -> None:
    with pytest.raises(AuthenticationError, match="version"):
        decode_auth(b"\x02\x04")
    with pytest.raises(AuthenticationError, match="unknown"):
        decode_auth(b"\x01\x09")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_authentication_errors(data: bytes) -> None:
    try:
        decode_auth(data)
    except AuthenticationError:
        pass


def test_client_refuses_a_server_with_another_id() -> None:
    client = ClientHandshake(CLIENT, SERVER.peer_id, _binding(), os.urandom(32))
    impostor = ServerHandshake(OTHER, _binding(), os.urandom(32), CLIENT.peer_id)
    with pytest.raises(PeerIdMismatch, match="expected peer"):
        impostor.receive_hello(client.hello())


def test_server_refuses_a_hello_for_someone_else() -> None:
    client = ClientHandshake(CLIENT, OTHER.peer_id, _binding(), os.urandom(32))
    server = ServerHandshake(SERVER, _binding(), os.urandom(32), CLIENT.peer_id)
    with pytest.raises(PeerIdMismatch) as info:
        server.receive_hello(client.hello())
    assert OTHER.peer_id in str(info.value) and SERVER.peer_id in str(info.value)


def test_server_refuses_a_claim_other_than_the_tls_certificate() -> None:
    client = ClientHandshake(CLIENT, SERVER.peer_id, _binding(), os.urandom(32))
    server = ServerHandshake(SERVER, _binding(), os.urandom(32), OTHER.peer_id)
    with pytest.raises(AuthenticationError, match="TLS certificate"):
        server.receive_hello(client.hello())


def test_replayed_finish_is_refused_on_another_connection() -> None:
    nonce = os.urandom(32)
    first = ClientHandshake(CLIENT, SERVER.peer_id, _binding(b"1" * 32), nonce)
    hello, _, finish, _ = _run(first, ServerHandshake(SERVER, _binding(b"1" * 32), os.urandom(32)))
    # same hello and finish replayed to a server on a different connection
    server = ServerHandshake(SERVER, _binding(b"2" * 32), os.urandom(32))
    server.receive_hello(hello)
    with pytest.raises(AuthenticationError, match="invalid"):
        server.receive_finish(finish)
    assert server.client_id is None


def test_relayed_handshake_fails_on_the_exporter() -> None:
    """A relay terminating TLS on both legs forwards messages between two connections
    with different exporters: neither signature verifies on the other leg."""
    client = ClientHandshake(CLIENT, SERVER.peer_id, _binding(b"A" * 32), os.urandom(32))
    server = ServerHandshake(SERVER, _binding(b"B" * 32), os.urandom(32))
    proof = server.receive_hello(client.hello())
    with pytest.raises(AuthenticationError, match="invalid"):
        client.receive_proof(proof)


def test_forged_signature_and_role_reflection() -> None:
    client = ClientHandshake(CLIENT, SERVER.peer_id, _binding(), os.urandom(32))
    server = ServerHandshake(SERVER, _binding(), os.urandom(32))
    proof = decode_auth(server.receive_hello(client.hello()))
    assert isinstance(proof, Proof)
    # the server's own signature sent back as the client's FINISH (role differs)
    with pytest.raises(AuthenticationError):
        server.receive_finish(encode_auth(Finish(proof.signature)))
    # a flipped bit in the server's proof
    flipped = bytes([proof.signature[0] ^ 1]) + proof.signature[1:]
    forged = Proof(proof.nonce, proof.server_id, flipped)
    with pytest.raises(AuthenticationError):
        client.receive_proof(encode_auth(forged))


def test_messages_out_of_order() -> None:
    client = ClientHandshake(CLIENT, SERVER.peer_id, _binding(), os.urandom(32))
    server = ServerHandshake(SERVER, _binding(), os.urandom(32))
    with pytest.raises(AuthenticationError):
        server.receive_finish(encode_auth(Finish(b"x" * 64)))
    with pytest.raises(AuthenticationError):
        client.receive_accept(encode_auth(Accept()))
    with pytest.raises(AuthenticationError, match="expected auth Proof"):
        client.receive_proof(client.hello())


def test_echoed_nonce_is_refused() -> None:
    nonce = os.urandom(32)
    client = ClientHandshake(CLIENT, SERVER.peer_id, _binding(), nonce)
    server = ServerHandshake(SERVER, _binding(), nonce)
    with pytest.raises(AuthenticationError, match="nonce"):
        server.receive_hello(client.hello())
