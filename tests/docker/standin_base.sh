#!/bin/sh
# Build a stand-in for the Dockerfile's base image where Docker Hub is out of reach:
# Debian bookworm (debootstrap from a Debian mirror), Python 3.11 in a venv at /opt/conda
# (the path of the pytorch/pytorch images), torch as `pip install torch==2.13.0` gives it on
# this host, and the host's CA bundle (so that pip inside the build gets through the same
# TLS-intercepting proxy as the host, where there is one).
#
#   tests/docker/standin_base.sh [TAG]      # default TAG: wanswarm-test-base:bookworm
#   BASE_IMAGE=wanswarm-test-base:bookworm python -m pytest tests/docker
#
# Needs root, debootstrap and a running Docker engine; about a minute and 1.3 GB.
set -eu
tag=${1:-wanswarm-test-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=$(mktemp -d)
trap 'umount "$work/rootfs/proc" 2>/dev/null || true; rm -rf "$work"' EXIT INT TERM
root=$work/rootfs

echo "standin_base: debootstrap bookworm into $root" >&2
debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
    bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
cp /etc/resolv.conf "$root/etc/resolv.conf"

echo "standin_base: torch==${TORCH_VERSION:-2.13.0} into /opt/conda" >&2
pip download -q --no-deps --only-binary=:all: --python-version 3.11 -d "$work/wheels" \
    "torch==${TORCH_VERSION:-2.13.0}"
mkdir -p "$root/tmp/wheels" && cp "$work"/wheels/*.whl "$root/tmp/wheels/"
mount --bind /proc "$root/proc"
env -u PIP_FIND_LINKS -u PIP_CONSTRAINT chroot "$root" sh -c \
    'python3 -m venv /opt/conda && /opt/conda/bin/pip install -q --no-cache-dir /tmp/wheels/*.whl'
umount "$root/proc"
rm -rf "$root/tmp/wheels" "$root/etc/resolv.conf" "$root"/var/cache/apt/archives/*.deb

echo "standin_base: importing as $tag" >&2
tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/opt/conda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' - "$tag" >/dev/null
echo "$tag"
