#!/usr/bin/env bash
# What ./start.sh and ./stop.sh run: `python3 -m deploy.ctl start|stop ...` (the standard library only), once the
# python3 that runs it is there and new enough; else one line saying what to install, and exit 1.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON3:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 9))' >/dev/null 2>&1; then
    echo "$1: $python (3.9 or newer) is needed: install python3 (apt-get install python3), or set PYTHON3" >&2
    exit 1
fi
exec "$python" -m deploy.ctl "$@"
