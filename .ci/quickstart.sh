#!/usr/bin/env bash
# The README's quick start, run as a new user runs it: a copy of this checkout in a new folder, the README's own
# install line in a fresh venv (no dev extras), the service started detached and asked one chat completion with the
# README's curl, stopped, and no process left behind; then the README's offline commands and `./start.sh --dry-run`.
# The commands are read from the README's blocks tagged `<!-- ci: NAME -->`, so the README and CI cannot drift.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d /tmp/twinspark-quickstart.XXXXXX)"
say() { echo "[quickstart] $*"; }

cleanup() {
    # whatever the run left (it must leave nothing: that is checked below, this only keeps the machine clean)
    pkill -KILL -f "$work/" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

# This checkout's files as they are (tracked and untracked-not-ignored), never its venv, caches or deploy/.env.
mkdir -p "$work/repo"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
    | tar --null --ignore-failed-read -T - -cf -) 2>/dev/null | tar -xf - -C "$work/repo"
cd "$work/repo"
readme_block() { python3 .ci/readme_block.py "$1" README.md; }

# A new user's twinspark state: no cached tiny checkpoint, no earlier run.
export TWINSPARK_CACHE_DIR="$work/cache" TWINSPARK_STATE_DIR="$work/state"
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
export TWINSPARK_PORT="$port"

install="$(readme_block quickstart)"
case "$install" in
    *"&& twinspark up") ;;
    *) say "the README's quick start no longer ends with '&& twinspark up': update .ci/quickstart.sh"; exit 1 ;;
esac
# The README's line ends by serving in the foreground; CI runs everything before that, then serves detached.
say "install, as the README says: ${install% && twinspark up}"
t0=$(date +%s)
bash -euo pipefail -c "${install% && twinspark up}"
say "installed in $(( $(date +%s) - t0 )) s"
. .venv/bin/activate
if python -c 'import transformers' 2>/dev/null || python -c 'import pytest' 2>/dev/null; then
    say "the quick start's venv has dev packages in it: it is not a new user's install"; exit 1
fi

say "twinspark up --detach (port $port)"
twinspark up --detach
ask="$(readme_block ask | sed "s/127\.0\.0\.1:8888/127.0.0.1:$port/g")"
say "ask, as the README says: $ask"
reply="$(bash -euo pipefail -c "$ask")"
echo "$reply"
python3 -c 'import json, sys; r = json.loads(sys.argv[1]); assert r["choices"][0]["message"] is not None, r; \
assert r["usage"]["completion_tokens"] > 0, r' "$reply" || { say "no chat completion in the reply"; twinspark down; exit 1; }
twinspark down
sleep 1
if pgrep -af "$work/" | grep -v pgrep; then
    say "processes left after twinspark down (listed above)"; exit 1
fi

offline="$(readme_block offline)"
say "offline, as the README says: $offline"
out="$(bash -euo pipefail -c "$offline")"
echo "$out"
python3 -c 'import json, sys; r = json.loads(sys.argv[1].strip().splitlines()[-1]); assert r["token_ids"], r' "$out"

dry="$(readme_block start-dry-run)"
say "start.sh, as the README says: $dry"
bash -euo pipefail -c "$dry"
say "the README's quick start works"
