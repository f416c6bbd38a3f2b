"""TransportConfig: every setting of wanswarm.transport, one frozen pydantic tree.

The node's root config (node/config/node_config.py) embeds this tree as its ``transport`` section;
transport components receive only this tree or their own sub-section of it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LimitsConfig(_Section):
    """Hard limits on what a peer may send us (checked before allocating anything)."""

    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=256,
        le=16 * 1024 * 1024,
        description="Largest request/response header, bytes.",
    )
    max_tensors: int = Field(default=64, ge=1, le=4096, description="Most tensors in one message.")
    max_tensor_elements: int = Field(
        default=1 << 28, ge=1, description="Most elements in one tensor (after decoding)."
    )
    max_message_bytes: int = Field(
        default=1 << 30,
        ge=1024,
        description="Most payload bytes in one message, all tensors together.",
    )
    max_control_bytes: int = Field(
        default=64 * 1024,
        ge=256,
        le=16 * 1024 * 1024,
        description="Largest FEC transfer control frame (repair request, completion), bytes.",
    )
    max_inflight_bytes: int = Field(
        default=1 << 30,
        ge=1024,
        description="Most payload bytes one connection may have announced to us and not yet "
        "finished, all its messages together (FEC receivers allocate a payload up front); "
        "a message beyond it is answered 'busy'.",
    )
    max_inbound_bytes: int = Field(
        default=2 << 30,
        ge=1024,
        description="Most payload bytes all connections together may have announced to us "
        "and not yet finished: the node's memory budget for inbound transfers, reserved when "
        "a header arrives (before anything is allocated) and released when its exchange "
        "ends; a message beyond it is answered 'busy'.",
    )


class FecConfig(_Section):
    """Forward error correction of large payloads sent as QUIC DATAGRAM frames."""

    enabled: bool = Field(
        default=True, description="Send payloads above the threshold as FEC datagrams."
    )
    threshold_bytes: int = Field(
        default=64 * 1024, ge=0, description="Payloads at least this large travel as FEC datagrams."
    )
    max_block_symbols: int = Field(
        default=1024,
        ge=1,
        le=4096,
        description="Most source symbols per RaptorQ block when sending. RaptorQ work per "
        "byte grows with the block size (measured here: ~200 MB/s at 1024, ~120 MB/s at "
        "4096); fewer, larger blocks need relatively fewer repair symbols.",
    )
    target_success: float = Field(
        default=0.99,
        ge=0.5,
        le=0.999999,
        description="Probability, under Bernoulli loss at the budgeted rate, that a transfer "
        "(or a repair round) decodes with no further repair request; sets how many repair "
        "symbols are sent up front.",
    )
    decode_overhead: int = Field(
        default=1,
        ge=0,
        le=16,
        description="Symbols beyond k a block is budgeted to receive. RaptorQ decodes from k + h "
        "symbols except with probability about 1/256^(h+1).",
    )
    initial_loss_rate: float = Field(
        default=0.01,
        ge=0.0,
        le=0.5,
        description="Loss rate assumed on a path before any transfer on it has been measured.",
    )
    min_loss_rate: float = Field(
        default=0.002,
        ge=0.0,
        le=0.5,
        description="Floor on the loss rate used for budgeting repair symbols, so that a path "
        "measured lossless still gets a little protection.",
    )
    max_loss_rate: float = Field(
        default=0.3,
        ge=0.01,
        le=0.9,
        description="Cap on the loss rate used for budgeting; beyond it FEC over datagrams is "
        "not worth its bandwidth and repair rounds carry the rest.",
    )
    loss_margin: float = Field(
        default=1.5,
        ge=1.0,
        le=10.0,
        description="Multiplier on the estimated loss rate when budgeting repair symbols: covers "
        "estimation error and loss that is burstier than Bernoulli.",
    )
    loss_ewma_weight: float = Field(
        default=0.25,
        gt=0.0,
        le=1.0,
        description="EWMA weight of one full-size transfer's measured loss in the path estimate.",
    )
    loss_sample_symbols: int = Field(
        default=1024,
        ge=1,
        description="Datagrams a transfer must have sent to get the full EWMA weight; smaller "
        "transfers count proportionally less, so tiny samples do not swing the estimate.",
    )
    reorder_fraction: float = Field(
        default=0.125,
        ge=0.0,
        le=4.0,
        description="After the sender's last queued datagram arrives, the receiver waits this "
        "fraction of the RTT for reordered datagrams before asking for repairs (RFC 9002's "
        "time threshold is 1/8 RTT).",
    )
    idle_rtt_fraction: float = Field(
        default=0.5,
        gt=0.0,
        le=8.0,
        description="The receiver asks for repairs when no datagram of an incomplete transfer "
        "has arrived for this fraction of the RTT (the sender's last datagrams were lost).",
    )
    min_timer: float = Field(
        default=0.002,
        gt=0.0,
        le=1.0,
        description="Smallest receiver timer interval, seconds (timer granularity).",
    )
    repair_backoff: float = Field(
        default=2.0,
        ge=1.0,
        le=8.0,
        description="Factor by which the wait grows after each repair request that no datagram "
        "answered.",
    )
    max_repair_requests: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Repair requests in a row, none answered by any datagram, before the "
        "receiver gives the transfer up as failed.",
    )
    give_up_after_s: float = Field(
        default=5.0,
        ge=0.0,
        le=600.0,
        description="The receiver gives a transfer up only once it has also had no datagram "
        "of it for this long: at a LAN's RTT the max_repair_requests back-off spans well "
        "under a second, less than a loaded peer's event loop may stall.",
    )
    early_buffer_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=0,
        le=1 << 30,
        description="Bytes of datagrams kept per connection for transfers whose header has not "
        "arrived yet (the stream packet carrying it was lost or reordered).",
    )
    early_buffer_timeout: float = Field(
        default=2.0,
        ge=0.0,
        le=60.0,
        description="Seconds an early datagram waits for its transfer's header before it is "
        "dropped.",
    )

    @model_validator(mode="after")
    def _check_loss_bounds(self) -> FecConfig:
        if self.min_loss_rate > self.max_loss_rate:
            raise ValueError(
                f"fec.min_loss_rate ({self.min_loss_rate}) exceeds fec.max_loss_rate "
                f"({self.max_loss_rate}): lower the first or raise the second"
            )
        return self


class CongestionConfig(_Section):
    """The loss-tolerant, rate-based congestion controller registered with aioquic."""

    algorithm: str = Field(
        default="wanswarm",
        description="'wanswarm' (loss-tolerant, rate-based) or aioquic's 'reno'/'cubic'.",
    )
    initial_window_packets: int = Field(
        default=10, ge=2, le=1000, description="Congestion window before any ACK, packets."
    )
    min_window_packets: int = Field(
        default=4, ge=2, le=100, description="The congestion window never goes below this, packets."
    )
    initial_rtt_s: float = Field(
        default=0.1,
        gt=0.0,
        le=10.0,
        description="RTT assumed for the first pacing rate, before any RTT sample, seconds.",
    )
    startup_gain: float = Field(
        default=2.885,
        gt=1.0,
        le=4.0,
        description="STARTUP pacing gain (2/ln 2: doubles the delivery rate each round).",
    )
    startup_cwnd_gain: float = Field(
        default=2.0,
        ge=1.0,
        le=4.0,
        description="STARTUP window as a multiple of the estimated BDP (BBRv2: 2, so STARTUP "
        "queues at most about one BDP).",
    )
    drain_gain: float = Field(
        default=0.347,
        gt=0.0,
        lt=1.0,
        description="DRAIN pacing gain, drains the queue STARTUP built (1/startup_gain).",
    )
    cwnd_gain: float = Field(
        default=2.0,
        ge=1.0,
        le=4.0,
        description="PROBE_BW congestion window as a multiple of the estimated BDP (covers delayed "
        "and aggregated ACKs).",
    )
    probe_bw_gains: tuple[float, ...] = Field(
        default=(1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
        min_length=2,
        max_length=32,
        description="PROBE_BW pacing gain cycle, one phase per min RTT: probe up, drain, cruise.",
    )
    cwnd_extra_packets: int = Field(
        default=3, ge=0, le=64, description="Packets added to the BDP-based window (send quanta)."
    )
    bw_window_rounds: int = Field(
        default=10,
        ge=2,
        le=100,
        description="Bottleneck bandwidth is the max delivery rate over this many round trips.",
    )
    min_rtt_window_s: float = Field(
        default=10.0,
        ge=0.5,
        le=300.0,
        description="Propagation RTT is the min RTT over this window; when it expires, PROBE_RTT.",
    )
    probe_rtt_duration_s: float = Field(
        default=0.2, gt=0.0, le=5.0, description="Time PROBE_RTT holds the small window, seconds."
    )
    probe_rtt_cwnd_gain: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="PROBE_RTT window as a fraction of the BDP (BBRv2; v1 used 4 packets).",
    )
    full_bw_growth: float = Field(
        default=1.25,
        gt=1.0,
        le=4.0,
        description="Bandwidth 'grows' in a round when it rises by this factor; STARTUP ends after "
        "full_bw_rounds rounds without such growth.",
    )
    full_bw_rounds: int = Field(
        default=3, ge=1, le=20, description="Rounds without bandwidth growth that end STARTUP."
    )
    loss_threshold: float = Field(
        default=0.15,
        gt=0.0,
        le=1.0,
        description="A round without bandwidth growth losing at least this fraction of its "
        "packets is congestion. Random loss below it (what FEC repairs) leaves the rate alone.",
    )
    inflated_loss_threshold: float = Field(
        default=0.05,
        gt=0.0,
        le=1.0,
        description="Lower loss threshold that applies when the round's minimum RTT shows a "
        "standing queue (above rtt_inflation x min RTT).",
    )
    rtt_inflation: float = Field(
        default=1.5,
        gt=1.0,
        le=10.0,
        description="A round whose smallest RTT exceeds this multiple of the min RTT has a "
        "standing queue.",
    )
    standing_queue_fraction: float = Field(
        default=0.1,
        gt=0.0,
        le=10.0,
        description="A round whose smallest RTT exceeds the min RTT by this fraction (plus "
        "standing_queue_min_s) kept a standing queue all round: the flows sharing the path "
        "send more than it delivers. The estimate falls to what the round delivered.",
    )
    standing_queue_min_s: float = Field(
        default=0.002,
        ge=0.0,
        le=1.0,
        description="Absolute margin of the standing-queue test, seconds (short paths, jitter).",
    )
    min_lost_packets: int = Field(
        default=8,
        ge=1,
        le=1000,
        description="A round needs at least this many lost packets to count as congestion (a "
        "short round losing one or two packets says nothing).",
    )
    random_loss_backoff: float = Field(
        default=0.85,
        gt=0.0,
        le=1.0,
        description="On congestion without a standing queue (shallow buffer or heavy random "
        "loss) the bandwidth estimate falls at most to this fraction per round, instead of to "
        "the round's delivery rate.",
    )
    pacing_margin: float = Field(
        default=0.01,
        ge=0.0,
        lt=0.5,
        description="Pace this fraction below the estimated rate, so queues drain (BBR: 1%).",
    )
    app_limited_gap_s: float = Field(
        default=0.005,
        gt=0.0,
        le=1.0,
        description="A send after the window had room this long (and over 4 packet times) "
        "marks the flow application-limited: its rate samples then only raise the estimate.",
    )

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, value: str) -> str:
        # The known names are congestion_control.CONTROLLERS, imported on first use: the
        # registry imports aioquic, and its entries import this module.
        from .congestion_control import known_controller

        known_controller(value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> CongestionConfig:
        if self.min_window_packets > self.initial_window_packets:
            raise ValueError("min_window_packets must not exceed initial_window_packets")
        if self.inflated_loss_threshold > self.loss_threshold:
            raise ValueError("inflated_loss_threshold must not exceed loss_threshold")
        if max(self.probe_bw_gains) <= 1.0 or min(self.probe_bw_gains) <= 0.0:
            raise ValueError(
                "probe_bw_gains needs a phase above 1 (to find new bandwidth) and all gains > 0"
            )
        return self


class TraversalConfig(_Section):
    """NAT traversal: observed address, dial-back, introductions, hole punching, relaying
    (docs/nat.md). Every rate and count here bounds what one peer can make us do."""

    keepalive_interval_s: float = Field(
        default=10.0,
        gt=0,
        le=25.0,
        description="A QUIC PING on each kept connection (our rendezvous) this often, jittered: "
        "well under the 30 s a NAT may keep an idle UDP mapping.",
    )
    keep_retry_s: float = Field(
        default=5.0,
        gt=0,
        le=300.0,
        description="Wait before re-making a kept connection that failed or closed, seconds "
        "(jittered, doubling up to 8x while it keeps failing).",
    )
    dialback_timeout_s: float = Field(
        default=3.0,
        gt=0,
        le=30.0,
        description="Serving a dial-back: deadline for the QUIC/TLS handshake from a fresh port "
        "to the requester's observed address, seconds. The requester's own deadline must be "
        "longer.",
    )
    dialbacks_per_minute: float = Field(
        default=6.0,
        gt=0,
        le=600.0,
        description="Dial-backs one peer may ask of us per minute (a burst of 2 at most).",
    )
    max_dialbacks: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Dial-backs served at once; beyond it a request is answered 'busy'.",
    )
    probe_port: bool = Field(
        default=True,
        description="As an observer: open a second UDP port (on first use) that records the "
        "source address of probe packets, so that one observer can tell a NAT that maps per "
        "destination from one that does not. It only receives; it never answers.",
    )
    probe_packets: int = Field(
        default=3,
        ge=0,
        le=10,
        description="Probe packets sent from our QUIC port to an observer's second port, "
        "punch_interval_s apart (0: observe only the QUIC port; one observer then cannot "
        "tell the NAT's mapping).",
    )
    probe_wait_s: float = Field(
        default=1.0,
        gt=0,
        le=10.0,
        description="As an observer: how long a probe lookup waits for its probe packets to "
        "arrive, seconds. The requester's own deadline must be longer.",
    )
    probes_per_minute: float = Field(
        default=12.0,
        gt=0,
        le=600.0,
        description="As an observer: probe lookups one peer may ask of us per minute (a burst "
        "of 3 at most).",
    )
    introduce_timeout_s: float = Field(
        default=3.0,
        gt=0,
        le=30.0,
        description="As a rendezvous: deadline for the target's answer to an introduction or "
        "relay offer, seconds.",
    )
    introductions_per_minute: float = Field(
        default=30.0,
        gt=0,
        le=6000.0,
        description="As a rendezvous: introductions and relay requests one peer may ask of us "
        "per minute (a burst of a fifth of it, at least 2).",
    )
    accept_per_minute: float = Field(
        default=30.0,
        gt=0,
        le=6000.0,
        description="As a target: introductions and relay offers we accept per minute from our "
        "rendezvous peers, all together (a burst of a fifth of it, at least 2).",
    )
    introduction_max_age_s: float = Field(
        default=30.0,
        gt=0,
        le=600.0,
        description="An introduction or relay offer whose timestamp is further than this from "
        "our clock is refused as stale; a nonce seen within twice this is refused as replayed.",
    )
    punch_packets: int = Field(
        default=3,
        ge=0,
        le=10,
        description="Small UDP packets the target sends toward an introduced peer to open its "
        "NAT's mapping (0: no hole punching; connections go by reversal or relay).",
    )
    punch_interval_s: float = Field(
        default=0.1,
        gt=0,
        le=2.0,
        description="Interval between the punch packets, seconds.",
    )
    punch_timeout_s: float = Field(
        default=3.0,
        gt=0,
        le=30.0,
        description="How long a connection by reversal or hole punching may take before we fall "
        "back to a relay, seconds.",
    )
    relay_enabled: bool = Field(
        default=True,
        description="Relay packets between peers that both reach us and cannot reach each "
        "other (serve '_relay' requests).",
    )
    relay_channels_max: int = Field(
        default=16,
        ge=0,
        le=4096,
        description="Most relay channels we carry at once; beyond it '_relay' is refused.",
    )
    relay_bytes_per_s: float = Field(
        default=2_000_000.0,
        gt=0,
        le=1e10,
        description="Token bucket rate of one relay channel, bytes per second, both directions "
        "together; packets beyond it are dropped (the ends' congestion control slows down).",
    )
    relay_burst_bytes: int = Field(
        default=256 * 1024,
        ge=4096,
        le=1 << 30,
        description="Token bucket depth of one relay channel, bytes.",
    )
    relay_idle_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600.0,
        description="A relay channel that forwarded nothing for this long is removed, seconds.",
    )


class TransportConfig(_Section):
    """QUIC endpoint settings."""

    host: str = Field(default="0.0.0.0", description="Address the QUIC (UDP) socket binds to.")
    port: int = Field(
        default=0, ge=0, le=65535, description="UDP port for QUIC; 0 picks a free one."
    )
    upload_limit_mbps: float | None = Field(
        default=None,
        gt=0,
        le=1e6,
        description="Most the QUIC port sends, Mb/s of UDP payload, every connection together "
        "(upload_limit.py: a token bucket; the wait it adds makes the congestion controller "
        "settle at the limit). Unset: no limit.",
    )
    limits: LimitsConfig = Field(default_factory=lambda: LimitsConfig())
    fec: FecConfig = Field(default_factory=FecConfig)
    congestion: CongestionConfig = Field(default_factory=CongestionConfig)
    traversal: TraversalConfig = Field(default_factory=TraversalConfig)

    path_bandwidth_bps: float = Field(
        default=1e9,
        gt=0,
        le=1e12,
        description="Fastest path to plan for; with path_rtt_s it sizes the QUIC flow-control "
        "windows to the bandwidth-delay product (aioquic's 1 MiB default caps a 100 ms path "
        "at ~84 Mb/s).",
    )
    path_rtt_s: float = Field(
        default=0.2,
        gt=0,
        le=5.0,
        description="Longest round trip to plan for when sizing flow-control windows, seconds.",
    )
    max_udp_payload_bytes: int = Field(
        default=1452,
        ge=1200,
        le=65527,
        description="Largest UDP payload we send (aioquic's max_datagram_size): a 1500-byte "
        "path MTU minus 40 bytes of IPv6 and 8 of UDP header. RFC 9000 requires >= 1200.",
    )
    mtu_probe_bytes: tuple[int, ...] = Field(
        default=(16448, 8952),
        max_length=4,
        description="Larger UDP payloads each connection probes its path for once "
        "authenticated, largest first (path_mtu.py): 16448 carries the largest FEC symbol "
        "(16 KiB) in one packet on loopback, 8952 a 9000-byte jumbo-frame LAN. A size is "
        "used only once a probe of it, sent with fragmentation forbidden, was acknowledged; "
        "internet paths carry neither. Sizes not above max_udp_payload_bytes are ignored; "
        "() turns probing off.",
    )
    mtu_confirm_interval_s: float = Field(
        default=30.0,
        ge=1.0,
        le=3600.0,
        description="Once a larger size is in use, how often it is confirmed with a probe "
        "while the connection shows no loss (path_mtu.py's black-hole check; loss or "
        "unanswered packets confirm it within a second). Three unanswered confirmations "
        "while probes of max_udp_payload_bytes still cross: back to max_udp_payload_bytes.",
    )
    mtu_research_s: float = Field(
        default=120.0,
        ge=1.0,
        le=86400.0,
        description="After the black-hole check went back to max_udp_payload_bytes, how long "
        "before the path is probed for larger sizes again (doubling after each further black "
        "hole on the connection, up to 16 times this).",
    )
    socket_buffer_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=64 * 1024,
        description="SO_SNDBUF/SO_RCVBUF requested for the UDP socket (the kernel may cap it).",
    )
    connect_timeout_s: float = Field(
        default=5.0, gt=0, le=120, description="Deadline for the QUIC/TLS handshake, seconds."
    )
    handshake_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=120,
        description="Deadline for the identity handshake that follows TLS, seconds.",
    )
    idle_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="QUIC idle timeout: a connection with no packets for this long is closed.",
    )
    dead_peer_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="While requests wait on a connection that has received nothing for this "
        "long (despite PINGs sent every third of it), the connection is declared dead.",
    )
    request_receive_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=3600,
        description="Server side: deadline to receive a whole request (header and payload).",
    )
    response_send_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=3600,
        description="Server side: deadline to send a whole response once the handler returned.",
    )
    shutdown_timeout_s: float = Field(
        default=10.0,
        ge=0,
        le=600,
        description="close(): how long in-flight handlers may run before they are cancelled.",
    )
    max_connections: int = Field(
        default=1024,
        ge=1,
        description="Most incoming QUIC connections at once. Outgoing ones are counted "
        "apart (max_outgoing_connections), so that a flood of incoming ones never blocks "
        "our own connects.",
    )
    max_outgoing_connections: int = Field(
        default=1024, ge=1, description="Most outgoing QUIC connections at once."
    )
    max_unauthenticated: int = Field(
        default=64,
        ge=1,
        description="Most incoming connections still in their TLS or identity handshake.",
    )
    max_connections_per_host: int = Field(
        default=64,
        ge=1,
        description="Most incoming connections from one source IP address at once (peers "
        "behind one NAT share an address).",
    )
    max_unauthenticated_per_host: int = Field(
        default=8,
        ge=1,
        description="Most incoming connections from one source IP address still in their "
        "TLS or identity handshake.",
    )
    max_connections_per_peer: int = Field(
        default=4,
        ge=1,
        description="Most authenticated incoming connections of one peer id; a newer one "
        "closes its oldest (only the key's holder can make them, and an honest peer that "
        "restarted must get through).",
    )
    retry: Literal["never", "pressure", "always"] = Field(
        default="pressure",
        description="QUIC Retry (RFC 9000 §8.1.2) for new incoming connections: the client "
        "must echo a token bound to its address before any state is kept, so spoofed "
        "sources hold no slot. 'pressure': only while at least retry_pressure of "
        "max_unauthenticated is taken (a Retry costs a round trip per handshake).",
    )
    retry_pressure: float = Field(
        default=0.25,
        ge=0.0,
        le=1.0,
        description="Fraction of max_unauthenticated in use from which retry='pressure' "
        "answers new connections with a Retry.",
    )

    @field_validator("mtu_probe_bytes")
    @classmethod
    def _probe_sizes(cls, sizes: tuple[int, ...]) -> tuple[int, ...]:
        for size in sizes:
            if not 1200 <= size <= 65527:
                raise ValueError(
                    f"mtu_probe_bytes: {size} is not a UDP payload of 1200-65527 bytes"
                )
        return sizes
