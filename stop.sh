#!/usr/bin/env bash
# Stop what ./start.sh started (warns when requests are running; keeps the logs under STATE_DIR/logs/<time>/).
exec "$(dirname "$0")/deploy/ctl.sh" stop "$@"
