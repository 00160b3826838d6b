#!/usr/bin/env bash
# Builds the `code-interpreter` template (aliases: code-interpreter-v1, the
# e2b-code-interpreter SDK's default): the base Debian bookworm userland (user
# `user`, uid 1000, passwordless sudo) plus a Python environment at /opt/aenv-ci
# with a Jupyter kernel (ipykernel, jupyter_client, from PyPI, pinned in
# src/agentenv/templates/code_interpreter/requirements.txt) and the in-sandbox
# server on port 49999 that the SDK's run_code talks to. The server starts with
# every sandbox of the template (startCmd); create returns once it answers
# (readyCmd). gVisor ignores setuid bits: as in `base`, /usr/bin/sudo is envd's
# client and the real sudo is diverted to /usr/bin/sudo.real.
#
# Idempotent: skips when the template's buildID (a hash of this script, the
# server and the pins) is the one already built.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
src="$here/src/agentenv/templates/code_interpreter"
images="${AENV_IMAGES_DIR:-${AENV_HOME:-/var/lib/aenv}/images}"
dest="$images/templates/code-interpreter"

h=$(cat "${BASH_SOURCE[0]}" "$src/server.py" "$src/requirements.txt" | sha256sum | cut -c1-32)
build_id="${h:0:8}-${h:8:4}-${h:12:4}-${h:16:4}-${h:20:12}"
if [ -f "$dest/template.json" ] && grep -q "\"buildID\": \"$build_id\"" "$dest/template.json"; then
  exit 0
fi

if [ -x "$here/.venv/bin/python" ]; then pip=("$here/.venv/bin/python" -m pip); else pip=(python3 -m pip); fi
mkdir -p "$images/templates"
tmp=$(mktemp -d "$images/templates/.code-interpreter.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "building template code-interpreter (mmdebstrap + Jupyter from PyPI, a minute or two)..."
# The wheels come from PyPI through the host's pip (its index and certificates);
# inside the rootfs they install offline.
"${pip[@]}" download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
  -r "$src/requirements.txt" --dest "$tmp/wheels"
cp "$src/requirements.txt" "$tmp/wheels/requirements.txt"

mmdebstrap --quiet --variant=minbase \
  --include=bash,coreutils,procps,python3,python3-pip,python3-venv,git,curl,ca-certificates,sudo,iproute2,less,libnss-myhostname \
  --customize-hook='chroot "$1" useradd --create-home --uid 1000 --shell /bin/bash user' \
  --customize-hook='echo "user ALL=(ALL:ALL) NOPASSWD: ALL" > "$1/etc/sudoers.d/user"; chmod 0440 "$1/etc/sudoers.d/user"' \
  --customize-hook='chroot "$1" dpkg-divert --quiet --local --rename --divert /usr/bin/sudo.real --add /usr/bin/sudo' \
  --customize-hook='ln -s /.aenv/bin/sudo "$1/usr/bin/sudo"' \
  --customize-hook="cp -r '$tmp/wheels' \"\$1/tmp/aenv-wheels\"" \
  --customize-hook='chroot "$1" python3 -m venv /opt/aenv-ci' \
  --customize-hook='chroot "$1" env -i PATH=/usr/bin:/bin HOME=/root /opt/aenv-ci/bin/pip install --quiet --disable-pip-version-check --no-index --find-links /tmp/aenv-wheels -r /tmp/aenv-wheels/requirements.txt' \
  --customize-hook="install -m 0644 '$src/server.py' \"\$1/opt/aenv-ci/server.py\"" \
  --customize-hook='chroot "$1" /opt/aenv-ci/bin/python -m compileall -q /opt/aenv-ci/server.py' \
  --customize-hook='chown -R 1000:1000 "$1/opt/aenv-ci"; rm -rf "$1/tmp/aenv-wheels" "$1"/root/.cache' \
  --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
  bookworm "$tmp/rootfs"

# The server runs as `user` with the environment's bin first on PATH; its log
# stays in the sandbox.
start='cd /home/user && exec setpriv --reuid=1000 --regid=1000 --init-groups env HOME=/home/user USER=user LOGNAME=user PATH=/opt/aenv-ci/bin:$PATH /opt/aenv-ci/bin/python /opt/aenv-ci/server.py >>/tmp/code-interpreter.log 2>&1'
python3 - "$tmp/template.json" "$build_id" "$start" <<'PY'
import json, sys, time
path, build_id, start = sys.argv[1:]
json.dump({
    "templateID": "code-interpreter",
    "aliases": ["code-interpreter", "code-interpreter-v1"],
    "cpuCount": 2,
    "memoryMB": 1024,
    "buildID": build_id,
    "createdAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "startCmd": start,
    "readyCmd": "curl -sf -m 2 http://127.0.0.1:49999/health",
    "readyTimeoutSec": 60,
    "source": "mmdebstrap bookworm minbase + /opt/aenv-ci (ipykernel, jupyter_client, uvicorn)",
}, open(path, "w"), indent=1)
PY
if [ -e "$dest" ]; then mv "$dest" "$tmp/old"; fi
mv "$tmp" "$dest"
rm -rf "$dest/old" "$dest/wheels"
trap - EXIT
echo "template code-interpreter: $dest"
