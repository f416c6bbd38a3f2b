#!/bin/sh
# Start a node that joins through another one whose state directory is mounted here.
#
#   wanswarm-initial-peers STATE_DIR join [flags...]
#
# Asks that daemon for its DHT addresses over its control socket (same uid, mode 0600), drops
# loopback ones, and execs `wanswarm join [flags...] --initial-peers ADDR...`. docker/compose.yaml
# uses it so that joiners need not know the bootstrap node's peer id in advance.
set -eu
if [ $# -lt 2 ]; then
    echo "usage: wanswarm-initial-peers STATE_DIR join [flags...]" >&2
    exit 2
fi
state_dir=$1
shift
addrs=$(wanswarm status --state-dir "$state_dir" --json | python3 -c '
import json, sys
addrs = json.load(sys.stdin)["dht_addrs"]
print(" ".join(a for a in addrs if not a.startswith(("/ip4/127.", "/ip6/::1/"))))
')
if [ -z "$addrs" ]; then
    echo "wanswarm-initial-peers: the daemon in $state_dir reports no reachable address" >&2
    exit 1
fi
# word splitting of $addrs is intended: one argument per multiaddr
# shellcheck disable=SC2086
exec wanswarm "$@" --initial-peers $addrs
