"""TransportConfig: every setting of wanswarm.transport, one frozen pydantic tree.

The node's root config (node/config.py) embeds this tree as its ``transport`` section;
transport components receive only this tree or their own sub-section of it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LimitsConfig(_Section):
    """Hard limits on what a peer may send us (checked before allocating anything)."""

    max_header_bytes: int = Field(
        64 * 1024, ge=256, le=16 * 1024 * 1024, description="Largest request/response header, bytes."
    )
    max_tensors: int = Field(64, ge=1, le=4096, description="Most tensors in one message.")
    max_tensor_elements: int = Field(
        1 << 28, ge=1, description="Most elements in one tensor (after decoding)."
    )
    max_message_bytes: int = Field(
        1 << 30, ge=1024, description="Most payload bytes in one message, all tensors together."
    )


class FecConfig(_Section):
    """Forward error correction of large payloads sent as QUIC DATAGRAM frames."""

    enabled: bool = Field(True, description="Send payloads above the threshold as FEC datagrams.")
    threshold_bytes: int = Field(
        64 * 1024, ge=0, description="Payloads at least this large travel as FEC datagrams."
    )


class CongestionConfig(_Section):
    """The loss-tolerant, rate-based congestion controller registered with aioquic."""

    algorithm: str = Field(
        "wanswarm", description="'wanswarm' (loss-tolerant, rate-based) or aioquic's 'reno'/'cubic'."
    )


class TransportConfig(_Section):
    """QUIC endpoint settings."""

    host: str = Field("0.0.0.0", description="Address the QUIC (UDP) socket binds to.")
    port: int = Field(0, ge=0, le=65535, description="UDP port for QUIC; 0 picks a free one.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    fec: FecConfig = Field(default_factory=FecConfig)
    congestion: CongestionConfig = Field(default_factory=CongestionConfig)
