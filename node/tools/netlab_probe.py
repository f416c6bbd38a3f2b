"""Small traffic programs for the network lab, run inside its hosts (standard library only).

Each command prints JSON lines on stdout; servers print ``ready`` once bound. Run by path
inside a lab host (``lab.popen(host, probe_argv("echo", "--port", "9000"))``)::

    echo --port P                  UDP and TCP on P: reply with the sender's address as seen
    ask --to A:P [--to ...]        from one UDP socket (or --tcp connections), ask every echo
                                   server at once what address it sees:
                                   {"local_port", "observed": [... or None]}
    ping --to A:P --count N        UDP round trips to an echo server: {"rtts_ms", "lost"}
    sink --port P                  count numbered datagrams until the sender's FIN, print the
                                   figures and answer every FIN with them until --timeout
    blast --to A:P --count N       numbered datagrams at --rate-pps, then FIN until the sink
                                   answers: the sink's figures plus the send time
    roundtrip --to A:P --count N   numbered datagrams to an echo server: {"sent", "answered"}
    punch --rendezvous A:P         learn this socket's public mapping from an echo server,
                                   print {"mapping"}, read the peer's "ip:port" on stdin, then
                                   send to it until both sides heard each other or --timeout
    bulk-server --port P           TCP: "send N" sends N bytes; "recv" reads to EOF and
                                   answers with the receive figures
    bulk --to A:P --bytes N --direction up|down
                                   one bulk TCP transfer through bulk-server: {"mbit_s", ...}

Every wait has a deadline (--timeout); a command that runs out of time still prints its
figures, with what it got.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import selectors
import socket
import struct
import sys
import time
from typing import Any

DATA = b"D"
FIN = b"F"
SEQ = struct.Struct("!Q")
MAX_DATAGRAM = 65535


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _out(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _observed(addr: tuple[str, int]) -> str:
    return f"{addr[0]}:{addr[1]}"


def cmd_echo(args: argparse.Namespace) -> int:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", args.port))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", args.port))
    tcp.listen(16)
    sel = selectors.DefaultSelector()
    sel.register(udp, selectors.EVENT_READ)
    sel.register(tcp, selectors.EVENT_READ)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            if key.fileobj is udp:
                data, addr = udp.recvfrom(MAX_DATAGRAM)
                reply = {"observed": _observed(addr), "echo": data[:200].decode("latin-1")}
                udp.sendto(json.dumps(reply).encode(), addr)
            else:
                conn, addr = tcp.accept()
                with conn:
                    conn.settimeout(args.timeout)
                    with contextlib.suppress(OSError):
                        conn.recv(1024)
                        conn.sendall(json.dumps({"observed": _observed(addr)}).encode() + b"\n")


def cmd_ask(args: argparse.Namespace) -> int:
    """Ask every ``--to`` at once; ``observed`` lists the answers in order (None: silence)."""
    dests = [_addr(dest) for dest in args.to]
    if args.tcp:
        with concurrent.futures.ThreadPoolExecutor(len(dests)) as pool:
            observed = list(pool.map(lambda dest: _ask_tcp(dest, args.timeout), dests))
        _out({"observed": observed})
        return 0
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", args.bind_port))
    answers = _ask_udp(sock, dests, time.monotonic() + args.timeout)
    _out({"local_port": sock.getsockname()[1], "observed": [answers.get(d) for d in dests]})
    return 0


def _ask_tcp(dest: tuple[str, int], timeout: float) -> str | None:
    try:
        with socket.create_connection(dest, timeout=timeout) as conn:
            conn.sendall(b"ask\n")
            return str(json.loads(conn.makefile().readline())["observed"])
    except (OSError, ValueError, KeyError):
        return None


def _ask_udp(sock: socket.socket, dests: list[tuple[str, int]], deadline: float
             ) -> dict[tuple[str, int], str]:
    """Ask echo servers (resent every 100 ms while unanswered) what address each sees."""
    answers: dict[tuple[str, int], str] = {}
    while len(answers) < len(set(dests)) and (left := deadline - time.monotonic()) > 0:
        for dest in dests:
            if dest not in answers:
                sock.sendto(b"ask", dest)
        resend = time.monotonic() + min(0.1, left)
        while len(answers) < len(set(dests)) and (wait := resend - time.monotonic()) > 0:
            sock.settimeout(wait)
            try:
                data, addr = sock.recvfrom(MAX_DATAGRAM)
            except TimeoutError:
                break
            with contextlib.suppress(ValueError, KeyError):
                reply = json.loads(data)
                if addr in dests and reply.get("echo") == "ask":
                    answers[addr] = str(reply["observed"])
    return answers


def cmd_ping(args: argparse.Namespace) -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dest = _addr(args.to)
    rtts: list[float] = []
    lost = 0
    for seq in range(args.count):
        tag = f"ping:{seq}"
        sent = time.monotonic()
        deadline = sent + args.timeout
        sock.sendto(tag.encode(), dest)
        answered = False
        while not answered and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data, _ = sock.recvfrom(MAX_DATAGRAM)
            except TimeoutError:
                break
            if json.loads(data).get("echo") == tag:  # a late answer to an earlier ping: skip
                rtts.append((time.monotonic() - sent) * 1000.0)
                answered = True
        lost += not answered
        if args.interval > 0:
            time.sleep(args.interval)  # pacing between pings, not synchronisation
    _out({"rtts_ms": rtts, "lost": lost})
    return 0


def cmd_sink(args: argparse.Namespace) -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind(("0.0.0.0", args.port))
    print("ready", flush=True)
    seen: set[int] = set()
    size = 0
    first = last = 0.0
    first_size = 0
    figures: dict[str, Any] | None = None
    deadline = time.monotonic() + args.timeout
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data, addr = sock.recvfrom(MAX_DATAGRAM)
        except TimeoutError:
            break
        now = time.monotonic()
        if figures is None and data[:1] == DATA and len(data) >= 1 + SEQ.size:
            seen.add(SEQ.unpack_from(data, 1)[0])
            if not first:
                first, first_size = now, len(data)
            last = now
            size += len(data)
        elif data[:1] == FIN:
            if figures is None:  # the first FIN ends the count; later ones get the same answer
                span = last - first
                figures = {
                    "received": len(seen),
                    "bytes": size,
                    "seconds": span,
                    "pps": (len(seen) - 1) / span if span > 0 else 0.0,
                    "payload_mbit_s": (size - first_size) * 8 / span / 1e6 if span > 0 else 0.0,
                }
                _out(figures)
            sock.sendto(json.dumps(figures).encode(), addr)
    if figures is None:
        _out({"received": len(seen), "bytes": size, "timed_out": True})
    return 0


def cmd_blast(args: argparse.Namespace) -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    dest = _addr(args.to)
    pad = b"x" * max(0, args.size - 1 - SEQ.size)
    start = time.monotonic()
    sent = 0
    send_errors = 0
    while sent < args.count:
        due = args.count if args.rate_pps <= 0 else min(
            args.count, int((time.monotonic() - start) * args.rate_pps) + 1
        )
        while sent < due:
            try:
                sock.sendto(DATA + SEQ.pack(sent) + pad, dest)
            except OSError:  # ENOBUFS: the local queue is full; the datagram is lost
                send_errors += 1
            sent += 1
        if sent < args.count:
            time.sleep(0.001)  # pacing: the next packets are not due yet
    send_seconds = time.monotonic() - start
    deadline = time.monotonic() + args.timeout
    figures: dict[str, Any] = {"timed_out": True}
    while (left := deadline - time.monotonic()) > 0:
        sock.sendto(FIN, dest)
        sock.settimeout(min(0.2, left))
        try:
            data, _ = sock.recvfrom(MAX_DATAGRAM)
        except TimeoutError:
            continue
        figures = json.loads(data)
        break
    figures.update(sent=sent, send_errors=send_errors, send_seconds=send_seconds)
    _out(figures)
    return 0


def cmd_roundtrip(args: argparse.Namespace) -> int:
    """Numbered datagrams to an echo server at ``--rate-pps``; count the answers.

    A path drops but never reorders (the lab's delay is constant), so once an end marker
    sent after the last datagram is answered, every answer that will come has come.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.setblocking(False)
    dest = _addr(args.to)
    answered: set[int] = set()

    def drain() -> bool:
        """Take the answers waiting; True once the end marker came back."""
        while True:
            try:
                data, _ = sock.recvfrom(MAX_DATAGRAM)
            except BlockingIOError:
                return False
            echo = str(json.loads(data).get("echo", ""))
            if echo == "rt:end":
                return True
            if echo.startswith("rt:"):
                answered.add(int(echo[3:]))

    start = time.monotonic()
    for seq in range(args.count):
        while time.monotonic() < start + seq / args.rate_pps:
            drain()
            time.sleep(0.0005)  # pacing: the next datagram is not due yet
        sock.sendto(f"rt:{seq}".encode(), dest)
    deadline = time.monotonic() + args.timeout
    ended = False
    while not ended and time.monotonic() < deadline:
        sock.sendto(b"rt:end", dest)
        marker_due = time.monotonic() + 0.2
        while not ended and time.monotonic() < min(marker_due, deadline):
            select_timeout = max(0.0, min(marker_due, deadline) - time.monotonic())
            readable = _wait_readable(sock, select_timeout)
            ended = readable and drain()
    _out({"sent": args.count, "answered": len(answered), "timed_out": not ended})
    return 0


def _wait_readable(sock: socket.socket, timeout: float) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        return bool(sel.select(timeout))


def cmd_punch(args: argparse.Namespace) -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", args.bind_port))
    rendezvous = _addr(args.rendezvous)
    mapping = _ask_udp(sock, [rendezvous], time.monotonic() + args.timeout).get(rendezvous)
    _out({"mapping": mapping, "local_port": sock.getsockname()[1]})
    line = sys.stdin.readline().strip()
    if not line:
        _out({"ok": False, "error": "no peer address on stdin"})
        return 1
    peer = _addr(line)
    start = time.monotonic()
    deadline = start + args.timeout
    heard_from: str | None = None
    peer_heard_us = False
    next_send = 0.0
    while (left := deadline - time.monotonic()) > 0:
        now = time.monotonic()
        if now >= next_send:
            sock.sendto(b"punch:1" if heard_from else b"punch:0", peer)
            next_send = now + args.interval
        sock.settimeout(max(0.0, min(left, next_send - time.monotonic())))
        try:
            data, addr = sock.recvfrom(MAX_DATAGRAM)
        except TimeoutError:
            continue
        if data.startswith(b"punch:"):
            heard_from = _observed(addr)
            peer_heard_us = peer_heard_us or data == b"punch:1"
            if peer_heard_us:
                for _ in range(3):  # so that the peer hears that we heard it
                    sock.sendto(b"punch:1", peer)
                break
    ok = heard_from is not None and peer_heard_us
    _out({"ok": ok, "heard_from": heard_from, "seconds": time.monotonic() - start})
    return 0


def cmd_bulk_server(args: argparse.Namespace) -> int:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", args.port))
    srv.listen(4)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn, contextlib.suppress(OSError):
            conn.settimeout(args.timeout)
            request = _read_line(conn).split()
            if request[:1] == ["send"]:
                _send_bytes(conn, int(request[1]))
            elif request[:1] == ["recv"]:
                figures = _receive_all(conn)
                conn.sendall(json.dumps(figures).encode() + b"\n")


def _read_line(conn: socket.socket) -> str:
    """One request line, read a byte at a time so that none of the data after it is taken."""
    line = bytearray()
    while (byte := conn.recv(1)) and byte != b"\n" and len(line) < 1024:
        line += byte
    return line.decode()


def _send_bytes(conn: socket.socket, count: int) -> None:
    chunk = b"\0" * 65536
    while count > 0:
        count -= conn.send(chunk[: min(count, len(chunk))])


def _receive_all(conn: socket.socket) -> dict[str, Any]:
    size = 0
    first = last = 0.0
    first_size = 0
    while data := conn.recv(1 << 20):
        now = time.monotonic()
        if not first:
            first, first_size = now, len(data)
        last = now
        size += len(data)
    span = last - first
    rate = (size - first_size) * 8 / span / 1e6 if span > 0 else 0.0
    return {"bytes": size, "seconds": span, "mbit_s": rate}


def cmd_bulk(args: argparse.Namespace) -> int:
    with socket.create_connection(_addr(args.to), timeout=args.timeout) as conn:
        if args.direction == "down":
            conn.sendall(f"send {args.bytes}\n".encode())
            figures = _receive_all(conn)
        else:
            conn.sendall(b"recv\n")
            _send_bytes(conn, args.bytes)
            conn.shutdown(socket.SHUT_WR)
            figures = json.loads(conn.makefile().readline())
    figures["direction"] = args.direction
    _out(figures)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="traffic programs for the network lab",
        epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, timeout: float) -> argparse.ArgumentParser:
        p = sub.add_parser(name)
        p.add_argument("--timeout", type=float, default=timeout, help="seconds, every wait")
        return p

    p = command("echo", 5.0)
    p.add_argument("--port", type=int, required=True)
    p = command("ask", 5.0)
    p.add_argument("--to", action="append", required=True)
    p.add_argument("--bind-port", type=int, default=0)
    p.add_argument("--tcp", action="store_true")
    p = command("ping", 2.0)
    p.add_argument("--to", required=True)
    p.add_argument("--count", type=int, default=10)
    p.add_argument("--interval", type=float, default=0.0)
    p = command("sink", 60.0)
    p.add_argument("--port", type=int, required=True)
    p = command("blast", 10.0)
    p.add_argument("--to", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--size", type=int, default=1200)
    p.add_argument("--rate-pps", type=float, default=0.0, help="0: as fast as possible")
    p = command("roundtrip", 5.0)
    p.add_argument("--to", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--rate-pps", type=float, default=1000.0)
    p = command("punch", 5.0)
    p.add_argument("--rendezvous", required=True)
    p.add_argument("--bind-port", type=int, default=0)
    p.add_argument("--interval", type=float, default=0.02)
    p = command("bulk-server", 30.0)
    p.add_argument("--port", type=int, required=True)
    p = command("bulk", 30.0)
    p.add_argument("--to", required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--direction", choices=("up", "down"), required=True)
    args = parser.parse_args(argv)
    handler = {
        "echo": cmd_echo, "ask": cmd_ask, "ping": cmd_ping, "sink": cmd_sink,
        "blast": cmd_blast, "roundtrip": cmd_roundtrip, "punch": cmd_punch,
        "bulk-server": cmd_bulk_server, "bulk": cmd_bulk,
    }[args.command]
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        return handler(args)
    return 1


PATH = os.path.abspath(__file__)

if __name__ == "__main__":
    sys.exit(main())
