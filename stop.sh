#!/usr/bin/env bash
# Stop what ./start.sh started (warns when requests are running; keeps the logs under STATE_DIR/logs/<time>/).
set -euo pipefail
cd "$(dirname "$0")"
exec "${PYTHON3:-python3}" -m deploy.ctl stop "$@"
