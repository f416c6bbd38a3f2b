"""The node's configuration: one frozen pydantic tree composed from its owners' sections.

Precedence, lowest first: defaults < TOML file (``--config``) < environment
(``WANSWARM__SECTION__KEY``) < command-line flags (``--set section.key=value`` and the CLI's
shortcuts); layers.py builds the tree and words the one-line errors, e.g.
``dht.port: must be ≤ 65535 (got 70000) [from WANSWARM__DHT__PORT]``.

Sections live next to their owners (log in logs.py, control in control.py, metrics in
metrics.py, prober in prober.py, transport in wanswarm.transport.config, stage_server,
averaging and trainer in their modules); the node, DHT and rebalance sections live in
sections.py, light, because the CLI's client commands (``status``, ``leave``) read them without
importing this module's heavier section owners.

``python -m wanswarm.node.config.node_config --dump-toml`` prints the commented template that
is committed as configs/node.toml (see template.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ...transport.config import TransportConfig
from ..control import ControlConfig
from ..errors import ConfigError
from ..logs import LogConfig
from ..membership.prober import ProberConfig
from ..metrics import MetricsConfig
from ..stage.averaging import AveragingConfig
from ..stage.server_config import StageServerConfig
from ..training.trainer_config import TrainerConfig
from .layers import (
    ENV_PREFIX,
    Override,
    build,
    default_state_dir,
    describe_validation_error,
    env_overrides,
    parse_assignment,
)
from .sections import (
    RUN_NAME_PATTERN,
    DhtConfig,
    NodeSection,
    RebalanceConfig,
    check_host,
    resolved_paths,
)


class NodeConfig(BaseModel):
    """Every setting of a wanswarm daemon."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node: NodeSection = Field(default_factory=NodeSection)
    dht: DhtConfig = Field(default_factory=DhtConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    prober: ProberConfig = Field(default_factory=ProberConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    stage_server: StageServerConfig = Field(default_factory=StageServerConfig)
    rebalance: RebalanceConfig = Field(default_factory=RebalanceConfig)
    averaging: AveragingConfig = Field(default_factory=AveragingConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)

    @property
    def state_dir(self) -> Path:
        """The resolved state directory (load_config always sets it)."""
        if self.node.state_dir is None:
            raise ConfigError("node.state_dir: not resolved; build the config with load_config()")
        return self.node.state_dir

    @property
    def control_socket(self) -> Path:
        return (
            self.control.socket
            if self.control.socket is not None
            else self.state_dir / "control.sock"
        )


def load_config(
    *,
    file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Sequence[Override] = (),
) -> NodeConfig:
    """Build the root config from defaults, the file, the environment and the overrides.

    The returned tree has ``node.state_dir`` and ``control.socket`` resolved to absolute paths.
    Raises ConfigError (one line) on any problem.
    """
    environ = os.environ if environ is None else environ
    config = build(NodeConfig, file=file, environ=environ, overrides=overrides)
    return config.model_copy(update=resolved_paths(config.node, config.control, environ))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m wanswarm.node.config.node_config --dump-toml``: print the commented template."""
    from .template import render_template

    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["--dump-toml"]:
        sys.stderr.write("usage: python -m wanswarm.node.config.node_config --dump-toml\n")
        return 2
    sys.stdout.write(render_template(NodeConfig))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "ENV_PREFIX",
    "RUN_NAME_PATTERN",
    "check_host",
    "DhtConfig",
    "NodeConfig",
    "NodeSection",
    "Override",
    "RebalanceConfig",
    "default_state_dir",
    "describe_validation_error",
    "env_overrides",
    "load_config",
    "parse_assignment",
]
