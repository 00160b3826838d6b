#!/usr/bin/env bash
# Builds the `code-interpreter` template (aliases: code-interpreter-v1, the
# e2b-code-interpreter SDK's default), E2B's code-interpreter template rebuilt from
# PyPI, npm and Debian: the base Debian bookworm userland (user `user`, uid 1000,
# passwordless sudo) plus
#   - /opt/aenv-ci: a Python environment (src/agentenv/templates/code_interpreter/
#     requirements.txt, from PyPI) with ipykernel and the data stack (numpy, pandas,
#     matplotlib, pillow, scipy, scikit-learn, seaborn, ...), bash_kernel, the
#     IPython extension for E2B's result formats (aenv_ci_display, aenv_ci_charts)
#     and the in-sandbox server on port 49999 that the SDK's run_code talks to;
#   - JavaScript and TypeScript kernels: tslab (npm, js/package-lock.json) on
#     Debian's nodejs;
#   - R: Debian's r-base-core and r-cran-irkernel;
#   - Java: Debian's openjdk-17-jdk-headless and the JJava kernel (PyPI `jjava`,
#     IJava's successor; JShell). It adds 274 MB to the rootfs (1231 -> 1505 MB) and
#     well under a minute to a fresh build (its .debs: 117 MB, 15 s to download and
#     28 s to unpack here, loaded; whole builds 4m15s with it, 4m49s without, on the
#     same loaded machine); AENV_CI_JAVA=0 builds the template without it.
# The kernels run as root in /home/user, as E2B's. The server starts with every
# sandbox of the template (startCmd, under supervise.sh, which starts it again if
# it dies); create returns once it answers (readyCmd). gVisor ignores setuid bits:
# as in `base`, /usr/bin/sudo is envd's client and the real sudo is diverted to
# /usr/bin/sudo.real.
#
# Idempotent: skips when the template's buildID (a hash of this script and every
# file under src/agentenv/templates/code_interpreter) is the one already built.
set -euo pipefail
java="${AENV_CI_JAVA:-1}"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
src="$here/src/agentenv/templates/code_interpreter"
images="${AENV_IMAGES_DIR:-${AENV_HOME:-/var/lib/aenv}/images}"
dest="$images/templates/code-interpreter"

h=$( (cat "${BASH_SOURCE[0]}"; echo "java=$java"; cd "$src" && find . -type f ! -name '*.pyc' | LC_ALL=C sort | xargs cat) \
  | sha256sum | cut -c1-32)
build_id="${h:0:8}-${h:8:4}-${h:12:4}-${h:16:4}-${h:20:12}"
if [ -f "$dest/template.json" ] && grep -q "\"buildID\": \"$build_id\"" "$dest/template.json"; then
  exit 0
fi

