#!/usr/bin/env bash
# Start twinspark as deploy/.env says: checks, prepare, the workers' ranks (ssh + docker compose) then the head,
# wait for /health, a smoke test, then the endpoint. `./start.sh --dry-run` prints the plan; `--help` for more.
exec "$(dirname "$0")/deploy/ctl.sh" start "$@"
