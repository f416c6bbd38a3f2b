"""The state directory: created private (0700), held by one daemon at a time, home of the identity.

Layout::

    <state_dir>/identity.key    Ed25519 key (libp2p protobuf, mode 0600): DHT and QUIC identity
    <state_dir>/control.sock    control socket (mode 0600), while the daemon runs
    <state_dir>/daemon.lock     flock(2)-held by the running daemon; holds its pid

Two daemons on one state directory would share a peer id, which the DHT cannot tell apart;
the lock refuses the second one with a message naming the first one's pid.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from ...transport.errors import IdentityError
from ...transport.identity import Identity, load_or_create_identity
from ..errors import StateDirError
from ..logs import get_logger

log = get_logger(__name__)

IDENTITY_FILE = "identity.key"
LOCK_FILE = "daemon.lock"


def prepare_state_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) if needed; warn when an existing one is open to others."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        mode = path.stat().st_mode
    except OSError as exc:
        raise StateDirError(f"cannot create state dir {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(mode):
        raise StateDirError(f"state dir {path} is not a directory")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning(
            "state dir %s is writable by group or others (mode %o); run 'chmod 700 %s'",
            path,
            stat.S_IMODE(mode),
            path,
        )


class StateDirLock:
    """An exclusive, non-blocking flock on ``<state_dir>/daemon.lock``, released on close/exit."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StateDirError(f"cannot open {self.path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateDirError(
                f"another wanswarm daemon (pid {holder}) uses state dir {self.path.parent}; "
                f"stop it with 'wanswarm leave --state-dir {self.path.parent}' "
                "or pick another --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def load_identity(state_dir: Path) -> tuple[Identity, Path]:
    """The node's identity from ``<state_dir>/identity.key``, created on first start."""
    path = state_dir / IDENTITY_FILE
    try:
        identity, created = load_or_create_identity(path)
    except IdentityError as exc:
        raise StateDirError(str(exc)) from None
    if created:
        log.info("created a new identity %s in %s", identity.peer_id, path)
    return identity, path


# systemd's StateDirectory=wanswarm of configs/systemd/wanswarm.service
SYSTEM_STATE_DIR = Path("/var/lib/wanswarm")


def client_control_socket(
    configured: Path, default: Path, system_dir: Path = SYSTEM_STATE_DIR
) -> Path:
    """The control socket 'wanswarm status'/'leave' talk to.

    ``configured`` is the socket the config resolves to and ``default`` the one it resolves
    to when nothing names a state directory. When nothing did (``configured == default``), no
    daemon listens there, and a system service's socket exists in ``system_dir``, that one:
    ``sudo wanswarm status`` then finds the service without ``--state-dir``.
    """
    if configured != default or configured.exists():
        return configured
    system = system_dir / "control.sock"
    try:
        if system.exists():
            return system
    except OSError:  # not ours to read (the service's directory is 0700): keep the default
        pass
    return configured
