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
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The daemon's state dir (identity.key, control.sock), passed the way systemd passes it.
ENV STATE_DIRECTORY=/var/lib/wanswarm
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

USER wanswarm
WORKDIR /var/lib/wanswarm
VOLUME ["/var/lib/wanswarm"]
EXPOSE 31337/tcp 31338/udp
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=10s --start-period=120s --start-interval=2s --retries=3 \
    CMD ["wanswarm", "status"]
ENTRYPOINT ["wanswarm"]
CMD ["join", "--config", "/etc/wanswarm/node.toml"]
