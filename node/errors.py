"""Exceptions raised by wanswarm.node.

Every error that crosses a module boundary of the node is a ``NodeError``; exceptions of
third-party libraries (hivemind, prometheus-client) are translated in the one adapter module
that imports the library. Errors that belong to one module's concept live in that module
(they are listed here so that the tree is read in one place). The CLI maps the tree to exit
statuses: ``ConfigError`` is 2 (a usage error), everything else 1. The tree::

    NodeError
    ├── ConfigError                  a setting is unusable (one line: the field, what it allows)
    ├── StateDirError                state directory unusable, or already in use by another daemon
    ├── RecordError                  a DHT record not matching its schema (dropped, never fatal)
    │   └── UnsupportedRecordVersion a record from a newer release (dropped, logged once)
    ├── DhtError                     the DHT failed (hivemind's exceptions, translated)
    │   ├── JoinError                could not start the DHT or reach any initial peer
    │   └── DhtTimeout               a DHT operation missed its deadline
    ├── ProbeError                   a ping got no answer in time
    ├── AveragingError               the stage's collaborative optimizer failed (averaging.py)
    ├── PseudoGradientError          an unusable DiLoCo pseudo-gradient (pseudo_gradient.py)
    ├── PushError                    a malformed progress push from a replica (progress_push.py)
    ├── CheckpointError              a stage checkpoint that does not fit the stage (checkpoint.py)
    ├── StageMemoryError             the stage does not fit the device's memory (memory.py)
    ├── StateTransferError           no donor could serve the stage's state (state_plan.py)
    │   └── UntrustedStateError      donors answered, but no state could be trusted
    ├── DataError                    the run's data unreadable or not the run's (datasets.py)
    ├── TokenizerError               the run's tokenizer missing or not the run's (tokenizer.py)
    ├── PretrainedError              a pretrained checkpoint that does not fit the run (hf_llama.py)
    ├── ExportError                  the stages' state could not be exported (export.py)
    ├── BadReply                     a server's reply broke the protocol (protocol.py)
    ├── HopFailed                    a hop failed on every attempt (hops.py)
    ├── DemoError                    the demo swarm did not start or lost a daemon (demo_daemons.py)
    ├── LabError                     the network lab could not be built or used (netlab.py)
    └── ControlError                 the control socket (``wanswarm status`` / ``leave``)
        ├── DaemonNotRunning         nothing listens on the control socket
        └── ControlProtocolError     a malformed request or response
"""

from __future__ import annotations


class NodeError(Exception):
    """Base class of every error raised by wanswarm.node."""


class ConfigError(NodeError):
    """A setting is unusable. The message is one line: ``field: what is allowed (got ...)``."""


class StateDirError(NodeError):
    """The state directory cannot be used, or another daemon already holds it."""


class RecordError(NodeError):
    """A DHT record that does not match its schema; such records are dropped."""


class UnsupportedRecordVersion(RecordError):
    """A record whose schema version is newer than this release understands."""


class DhtError(NodeError):
    """The DHT failed; hivemind's exceptions are translated into this."""


class JoinError(DhtError):
    """The DHT could not start, or none of the initial peers answered."""


class DhtTimeout(DhtError):
    """A DHT operation missed its deadline."""


class ProbeError(NodeError):
    """A ping to a peer failed or got no answer before its deadline."""


class ControlError(NodeError):
    """Talking to the daemon over its control socket failed."""


class DaemonNotRunning(ControlError):
    """No daemon listens on the control socket."""


class ControlProtocolError(ControlError):
    """A control request or response that does not match its schema."""
