#!/bin/bash
# Keeps the code-interpreter server (server.py, which owns the Jupyter kernels)
# running, as E2B's template does with its service manager: if it dies, it is
# started again after a short pause. Its kernels go with it (a kernel exits when
# its parent does) and the new server starts fresh default contexts. The kernels
# run as root in /home/user, as E2B's, with the environment's bin first on PATH
# (pip installs into it).
export HOME=/root USER=root LOGNAME=root
export PATH=/opt/aenv-ci/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# A crash of the server leaves its Python traceback in the log.
export PYTHONFAULTHANDLER=1
cd /home/user || exit 1
while :; do
  /opt/aenv-ci/bin/python /opt/aenv-ci/server.py
  echo "supervise: server.py exited with $?; starting it again" >&2
  sleep 0.5
done
