"""systemd's notify protocol (sd_notify(3)): READY=1, STATUS=..., WATCHDOG=1, STOPPING=1.

A datagram of newline-separated ``KEY=value`` lines to the AF_UNIX socket named by
``$NOTIFY_SOCKET``; a leading ``@`` names a socket in the abstract namespace. Without
``$NOTIFY_SOCKET`` (not run by systemd with Type=notify) :func:`notifier_from_env` returns None.
Sending never raises: a lost notification is logged, the daemon carries on (systemd's
watchdog then judges it).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from ..logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class SdNotifier:
    """Sends notifications to one socket address."""

    address: str  # a path, or "\0name" for the abstract namespace
    watchdog_interval: float | None  # seconds between WATCHDOG=1 pings; None: no watchdog

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines (keyword names are upper-cased); False if it failed."""
        message = "\n".join(f"{key.upper()}={value}" for key, value in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)
                sock.sendto(message, self.address)
        except OSError as exc:
            log.warning("sd_notify to %r failed: %s", self.address, exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send(ready=1, status=status, mainpid=os.getpid())

    def status(self, status: str) -> bool:
        return self.send(status=status)

    def watchdog(self) -> bool:
        return self.send(watchdog=1)

    def stopping(self, status: str) -> bool:
        return self.send(stopping=1, status=status)


def notifier_from_env(environ: Mapping[str, str] | None = None) -> SdNotifier | None:
    """The notifier for ``$NOTIFY_SOCKET``, with the watchdog interval from ``$WATCHDOG_USEC``.

    The watchdog pings every half of WATCHDOG_USEC (sd_watchdog_enabled(3) recommends that),
    and only when ``$WATCHDOG_PID`` is unset or names this process.
    """
    environ = os.environ if environ is None else environ
    address = environ.get("NOTIFY_SOCKET", "")
    if not address or not (address.startswith("/") or address.startswith("@")):
        return None  # unset, or a vsock: address, which this daemon does not speak
    if address.startswith("@"):
        address = "\0" + address[1:]
    interval = None
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
        interval = int(usec) / 1e6 / 2
    return SdNotifier(address, interval)
