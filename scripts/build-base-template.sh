#!/usr/bin/env bash
# Builds the default `base` template: a Debian bookworm rootfs from Debian's
# packages (mmdebstrap) with a passwordless-sudo user `user` (uid 1000), and
# `python` beside `python3` (python-is-python3), as E2B's base has both.
# gVisor ignores setuid bits, so the real sudo is diverted to /usr/bin/sudo.real
# and /usr/bin/sudo is envd's client, which has envd run it as root
# (src/agentenv/envd/sudo.py). The sandbox's hostname resolves (libnss-myhostname),
# so sudo does not warn "unable to resolve host".
# Idempotent: skips when the template's buildID (a hash of this script) is the
# one already built; a changed script rebuilds and replaces it.
set -euo pipefail
images="${AENV_IMAGES_DIR:-${AENV_HOME:-/var/lib/aenv}/images}"
dest="$images/templates/base"
h=$(sha256sum < "${BASH_SOURCE[0]}" | cut -c1-32)
build_id="${h:0:8}-${h:8:4}-${h:12:4}-${h:16:4}-${h:20:12}"
if [ -f "$dest/template.json" ] && grep -q "\"buildID\": \"$build_id\"" "$dest/template.json"; then
  exit 0
fi

mkdir -p "$images/templates"
tmp=$(mktemp -d "$images/templates/.base.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "building template base (mmdebstrap, about a minute)..."
mmdebstrap --quiet --variant=minbase \
  --include=bash,coreutils,procps,python3,python-is-python3,python3-pip,git,curl,ca-certificates,sudo,iproute2,less,libnss-myhostname \
  --customize-hook='chroot "$1" useradd --create-home --uid 1000 --shell /bin/bash user' \
  --customize-hook='echo "user ALL=(ALL:ALL) NOPASSWD: ALL" > "$1/etc/sudoers.d/user"; chmod 0440 "$1/etc/sudoers.d/user"' \
  --customize-hook='chroot "$1" dpkg-divert --quiet --local --rename --divert /usr/bin/sudo.real --add /usr/bin/sudo' \
  --customize-hook='ln -s /.aenv/bin/sudo "$1/usr/bin/sudo"' \
  --customize-hook='printf "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" > "$1/etc/hosts"' \
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
 "buildID": "$build_id",
 "createdAt": "$(date -u +%Y-%m-%dT%H:%M:%SZ)", "source": "mmdebstrap bookworm minbase"}
JSON
# Replaces an older build: the new one goes in whole, then the old one goes.
if [ -e "$dest" ]; then mv "$dest" "$tmp/old"; fi
mv "$tmp" "$dest"
rm -rf "$dest/old"
trap - EXIT
echo "template base: $dest"
