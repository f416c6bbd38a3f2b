"""``wanswarm``: the command line (a shell: parse, build the config, call one function).

Exit statuses: 0 success, 1 runtime failure (no daemon, could not join, ...), 2 usage or
config error (one line on stderr naming the field, never a traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from . import __version__
from .config.layers import Override, default_state_dir, parse_assignment
from .config.sections import ClientConfig, load_client_config
from .control import ControlClient
from .errors import ConfigError, NodeError
from .service.completion import completion_script
from .service.statedir import client_control_socket
from .status import render_text
from .tools import model_cli

if TYPE_CHECKING:
    from .config.node_config import NodeConfig

PROG = "wanswarm"

MAIN_EPILOG = """\
examples:
  start a new swarm on this machine (foreground; Ctrl-C leaves gracefully):
    wanswarm join --host 0.0.0.0 --dht-port 31337
  join it from another machine, using an address printed by 'wanswarm status':
    wanswarm join --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...
  look at the running daemon, then make it leave:
    wanswarm status
    wanswarm leave

Settings: defaults < --config FILE < environment WANSWARM__SECTION__KEY < flags.
Every setting is listed, with its default, in configs/node.toml ('wanswarm config --defaults').
"""

JOIN_EPILOG = """\
examples:
  wanswarm join                                   # new swarm, state in ~/.local/share/wanswarm
  wanswarm join --initial-peers /ip4/10.0.0.5/tcp/31337/p2p/12D3KooW... --run demo
  wanswarm join --config node.toml --set prober.period=5 --set log.level=DEBUG
  wanswarm join --state-dir /tmp/b --host 127.0.0.1 --dht-port 0   # a second node on one machine
  WANSWARM__DHT__INITIAL_PEERS=/ip4/10.0.0.5/tcp/31337/p2p/12D3KooW... wanswarm join

SIGTERM, SIGINT and 'wanswarm leave' all take the graceful path: announce 'draining',
finish in-flight work (up to node.shutdown_timeout), withdraw the DHT record, exit 0.
A second signal skips the rest of the drain.
"""

STATUS_EPILOG = """\
examples:
  wanswarm status                       # the daemon using ~/.local/share/wanswarm
  wanswarm status --state-dir /tmp/b    # another daemon on the same machine
  wanswarm status --json | jq -r '.dht_addrs[0]'   # an address for --initial-peers
  sudo wanswarm status                  # the system service (/var/lib/wanswarm), when no
                                        # daemon of this user runs

Exits 1 when no daemon is running.
"""

LEAVE_EPILOG = """\
examples:
  wanswarm leave                        # drain, withdraw, wait for the daemon to exit
  wanswarm leave --state-dir /tmp/b --timeout 60
  wanswarm leave --no-wait              # ask, and return at once

Exits 0 once the daemon has exited, 1 when no daemon is running or it outlives --timeout.
"""

DEMO_EPILOG = """\
examples:
  wanswarm demo                           # 3 stages x 2 replicas on loopback, the default tiny run
  wanswarm demo --wan wan                 # all traffic (QUIC, libp2p) across a 100 ms WAN
  wanswarm demo --replicas 1 --tokens 200000 --json   # short; ends with one JSON line
  wanswarm demo --duration 60 --keep      # keep the daemons' state dirs and logs
  wanswarm demo --chaos --json            # SIGKILL and restart daemons while it trains
Ctrl-C stops every daemon gracefully (SIGTERM, then SIGKILL after the shutdown timeout).

