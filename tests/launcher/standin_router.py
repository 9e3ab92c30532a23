"""STAND-IN for vllm-router, used only by tests/launcher: NOT the real router (tests/e2e/test_router.py runs that).

`twinspark up --replicas N --router-command "python tests/launcher/standin_router.py"` runs this in place of
vllm-router. It takes the flags `up` passes (argparse exits 2 on a missing one), writes its argv as JSON to
$STANDIN_ROUTER_ARGV when set, and serves `/health` on --host:--port: 200 while any worker's /health answers 200.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="standin_router")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker-urls", nargs="+", required=True)
    p.add_argument("--policy", required=True)
    for flag in ("--prometheus-host", "--prometheus-port", "--health-check-interval-secs",
                 "--health-failure-threshold", "--health-success-threshold", "--cb-failure-threshold",
                 "--cb-timeout-duration-secs"):
        p.add_argument(flag, required=True)
    return p.parse_known_args(argv)[0]  # --router-args may add any of the real router's flags


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def main() -> None:
    args = parse(sys.argv[1:])
    if os.environ.get("STANDIN_ROUTER_ARGV"):
        with open(os.environ["STANDIN_ROUTER_ARGV"], "w") as f:
            json.dump(sys.argv[1:], f)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            ok = self.path == "/health" and any(healthy(u) for u in args.worker_urls)
            data = json.dumps({"ok": ok}).encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    HTTPServer((args.host, args.port), Handler).serve_forever(poll_interval=0.1)


if __name__ == "__main__":
    main()
