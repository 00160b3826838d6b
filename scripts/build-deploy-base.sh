#!/usr/bin/env bash
# Builds the OS base of the deployment's container image without any registry: a
# Debian bookworm rootfs from Debian's packages (mmdebstrap) as a tarball that
# `docker import` takes (tests/test_deploy_compose.py; deploy/README in
# docker-compose.yml). It holds what every role runs: Python 3.11 (redis-py needs
# async-timeout below 3.11.3), iproute2 and iptables (the node's slots), runsc (the
# host's, from bookworm-backports: bookworm's own cannot start a networked sandbox),
# redis-server and haproxy (the cluster's store and front), libfuse3 (lazy images).
# agentenv itself is a layer added on top (agentenv.testing.deploy_image).
# Idempotent: skips when the tarball's buildID (a hash of this script and of runsc)
# is the one already built.
set -euo pipefail
images="${AENV_IMAGES_DIR:-${AENV_HOME:-/var/lib/aenv}/images}"
dest="$images/deploy-base.tar"
runsc=$(command -v runsc)
build_id=$( (cat "${BASH_SOURCE[0]}"; sha256sum < "$runsc") | sha256sum | cut -c1-16)
if [ -f "$dest" ] && [ "$(cat "$dest.id" 2>/dev/null)" = "$build_id" ]; then
  exit 0
fi
mkdir -p "$images"
tmp=$(mktemp "$images/.deploy-base.XXXXXX.tar")
trap 'rm -f "$tmp"' EXIT
echo "building the deployment image's base (mmdebstrap, about a minute)..."
mmdebstrap --quiet --variant=minbase \
  --include=python3,python3-async-timeout,iproute2,iptables,redis-server,redis-tools,haproxy,libfuse3-3,fuse3,ca-certificates \
  --customize-hook="copy-in $runsc /usr/bin" \
  --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
  bookworm "$tmp"
mv "$tmp" "$dest"
echo "$build_id" > "$dest.id"
trap - EXIT
echo "deployment base: $dest"