A daemon that dies is reported (which, when, what is left of its stage, its log) and
training goes on; a stage left without a server is reported with how long it stayed empty.
--chaos plan (seeded by --chaos-seed, the same for the same seed): the first SIGKILL
--chaos-period/2 s into training, then one every --chaos-period s on average (each gap
0.5-1.5x); the victim is random among the daemons up whose stage keeps another replica up
(a restarted daemon counts as down until 30 s after its restart), so a stage is never
left empty unless --chaos-empty; each victim restarts --chaos-down s later with its own
state dir (same identity; it downloads its stage's state from the replicas). When training
ends, every killed daemon is restarted before the final evaluation.

At the end the loss curve (the swarm's training and validation loss against the
single-process reference, trained alongside in one thread and cached under
~/.cache/wanswarm/reference) is written as a PNG and its path printed.
"""
NETCHECK_EPILOG = """\
examples:
  wanswarm netcheck --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...
  wanswarm netcheck --config node.toml --json

Uses a throwaway identity and DHT port, so it runs beside a daemon (then it checks from
another UDP port: a symmetric NAT may map it differently). Needs at least one peer that
others can dial. Behind a home NAT a node needs nothing configured: see docs/nat.md.
Exits 1 when no peer answered.
"""
PAUSE_EPILOG = """\
examples:
  wanswarm pause                        # stop taking work; stay in the swarm, keep state
  wanswarm resume                       # take work again
  wanswarm pause --state-dir /tmp/b     # another daemon on the same machine

'wanswarm status' shows 'paused' while it holds. Exits 1 when no daemon is running.
"""
COMPLETION_EPILOG = """\
examples:
  wanswarm completion bash > ~/.local/share/bash-completion/completions/wanswarm
  wanswarm completion zsh > "${fpath[1]}/_wanswarm"     # then: autoload -U compinit && compinit
"""
CONFIG_EPILOG = """\
examples:
  wanswarm config --defaults > node.toml    # every setting with its description
  wanswarm config --config node.toml --set dht.port=31337   # the effective settings
"""


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help="TOML config file (see configs/node.toml)"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help=(
            "state directory (identity.key, control.sock); "
            "default $STATE_DIRECTORY or ~/.local/share/wanswarm"
        ),
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="set any config key, e.g. --set dht.port=31337 (repeatable)",
    )


def _add_join_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--initial-peers", action="extend", nargs="+", metavar="MADDR",
        help="multiaddrs of running peers, each ending in /p2p/<peer id>; none: start a new swarm",
    )
    parser.add_argument("--run", metavar="NAME", help="name of the training run to join (node.run)")
    parser.add_argument(
        "--host", metavar="ADDR", help="bind address of the DHT (TCP) and QUIC (UDP) sockets"
    )
    parser.add_argument(
        "--dht-port", type=int, metavar="PORT", help="TCP port of the DHT; 0 picks a free one"
    )
    parser.add_argument(
        "--quic-port", type=int, metavar="PORT", help="UDP port of QUIC; 0 picks a free one"
    )
    parser.add_argument(
        "--log-format", choices=["text", "json"], help="log line format (log.format)"
    )
    parser.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="least severe level logged (log.level)",
    )


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Train one transformer together with volunteers over the internet (SWARM-style)."
        ),
        epilog=MAIN_EPILOG,
        formatter_class=fmt,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    join = sub.add_parser(
        "join",
        help="run a node in the foreground until it leaves",
        epilog=JOIN_EPILOG,
        formatter_class=fmt,
        description=(
            "Run a node: join (or start) the swarm, serve, and leave gracefully on "
            "SIGTERM/SIGINT."
        ),
    )
    _add_config_flags(join)
    _add_join_flags(join)

    status = sub.add_parser(
        "status", help="show the running daemon's peer id, state, addresses and peers",
        epilog=STATUS_EPILOG, formatter_class=fmt,
        description="Ask the daemon of a state directory about itself and the peers it sees.",
    )
    _add_config_flags(status)
    status.add_argument("--json", action="store_true", help="print the status as JSON")

    leave = sub.add_parser(
        "leave", help="make the running daemon leave gracefully and wait for it to exit",
        epilog=LEAVE_EPILOG, formatter_class=fmt,
        description="Same path as SIGTERM: drain, withdraw the DHT record, exit.",
    )
    _add_config_flags(leave)
    leave.add_argument(
        "--timeout", type=float, metavar="SECONDS",
        help="give up waiting after this long (default: the daemon's shutdown_timeout + 60)",
    )
    leave.add_argument(
        "--no-wait", action="store_true", help="return once the daemon accepted the request"
    )

    # no torch: the module imports it only when it runs
    from .tools.demo import DEMO_DURATION_S, DEMO_TOKENS

    demo = sub.add_parser(
        "demo", help="train the default run on a local swarm of daemons and show its progress",
        epilog=DEMO_EPILOG, formatter_class=fmt,
        description=(
            "Start replicas x stages daemons on 127.0.0.1 (optionally behind the WAN emulator), "
            "measure validation loss through the swarm, train until --tokens or --duration, "
            "measure again, print per-stage figures, stop every daemon."
        ),
    )
    demo.add_argument(
        "--replicas", type=int, default=2, metavar="N", help="daemons per stage (default 2)"
    )
    demo.add_argument(
        "--duration",
        type=float,
        default=DEMO_DURATION_S,
        metavar="SECONDS",
        help=f"stop training after this long even if --tokens is not reached "
        f"(default {DEMO_DURATION_S:.0f})",
    )
    demo.add_argument("--tokens", type=int, default=DEMO_TOKENS, metavar="N",
                      help="stop once the trainers completed this many tokens "
                      f"(default {DEMO_TOKENS})")
    demo.add_argument("--chaos", action="store_true",
                      help="SIGKILL and restart daemons on a seeded plan while training "
                      "(see below)")
    demo.add_argument("--chaos-seed", type=int, default=0, metavar="N",
                      help="seed of the --chaos plan (default 0)")
    demo.add_argument("--chaos-period", type=float, default=60.0, metavar="SECONDS",
                      help="mean seconds between two --chaos kills (default 60)")
    demo.add_argument("--chaos-down", type=float, default=20.0, metavar="SECONDS",
                      help="seconds a killed daemon stays down before its restart (default 20)")
    demo.add_argument("--chaos-empty", action="store_true",
                      help="let --chaos kill the last replica of a stage (training then waits)")
    demo.add_argument("--loss-curve", type=Path, metavar="PATH",
                      help="where to write the loss curve PNG (default: "
                      "wanswarm-demo-<date>-<time>.png in the current directory)")
    demo.add_argument("--no-loss-curve", action="store_true",
                      help="no loss curve and no single-process reference")
    demo.add_argument(
        "--wan",
        choices=["lan", "home", "wan", "bad"],
        help="put a WAN emulator before every daemon's QUIC and DHT ports (its stage "
        "traffic, DHT and averaging share the emulated link)",
    )
    demo.add_argument(
        "--eval-windows",
        type=int,
        default=64,
        metavar="N",
        help="validation windows evaluated (default 64)",
    )
    demo.add_argument(
        "--json", action="store_true", help="end with one JSON line of results (progress on stderr)"
    )
    demo.add_argument("--keep", action="store_true", help="keep the temporary state dirs and logs")
    demo.add_argument(
        "--run-spec",
        type=Path,
        metavar="PATH",
        help="run spec TOML for every daemon (default: the embedded tiny run)",
    )
    demo.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a config setting for every daemon, e.g. --set trainer.max_in_flight=4 (repeatable)",
    )
    netcheck = sub.add_parser(
        "netcheck",
        help="show how the swarm sees this host: public address, NAT, reachability, advice",
        epilog=NETCHECK_EPILOG, formatter_class=fmt,
        description=(
            "Ask peers of the run for the address they see this host at, whether they can dial "
            "it back over UDP (QUIC) and TCP (DHT), which rendezvous or relay a node here "
            "would use, and what to forward on the router if anything."
        ),
    )
    _add_config_flags(netcheck)
    _add_join_flags(netcheck)
    netcheck.add_argument("--json", action="store_true", help="print one JSON object")

    selftest = sub.add_parser(
        "selftest",
        help="check that this machine can serve a stage: device, precision, kernels, a stage",
        formatter_class=fmt,
        description=(
            "Check the device a stage server would use, the run's precision there, every "
            "codec's kernels against the reference bit for bit, and a forward/backward of "
            "one stage (docs/gpu.md). Exits 1 when a check fails."
        ),
    )
    _add_config_flags(selftest)
    selftest.add_argument("--device", help="'auto', 'cpu' or 'cuda[:N]' (default: the config's)")
    selftest.add_argument(
        "--precision", choices=["auto", "fp32", "bf16", "fp16"], help="override the run spec's"
    )
    selftest.add_argument(
        "--require-triton", action="store_true",
        help="fail when the Triton kernels do not run (instead of a warning)",
    )
    selftest.add_argument(
        "--once", type=Path, metavar="FILE",
        help="do nothing when FILE exists; create it after a pass (a HEALTHCHECK's first run)",
    )
    selftest.add_argument("--json", action="store_true", help="print one JSON object")

    for name, text in (
        ("pause", "stop taking work (stay in the swarm, keep state) until 'wanswarm resume'"),
        ("resume", "take work again after 'wanswarm pause'"),
    ):
        paused = sub.add_parser(
            name, help=text, epilog=PAUSE_EPILOG, formatter_class=fmt,
            description=text[0].upper() + text[1:] + ".",
        )
        _add_config_flags(paused)

    completion = sub.add_parser(
        "completion", help="print a shell completion script (bash or zsh)",
        epilog=COMPLETION_EPILOG, formatter_class=fmt,
        description="Print a completion script for the shell, generated from these commands.",
    )
    completion.add_argument("shell", choices=["bash", "zsh"], help="the shell")

    config = sub.add_parser(
        "config", help="print the effective settings, or every default with its description",
        epilog=CONFIG_EPILOG, formatter_class=fmt,
        description="Print the settings that 'wanswarm join' with the same flags would use.",
    )
    _add_config_flags(config)
    _add_join_flags(config)
    config.add_argument(
        "--defaults", action="store_true", help="print the commented template of all settings"
    )
    model_cli.add_commands(sub, fmt)  # tokenizer, fingerprint, export (tools/model_cli.py)
    return parser


def _overrides(args: argparse.Namespace) -> list[Override]:
    out = [parse_assignment(item) for item in args.set]
    typed = [
        ("initial_peers", "dht.initial_peers", "--initial-peers"),
        ("run", "node.run", "--run"),
        ("dht_port", "dht.port", "--dht-port"),
        ("quic_port", "transport.port", "--quic-port"),
        ("log_format", "log.format", "--log-format"),
        ("log_level", "log.level", "--log-level"),
    ]
    for attr, path, flag in typed:
        value = getattr(args, attr, None)
        if value is not None:
            out.append(Override(path, value, flag, raw=False))
    if getattr(args, "host", None) is not None:
        out.append(Override("dht.host", args.host, "--host", raw=False))
        out.append(Override("transport.host", args.host, "--host", raw=False))
    if args.state_dir is not None:
        out.append(Override("node.state_dir", args.state_dir, "--state-dir", raw=False))
    return out


def _load(args: argparse.Namespace) -> NodeConfig:
    from .config.node_config import (
        load_config,  # composes every section, torch-importing owners included
    )

    return load_config(file=args.config, environ=os.environ, overrides=_overrides(args))


def _load_client(args: argparse.Namespace) -> ClientConfig:
    """What 'status' and 'leave' need (state dir, socket), without importing hivemind or torch."""
    return load_client_config(file=args.config, environ=os.environ, overrides=_overrides(args))


def _control_client(args: argparse.Namespace) -> ControlClient:
    """The client of the daemon the flags name, else of a system service when no user-level
    daemon runs (service/statedir.py)."""
    config = _load_client(args)
    default = Path(os.path.abspath(default_state_dir(os.environ).expanduser())) / "control.sock"
    path = client_control_socket(config.control_socket, default)
    return ControlClient(path, timeout=config.control.request_timeout)


def _join(args: argparse.Namespace) -> int:
    config = _load(args)
    from .daemon import exit_past_abandoned_threads, run_daemon  # hivemind, torch: 'join' only
    from .swarm_node import build_components

    code = run_daemon(config, build_components(config))
    exit_past_abandoned_threads(code)
    return code


def _status(args: argparse.Namespace) -> int:
    report = _control_client(args).status()
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        print(render_text(report), end="")
    return 0


def _leave(args: argparse.Namespace) -> int:
    client = _control_client(args)
    ack = client.leave()
    if ack.already_leaving:
        print(f"daemon (pid {ack.pid}) was already leaving; asked it to hurry", flush=True)
    else:
        print(
            f"daemon (pid {ack.pid}) is leaving: draining for up to {ack.shutdown_timeout_s:.0f}s",
            flush=True,
        )
    if args.no_wait:
        return 0
    timeout = args.timeout if args.timeout is not None else ack.shutdown_timeout_s + 60.0
    if client.wait_until_gone(
        ack.pid, timeout, on_progress=lambda line: print(f"  {line}", flush=True)
    ):
        print("left")
        return 0
    print(f"{PROG}: daemon (pid {ack.pid}) still running after {timeout:.0f}s", file=sys.stderr)
    return 1


def _pause(args: argparse.Namespace) -> int:
    ack = _control_client(args).pause(args.command == "pause")
    told = ", ".join(ack.components) or "no component takes work"
    if ack.paused:
        print(f"daemon (pid {ack.pid}) paused: taking no work ({told}); "
              "'wanswarm resume' takes it again")
    else:
        print(f"daemon (pid {ack.pid}) resumed ({told})")
    return 0


def _completion(args: argparse.Namespace) -> int:
    print(completion_script(args.shell, build_parser(), PROG), end="")
    return 0


def _config(args: argparse.Namespace) -> int:
    from .config.node_config import NodeConfig
    from .config.template import render_template, render_values

    if args.defaults:
        print(render_template(NodeConfig), end="")
        return 0
    print(render_values(_load(args)), end="")
    return 0


def _demo(args: argparse.Namespace) -> int:
    for item in args.set:
        parse_assignment(item)  # a usage error now, not six daemons failing later
    if args.replicas < 1 or args.duration <= 0 or args.tokens < 1 or args.eval_windows < 1:
        raise ConfigError("--replicas, --tokens and --eval-windows must be >= 1, --duration > 0")
    if args.chaos_period <= 0 or args.chaos_down <= 0:
        raise ConfigError("--chaos-period and --chaos-down must be > 0")
    from .tools.demo import DemoOptions, demo_chaos, loss_curve_path, run_demo  # imports torch

    return run_demo(
        DemoOptions(
            replicas=args.replicas,
            duration_s=args.duration,
            tokens=args.tokens,
            wan=args.wan,
            json=args.json,
            keep=args.keep,
            eval_windows=args.eval_windows,
            extra=tuple(args.set),
            run_spec=args.run_spec,
            chaos=demo_chaos(args.chaos, args.chaos_period, args.chaos_down, args.chaos_empty),
            chaos_seed=args.chaos_seed,
            loss_curve=None if args.no_loss_curve else loss_curve_path(args.loss_curve),
        )
    )


def _netcheck(args: argparse.Namespace) -> int:
    config = _load(args)
    from .tools.netcheck import run_netcheck  # imports hivemind: only for 'netcheck'

    return run_netcheck(config, as_json=args.json)


def _selftest(args: argparse.Namespace) -> int:
    config = _load(args)
    from .tools.selftest import run_selftest  # imports torch: only for 'selftest'

    return run_selftest(
        config, device=args.device, precision=args.precision,
        require_triton=args.require_triton, as_json=args.json, once=args.once,
    )


COMMANDS = {
    "join": _join,
    "status": _status,
    "leave": _leave,
    "config": _config,
    "demo": _demo,
    "netcheck": _netcheck,
    "selftest": _selftest,
    "pause": _pause,
    "resume": _pause,
    "completion": _completion,
    **model_cli.COMMANDS,
}


def main(argv: Sequence[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")  # a C locale must not turn '≤' into a traceback
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"{PROG}: config error: {exc}", file=sys.stderr)
        return 2
    except NodeError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. 'wanswarm status --json | head'
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
