#!/usr/bin/env bash
# Builds the default `base` template: a Debian bookworm rootfs from Debian's
# packages (mmdebstrap) with a passwordless-sudo user `user` (uid 1000).
# Idempotent: skips when the template's metadata file exists.
set -euo pipefail
images="${AENV_IMAGES_DIR:-${AENV_HOME:-/var/lib/aenv}/images}"
dest="$images/templates/base"
[ -f "$dest/template.json" ] && exit 0

mkdir -p "$images/templates"
tmp=$(mktemp -d "$images/templates/.base.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "building template base (mmdebstrap, about a minute)..."
mmdebstrap --quiet --variant=minbase \
  --include=bash,coreutils,procps,python3,python3-pip,git,curl,ca-certificates,sudo,iproute2,less \
  --customize-hook='chroot "$1" useradd --create-home --uid 1000 --shell /bin/bash user' \
  --customize-hook='echo "user ALL=(ALL:ALL) NOPASSWD: ALL" > "$1/etc/sudoers.d/user"; chmod 0440 "$1/etc/sudoers.d/user"' \
  --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
  bookworm "$tmp/rootfs"
# Login shells cheap: the SDK runs every command as `bash -l -c`, and /etc/profile's
# "$(id -u)" started an `id` process for each (~15 ms of a ~50 ms login shell under
# gVisor); bash knows its EUID (sh still asks id). Root's `mesg n` only on a terminal.
sed -i 's/"\$(id -u)"/"${EUID:-$(id -u)}"/' "$tmp/rootfs/etc/profile"
sed -i 's|^mesg n 2> /dev/null \|\| true$|if [ -t 0 ]; then mesg n 2> /dev/null \|\| true; fi|' \
  "$tmp/rootfs/root/.profile"
cat > "$tmp/template.json" <<JSON
{"templateID": "base", "aliases": ["base"], "cpuCount": 2, "memoryMB": 512,
 "createdAt": "$(date -u +%Y-%m-%dT%H:%M:%SZ)", "source": "mmdebstrap bookworm minbase"}
JSON
mv "$tmp" "$dest.new" && mv "$dest.new" "$dest"
trap - EXIT
echo "template base: $dest"
