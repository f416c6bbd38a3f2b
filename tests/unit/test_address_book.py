"""The address book (node/membership/address_book.py): what is remembered, and its bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from wanswarm.node.membership.address_book import (
    FORGET_AFTER_S,
    MAX_ADDRS,
    MAX_FILE_BYTES,
    MAX_PEERS,
    PEERS_FILE,
    SAVE_PERIOD_S,
    AddressBook,
    split_maddr,
    usable_addrs,
)

OWN = "12D3KooW" + "A" * 44
A = "12D3KooW" + "B" * 44
B = "12D3KooW" + "C" * 44
RELAY = "12D3KooW" + "D" * 44


def peer(i: int) -> str:
    return "12D3KooW" + f"{i:044d}".replace("0", "x")


def test_only_members_are_remembered_and_survive_a_restart(tmp_path: Path) -> None:
    book = AddressBook(tmp_path, OWN)
    seen = {
        A: ["/ip4/10.0.0.2/tcp/31337"],
        B: ["/ip4/10.0.0.3/tcp/31337"],  # connected, but not a member of the run
        OWN: ["/ip4/10.0.0.1/tcp/31337"],
    }
    assert book.remember(seen, members=[A, OWN], now=1000.0) == 1
    book.save()
    again = AddressBook(tmp_path, OWN)
    assert again.candidates(now=1001.0) == [(A, ("/ip4/10.0.0.2/tcp/31337",))]
    assert again.candidates(connected=[A], now=1001.0) == []


def test_most_recent_first_capped_and_stale_peers_forgotten(tmp_path: Path) -> None:
    book = AddressBook(tmp_path, OWN)
    ids = [peer(i) for i in range(MAX_PEERS + 10)]
    for i, peer_id in enumerate(ids):
        book.remember({peer_id: [f"/ip4/10.0.{i // 250}.{i % 250}/tcp/1"]}, [peer_id], now=i)
    assert len(book) == MAX_PEERS
    order = [p for p, _ in book.candidates(now=len(ids))]
    assert order == ids[::-1][:MAX_PEERS]
    assert book.candidates(now=len(ids) + FORGET_AFTER_S + 11) == []
    book.remember({A: ["/ip4/10.0.0.9/tcp/1"]}, [A], now=len(ids) + FORGET_AFTER_S + 11)
    assert len(book) == 1  # the forgotten ones are pruned


def test_addresses_are_bounded_and_checked() -> None:
    many = [f"/ip4/10.0.0.{i}/tcp/1" for i in range(20)]
    assert usable_addrs(many) == tuple(many[:MAX_ADDRS])
    circuit = f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}/p2p-circuit"
    assert usable_addrs([circuit, "/ip4/10.0.0.2/tcp/1"]) == ("/ip4/10.0.0.2/tcp/1", circuit)
    assert usable_addrs([f"/ip4/10.0.0.1/tcp/1/p2p/{A}"]) == ("/ip4/10.0.0.1/tcp/1",)
    junk = ["", "not an address", "/ip4/10.0.0.1/tcp/" + "9" * 300, "/unix/tmp/x",
            "/ip4/1.2.3.4/tcp/1 /ip4/5.6.7.8/tcp/2", 7]
    assert usable_addrs(junk) == ()  # type: ignore[arg-type]
    assert split_maddr(f"/ip4/10.0.0.1/tcp/1/p2p/{A}") == (A, ("/ip4/10.0.0.1/tcp/1",))
    assert split_maddr("/ip4/10.0.0.1/tcp/1") is None
    assert split_maddr("/ip4/10.0.0.1/tcp/1/p2p/not-a-peer-id") is None


def test_a_peer_without_a_usable_address_or_a_malformed_id_is_not_recorded(tmp_path: Path) -> None:
    book = AddressBook(tmp_path, OWN)
    assert book.remember({A: ["junk"], "x" * 10: ["/ip4/1.2.3.4/tcp/1"]}, [A, "x" * 10]) == 0
    assert len(book) == 0


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        json.dumps({"v": 1, "peers": [{"peer_id": "../../etc", "addrs": ["/ip4/1.1.1.1/tcp/1"],
                                       "last_seen_unix": 1}]}).encode(),
        json.dumps({"v": 1, "peers": [{"peer_id": A, "addrs": ["/ip4/1.1.1.1/tcp/1"] * 9,
                                       "last_seen_unix": 1}]}).encode(),
        json.dumps({"v": 1, "peers": [{"peer_id": A, "addrs": ["/ip4/1.1.1.1/tcp/1"],
                                       "last_seen_unix": 1}] * (MAX_PEERS + 1)}).encode(),
        b" " * (MAX_FILE_BYTES + 1),
    ],
    ids=["not-json", "bad-peer-id", "too-many-addrs", "too-many-peers", "oversize"],
)
def test_a_bad_file_is_an_empty_book_with_a_warning(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / PEERS_FILE).write_bytes(content)
    book = AddressBook(tmp_path, OWN)
    assert len(book) == 0
    assert "no peers remembered" in caplog.text
    book.remember({A: ["/ip4/10.0.0.2/tcp/1"]}, [A], now=5.0)
    book.save()  # the bad file is replaced by a good one
    assert AddressBook(tmp_path, OWN).candidates(now=6.0) == [(A, ("/ip4/10.0.0.2/tcp/1",))]


def test_the_file_is_written_on_news_and_once_a_period_otherwise(tmp_path: Path) -> None:
    book = AddressBook(tmp_path, OWN)
    path = tmp_path / PEERS_FILE
    book.remember({A: ["/ip4/10.0.0.2/tcp/1"]}, [A], now=100.0)
    book.save()
    path.write_text(path.read_text())  # a marker: a later save rewrites through a rename
    marker = path.stat().st_ino
    book.remember({A: ["/ip4/10.0.0.2/tcp/1"]}, [A], now=101.0)
    book.save()
    assert path.stat().st_ino == marker  # nothing new: not written
    book.remember({A: ["/ip4/10.0.0.7/tcp/1"]}, [A], now=102.0)
    book.save()
    assert path.stat().st_ino != marker  # a new address: written
    marker = path.stat().st_ino
    book.remember({A: ["/ip4/10.0.0.7/tcp/1"]}, [A], now=102.0 + SAVE_PERIOD_S)
    book.save()
    assert path.stat().st_ino != marker  # a period later: written
    saved = json.loads(path.read_text())
    assert saved["peers"][0]["last_seen_unix"] == 102.0 + SAVE_PERIOD_S


def test_an_unwritable_state_dir_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    book = AddressBook(tmp_path / "missing", OWN)
    book.remember({A: ["/ip4/10.0.0.2/tcp/1"]}, [A])
    book.save()
    assert "cannot write" in caplog.text
