#!/usr/bin/env bash
# Installs the host packages agentenv needs: runsc from bookworm-backports,
# iptables, mmdebstrap (base template), redis (cluster tests), docker-registry
# (image tests), chromium (the web console's browser test), haproxy (the front of two
# gateways in the cluster tests), fuse3 (lazily loaded images), docker.io (the compose
# deployment's test: its engine runs only in that test, in a network namespace of its
# own, never as a system service).
# Idempotent: does nothing when everything is already present.
set -euo pipefail

need=()
command -v runsc >/dev/null || need+=(runsc)
command -v iptables >/dev/null || need+=(iptables)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v redis-server >/dev/null || need+=(redis-server)
command -v ip >/dev/null || need+=(iproute2)
dpkg -s busybox-static >/dev/null 2>&1 || need+=(busybox-static)
# An OCI registry (distribution) the image tests run on loopback.
command -v docker-registry >/dev/null || need+=(docker-registry)
# Lazily loaded images: FUSE (/dev/fuse; the layer servers mount it themselves, as root).
command -v fusermount3 >/dev/null || need+=(fuse3)
# What Python packages without a wheel for this machine compile with.
for p in pkg-config gcc python3-dev; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
# A real browser for the web console's test (tests/test_console.py, driven by Playwright).
command -v chromium >/dev/null || need+=(chromium)
# An HTTP front over two gateways (tests/test_cluster_gateways.py; deploy/haproxy.cfg).
command -v haproxy >/dev/null || need+=(haproxy)
# A Docker engine (dockerd, containerd, runc) for tests/test_deploy_compose.py.
command -v dockerd >/dev/null || need+=(docker.io)
[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "setup-system: root is needed to install: ${need[*]}" >&2
  exit 1
fi

# runsc from bookworm's own suite cannot start a networked sandbox on this
# kernel; the backports build can. Add the suite to the existing Debian entry.
src=/etc/apt/sources.list.d/debian.sources
if [ -f "$src" ] && ! grep -q 'bookworm-backports' "$src"; then
  sed -i '0,/^Suites: bookworm bookworm-updates$/s//Suites: bookworm bookworm-updates bookworm-backports/' "$src"
fi
if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  echo 'deb http://deb.debian.org/debian bookworm-backports main' > /etc/apt/sources.list.d/bookworm-backports.list
fi

export DEBIAN_FRONTEND=noninteractive
# No package may start its service while installing: docker.io's dockerd, started in
# the root netns, would set the FORWARD policy to DROP under everything else here.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt-get update -qq
rest=()
for p in "${need[@]}"; do [ "$p" = runsc ] || rest+=("$p"); done
[ ${#rest[@]} -eq 0 ] || apt-get install -y -qq --no-install-recommends "${rest[@]}" >/dev/null
if [[ " ${need[*]} " == *" runsc "* ]]; then
  apt-get install -y -qq --no-install-recommends -t bookworm-backports runsc >/dev/null
fi
# The redis package starts a system service; tests start their own servers.
if command -v systemctl >/dev/null && systemctl is-active -q redis-server 2>/dev/null; then
  systemctl disable --now redis-server >/dev/null 2>&1 || true
fi
if command -v systemctl >/dev/null && systemctl is-active -q haproxy 2>/dev/null; then
  systemctl disable --now haproxy >/dev/null 2>&1 || true
fi
# Nor later: its socket unit would start dockerd at the first client call.
if [[ " ${need[*]} " == *" docker.io "* ]] && command -v systemctl >/dev/null; then
  systemctl disable --now docker.socket docker.service >/dev/null 2>&1 || true
fi
if command -v systemctl >/dev/null && systemctl is-active -q docker-registry 2>/dev/null; then
  systemctl disable --now docker-registry >/dev/null 2>&1 || true
fi
echo "setup-system: installed ${need[*]}"
