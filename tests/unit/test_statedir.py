"""The state directory: private creation, one daemon at a time, a persistent identity."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from wanswarm.node.errors import StateDirError
from wanswarm.node.service.statedir import StateDirLock, load_identity, prepare_state_dir


def test_created_private_and_identity_persists(tmp_path: Path) -> None:
    state = tmp_path / "a" / "state"
    prepare_state_dir(state)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    first, path = load_identity(state)
    assert path == state / "identity.key" and stat.S_IMODE(path.stat().st_mode) == 0o600
    again, _ = load_identity(state)
    assert again.peer_id == first.peer_id  # a restarted daemon keeps its peer id


def test_a_leaked_key_is_refused(tmp_path: Path) -> None:
    _, path = load_identity(tmp_path)
    os.chmod(path, 0o644)
    with pytest.raises(StateDirError, match="chmod 600"):
        load_identity(tmp_path)


def test_one_daemon_per_state_dir(tmp_path: Path) -> None:
    first, second = StateDirLock(tmp_path), StateDirLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(
            StateDirError, match=f"pid {os.getpid()}.*wanswarm leave --state-dir {tmp_path}"
        ):
            second.acquire()
    finally:
        first.release()
    second.acquire()  # free again once the holder is gone
    second.release()


def test_a_file_in_the_way_is_reported(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StateDirError, match="cannot create state dir"):
        prepare_state_dir(blocker / "state")
