"""Node identity: libp2p key file format, peer ids, permissions, certificates."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from wanswarm.transport.errors import IdentityError
from wanswarm.transport.identity import (
    Identity,
    load_or_create_identity,
    peer_id_from_certificate,
    public_key_bytes,
    public_key_from_peer_id,
    verify_signature,
)


def test_peer_id_is_libp2p_ed25519_form_and_round_trips() -> None:
    identity = Identity.generate()
    peer_id = identity.peer_id
    # Ed25519 peer ids inline the key: identity multihash -> base58 '12D3KooW...'
    assert peer_id.startswith("12D3KooW") and len(peer_id) == 52
    recovered = public_key_from_peer_id(peer_id)
    assert public_key_bytes(recovered) == public_key_bytes(identity.public_key)


def test_known_vector_matches_libp2p_encoding() -> None:
    # Seed of all zero bytes: its public key follows from RFC 8032 key generation; the
    # file layout is libp2p's protobuf PrivateKey (type 1 = Ed25519, 64 data bytes).
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    identity = Identity(Ed25519PrivateKey.from_private_bytes(bytes(32)))
    pub = public_key_bytes(identity.public_key)
    assert pub.hex() == "3b6a27bcceb6a42d62a3a8d02a6f0d73653215771de243a63ac048a18b59da29"
    blob = identity.to_libp2p_bytes()
    assert blob[:4] == bytes([0x08, 0x01, 0x12, 0x40]) and blob[4:36] == bytes(32)
    assert blob[36:] == pub
    assert Identity.from_libp2p_bytes(blob).peer_id == identity.peer_id


def test_signatures_verify_only_for_the_signer() -> None:
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"transcript")
    assert verify_signature(a.peer_id, sig, b"transcript")
    assert not verify_signature(b.peer_id, sig, b"transcript")
    assert not verify_signature(a.peer_id, sig, b"transcripT")
    assert not verify_signature("not-a-peer-id", sig, b"transcript")


@pytest.mark.parametrize(
    "bad", ["", "0OIl", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "1" * 60]
)
def test_malformed_peer_ids_are_identity_errors(bad: str) -> None:
    with pytest.raises(IdentityError):
        public_key_from_peer_id(bad)


def test_key_file_created_0600_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "state" / "identity.key"
    first, created = load_or_create_identity(path)
    assert created
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    second, created_again = load_or_create_identity(path)
    assert not created_again
    assert second.peer_id == first.peer_id


def test_group_readable_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    load_or_create_identity(path)
    os.chmod(path, 0o640)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create_identity(path)


@pytest.mark.parametrize(
    "blob",
    [b"", b"\x08\x01", b"\x08\x00\x12\x40" + bytes(64), b"\x08\x01\x12\x40" + bytes(10)],
)
def test_malformed_key_file_is_refused(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(blob)
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match="malformed"):
        load_or_create_identity(path)


def test_mismatched_public_half_is_refused() -> None:
    blob = bytearray(Identity.generate().to_libp2p_bytes())
    blob[-1] ^= 0xFF
    with pytest.raises(IdentityError, match="does not match"):
        Identity.from_libp2p_bytes(bytes(blob))


def test_certificate_carries_the_node_key() -> None:
    identity = Identity.generate()
    cert_pem, key_pem = identity.certificate_pem()
    cert = x509.load_pem_x509_certificate(cert_pem)
    der = cert.public_bytes(serialization.Encoding.DER)
    assert peer_id_from_certificate(der) == identity.peer_id
    assert b"PRIVATE KEY" in key_pem
