# wanswarm node image: CUDA-capable PyTorch, non-root, the daemon in the foreground.
#
#   docker build -t wanswarm .
#   docker run -d --init --name wanswarm --gpus all --stop-timeout 90 \
#       -p 31337:31337/tcp -p 31338:31338/udp -v wanswarm-state:/var/lib/wanswarm \
#       wanswarm join --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...
#   docker exec wanswarm wanswarm status
#
# 'docker stop' sends SIGTERM, the daemon's graceful leave; give it longer than
# node.shutdown_timeout (30 s) with --stop-timeout / compose's stop_grace_period. --init
# (compose: init: true) runs tini as PID 1, which reaps the daemon's forked children.
# Publishing the ports is optional: behind NAT the node is reached by hole punching or a
# relay (docs/nat.md); published and forwarded, peers dial it directly.
#
# The Triton kernels (int8/fp8/int4 codecs on the GPU) are compiled at their first launch,
# and Triton builds a small C launcher for them then: the runtime image has no C compiler,
# so gcc and the C library headers are installed (Python's headers are in the image's
# conda). Compiled kernels are cached in TRITON_CACHE_DIR, on the volume, so a restarted
# container does not compile them again. Where they still cannot run (an old GPU), the
# node logs it once and uses the torch reference on the GPU (docs/gpu.md).
# BASE_IMAGE: any image with Python >= 3.11 and torch on PATH, Debian or Ubuntu (apt-get).
# tests/docker builds on a local Debian stand-in where Docker Hub is out of reach.
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The daemon's state dir (identity.key, control.sock), passed the way systemd passes it.
ENV STATE_DIRECTORY=/var/lib/wanswarm
# Triton's kernel cache (the default, ~/.triton, is not writable for the service user).
ENV TRITON_CACHE_DIR=/var/lib/wanswarm/triton-cache
# Fixed ports, so that they can be published and forwarded: the DHT on TCP, QUIC on UDP.
ENV WANSWARM__DHT__PORT=31337 WANSWARM__TRANSPORT__PORT=31338

RUN groupadd --system --gid 10001 wanswarm \
 && useradd --system --uid 10001 --gid wanswarm --home-dir /var/lib/wanswarm \
        --no-create-home --shell /usr/sbin/nologin wanswarm \
 && install -d -o wanswarm -g wanswarm -m 0700 /var/lib/wanswarm

WORKDIR /opt/wanswarm/src
COPY pyproject.toml README.md LICENSE ./
COPY node ./node
COPY transport ./transport
COPY kernels ./kernels
RUN pip install . && rm -rf /opt/wanswarm/src
COPY configs/node.toml /etc/wanswarm/node.toml
COPY docker/initial-peers.sh /usr/local/bin/wanswarm-initial-peers

USER 10001:10001
WORKDIR /var/lib/wanswarm
VOLUME ["/var/lib/wanswarm"]
EXPOSE 31337/tcp 31338/udp
STOPSIGNAL SIGTERM
# The first check runs 'wanswarm selftest' (device, precision, kernels vs the reference,
# a stage's forward/backward; it compiles the kernels into the cache) and leaves a marker
# in /tmp, which a new container does not have; every check then asks the daemon.
# (No --start-interval: Docker before 25 refuses the whole Dockerfile over that flag.)
HEALTHCHECK --interval=10s --timeout=120s --start-period=180s --retries=3 \
    CMD ["sh", "-c", "wanswarm selftest --config /etc/wanswarm/node.toml --once /tmp/wanswarm-selftest.ok && exec wanswarm status"]
ENTRYPOINT ["wanswarm"]
CMD ["join", "--config", "/etc/wanswarm/node.toml"]