command -v npm >/dev/null || { echo "the code-interpreter template needs npm (tslab)" >&2; exit 1; }
if [ -x "$here/.venv/bin/python" ]; then pip=("$here/.venv/bin/python" -m pip); else pip=(python3 -m pip); fi
mkdir -p "$images/templates"
tmp=$(mktemp -d "$images/templates/.code-interpreter.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "building template code-interpreter (mmdebstrap + Jupyter, the data stack, kernels; a few minutes)..."
# tslab from npm (its zeromq ships prebuilt addons: no compiler, no install
# scripts); only the Linux x64 addons are kept. The kernels start with
# js/aenv_jslab.js, which runs tslab with E2B's results and errors and binds its
# sockets as Unix sockets when the connection file says ipc (see it). npm downloads
# while pip does.
mkdir -p "$tmp/js"
cp "$src/js/package.json" "$src/js/package-lock.json" "$src/js/aenv_jslab.js" "$tmp/js/"
(cd "$tmp/js" && npm ci --ignore-scripts --omit=dev --no-audit --no-fund --loglevel=error) &
npm_ci=$!
# The wheels come from PyPI through the host's pip (its index and certificates);
# inside the rootfs they install offline. Eight at a time (pinned and --no-deps: each
# line stands alone): one after another they took 163 s from scratch here, mostly
# waiting on the index; a download that fails among the eight goes again with the
# rest, one at a time.
mkdir -p "$tmp/wheels"
sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$src/requirements.txt" \
  | xargs -P 8 -n 8 "${pip[@]}" download --quiet --disable-pip-version-check \
      --only-binary=:all: --no-deps --dest "$tmp/wheels" \
  || "${pip[@]}" download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
       -r "$src/requirements.txt" --dest "$tmp/wheels"
cp "$src/requirements.txt" "$tmp/wheels/requirements.txt"
packages=bash,coreutils,procps,python3,python3-pip,python3-venv,git,curl,ca-certificates,sudo,iproute2,less,libnss-myhostname,nodejs,r-base-core,r-cran-irkernel
if [ "$java" = 1 ]; then
  # JJava's wheel holds its jars and a kernel spec (replaced below); JShell needs the JDK.
  "${pip[@]}" download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
    jjava==1.0a8 --dest "$tmp/wheels"
  echo jjava==1.0a8 >>"$tmp/wheels/requirements.txt"
  packages="$packages,openjdk-17-jdk-headless"
  # The kernel JVM itself, not JJava's launcher (a JVM that starts it and waits):
  # one JVM per context. Serial GC: one GC thread, less memory on 2 vCPUs.
  mkdir -p "$tmp/kernels/java"
  jar=/opt/aenv-ci/share/jupyter/kernels/java/jjava.jar
  printf '{"argv": ["/usr/bin/java", "-XX:+UseSerialGC", "--add-opens", "jdk.jshell/jdk.jshell=ALL-UNNAMED", "-jar", "%s", "{connection_file}"], "display_name": "Java", "language": "java", "interrupt_mode": "message"}\n' \
    "$jar" >"$tmp/kernels/java/kernel.json"
fi
wait "$npm_ci"
find "$tmp/js/node_modules/zeromq/build" -mindepth 1 -maxdepth 1 ! -name linux ! -name manifest.json -exec rm -rf {} +
find "$tmp/js/node_modules/zeromq/build/linux" -mindepth 1 -maxdepth 1 ! -name x64 -exec rm -rf {} +
# tslab looks for @types/node beside itself when the working directory has none.
mkdir -p "$tmp/js/node_modules/tslab/node_modules"
ln -s ../../@types "$tmp/js/node_modules/tslab/node_modules/@types"
mkdir -p "$tmp/kernels"
for k in jslab:JavaScript:javascript:--js tslab:TypeScript:typescript:; do
  IFS=: read -r name display lang flag <<<"$k"
  mkdir -p "$tmp/kernels/$name"
  printf '{"argv": ["/usr/bin/node", "/opt/aenv-ci/js/aenv_jslab.js", "{connection_file}"%s], "display_name": "%s", "language": "%s"}\n' \
    "${flag:+, \"$flag\"}" "$display" "$lang" >"$tmp/kernels/$name/kernel.json"
done
mkdir -p "$tmp/kernels/ir"
echo '{"argv": ["/usr/bin/R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"], "display_name": "R", "language": "R"}' \
  >"$tmp/kernels/ir/kernel.json"

mmdebstrap --quiet --variant=minbase \
  --include="$packages" \
  --customize-hook='chroot "$1" useradd --create-home --uid 1000 --shell /bin/bash user' \
  --customize-hook='echo "user ALL=(ALL:ALL) NOPASSWD: ALL" > "$1/etc/sudoers.d/user"; chmod 0440 "$1/etc/sudoers.d/user"' \
  --customize-hook='chroot "$1" dpkg-divert --quiet --local --rename --divert /usr/bin/sudo.real --add /usr/bin/sudo' \
  --customize-hook='ln -s /.aenv/bin/sudo "$1/usr/bin/sudo"' \
  --customize-hook="cp -r '$tmp/wheels' \"\$1/tmp/aenv-wheels\"" \
  --customize-hook='chroot "$1" python3 -m venv /opt/aenv-ci' \
  --customize-hook='chroot "$1" env -i PATH=/usr/bin:/bin HOME=/root /opt/aenv-ci/bin/pip install --quiet --disable-pip-version-check --no-index --find-links /tmp/aenv-wheels -r /tmp/aenv-wheels/requirements.txt' \
  --customize-hook="install -m 0644 '$src/server.py' \"\$1/opt/aenv-ci/server.py\"" \
  --customize-hook="install -m 0755 '$src/supervise.sh' \"\$1/opt/aenv-ci/supervise.sh\"" \
  --customize-hook="install -m 0644 '$src/aenv_ci_display.py' '$src/aenv_ci_charts.py' '$src/aenv_ci_kernels.py' \"\$1/opt/aenv-ci/lib/python3.11/site-packages/\"" \
  --customize-hook="cp -r '$tmp/js' \"\$1/opt/aenv-ci/js\"" \
  --customize-hook="mkdir -p \"\$1/opt/aenv-ci/share/jupyter\" && cp -r '$tmp/kernels/.' \"\$1/opt/aenv-ci/share/jupyter/kernels/\"" \
  --customize-hook='chroot "$1" /opt/aenv-ci/bin/python -m bash_kernel.install --sys-prefix >/dev/null' \
  --customize-hook='chroot "$1" /opt/aenv-ci/bin/python -m compileall -q /opt/aenv-ci/server.py /opt/aenv-ci/lib/python3.11/site-packages/aenv_ci_display.py /opt/aenv-ci/lib/python3.11/site-packages/aenv_ci_charts.py /opt/aenv-ci/lib/python3.11/site-packages/aenv_ci_kernels.py' \
  --customize-hook='chroot "$1" env -i PATH=/usr/bin:/bin HOME=/root MPLBACKEND=agg /opt/aenv-ci/bin/python -c "import matplotlib.pyplot"' \
  --customize-hook='rm -rf "$1/tmp/aenv-wheels" "$1"/root/.cache/pip' \
  --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/* "$1"/usr/share/doc/* "$1"/usr/share/man/*' \
  bookworm "$tmp/rootfs"
# Login shells cheap, as in base (build-base-template.sh): the SDK runs every command as
# `bash -l -c`, and /etc/profile's "$(id -u)" started an `id` process for each; bash
# knows its EUID (sh still asks id). Root's `mesg n` only on a terminal.
sed -i 's/"\$(id -u)"/"${EUID:-$(id -u)}"/' "$tmp/rootfs/etc/profile"
sed -i 's|^mesg n 2> /dev/null \|\| true$|if [ -t 0 ]; then mesg n 2> /dev/null \|\| true; fi|' \
  "$tmp/rootfs/root/.profile"

# The server and its kernels run as root, as E2B's, with its log in the sandbox.
start='exec /opt/aenv-ci/supervise.sh >>/tmp/code-interpreter.log 2>&1'
python3 - "$tmp/template.json" "$build_id" "$start" "$java" <<'PY'
import json, sys, time
path, build_id, start, java = sys.argv[1:]
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
    "source": "mmdebstrap bookworm minbase + /opt/aenv-ci (ipykernel, the data stack, bash_kernel), "
              "tslab (JavaScript, TypeScript), IRkernel (R)" + (", JJava (Java)" if java == "1" else ""),
}, open(path, "w"), indent=1)
PY
if [ -e "$dest" ]; then mv "$dest" "$tmp/old"; fi
mv "$tmp" "$dest"
rm -rf "$dest/old" "$dest/wheels"
trap - EXIT
echo "template code-interpreter: $dest"
