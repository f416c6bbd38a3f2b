"""wanswarm.node: the volunteer daemon (CLI, config, DHT membership, stage server, trainer)."""

__version__ = "0.1.0"
