#!/usr/bin/env bash
# `make test` after its set-up (the venv, the JS SDKs, the console, the base template):
# - the code-interpreter template and the deployment image's base build beside the
#   parallel part (from scratch they take minutes, mostly downloads and dpkg; the
#   tests that need one wait for its build: tests/conftest.py, marker needs_build),
#   and their output follows that part's;
# - the lint runs beside it too (none of the tests needs it);
# - three pytest workers (TEST_WORKERS), a file each at a time: the suite mostly waits on
#   sandboxes, and a file's nodes stay its own;
# - then the files marked serial, alone: they compare figures with unloaded ones.
# Every run's log ends with the 25 slowest steps (--durations).
set -uo pipefail
cd "$(dirname "$0")/.."
venv=.venv
pending=$(mktemp -d)
trap 'rm -rf "$pending"' EXIT
export AENV_TEST_PENDING_BUILDS="$pending"

# Each build leaves <name>.rc (its exit status, written whole) when it ends.
build() {
  local name=$1 script=$2 rc=0
  bash "$script" >"$pending/$name.log" 2>&1 || rc=$?
  echo "$rc" >"$pending/$name.rc.tmp" && mv "$pending/$name.rc.tmp" "$pending/$name.rc"
  return "$rc"
}
: >"$pending/code-interpreter.log"; : >"$pending/deploy-base.log"
build code-interpreter scripts/build-code-interpreter-template.sh & ci=$!
build deploy-base scripts/build-deploy-base.sh & deploy=$!
make --no-print-directory lint >"$pending/lint.log" 2>&1 & lint=$!

status=0
"$venv/bin/pytest" -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder -m "not serial" \
  --durations=25 || status=$?
for job in "code-interpreter:$ci" "deploy-base:$deploy"; do
  if ! wait "${job#*:}"; then
    status=1
    echo "building ${job%%:*} failed:"; tail -n 40 "$pending/${job%%:*}.log"
  fi
done
wait "$lint" || status=$?
cat "$pending/lint.log"
"$venv/bin/pytest" -m serial --durations=25 || status=$?
exit "$status"
