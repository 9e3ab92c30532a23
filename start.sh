#!/usr/bin/env bash
# Start twinspark as deploy/.env says: checks, prepare, the workers' ranks (ssh + docker compose) then the head,
# wait for /health, a smoke test, then the endpoint. `./start.sh --dry-run` prints the plan; `--help` for more.
set -euo pipefail
cd "$(dirname "$0")"
exec "${PYTHON3:-python3}" -m deploy.ctl start "$@"
