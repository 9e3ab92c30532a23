"""STAND-IN for the real role services, used only by tests/launcher: NOT the real gateway, scheduler or rank worker.

`twinspark up --role-command "python tests/launcher/standin_role.py"` runs this in place of `twinspark serve-<role>`.
It checks the flag contract of its role (argparse exits 2 on a missing or unknown flag), serves HTTP on --host:--port
(`/health`; the gateway stand-in answers 200 only once its --scheduler port accepts connections, and `/v1/models`),
and misbehaves on request through environment variables (the launcher passes its environment to the children):

  STANDIN_PIDDIR=DIR          write DIR/<name>.pid and start a `sleep` grandchild in the same process group,
                              its pid in DIR/<name>.grandchild (name: rank0, rank1, scheduler, gateway)
  STANDIN_FAIL_AT_START=NAME:CODE        NAME prints a message and exits with CODE before listening
  STANDIN_CRASH_ON=NAME:CODE:FILE        NAME exits with CODE once FILE exists, removing FILE (one crash per touch,
                              so a restarted NAME runs on)
  STANDIN_STUBBORN=NAME       NAME and its grandchild ignore SIGTERM (only SIGKILL stops them)
  STANDIN_UNHEALTHY=1         the gateway's /health always answers 503
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


def _write_pid(piddir: str, filename: str, pid: int) -> None:
    """Write-then-rename, so a test polling the folder never reads a half-written (empty) pid file."""
    tmp = os.path.join(piddir, f".{filename}.tmp")
    with open(tmp, "w") as f:
        f.write(str(pid))
    os.replace(tmp, os.path.join(piddir, filename))


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="standin_role")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("serve-rank")
    for flag in ("--model", "--master-addr", "--host"):
        r.add_argument(flag, required=True)
    for flag in ("--rank", "--world", "--master-port", "--peer-port", "--port", "--random-block-size"):
        r.add_argument(flag, type=int, required=True)
    r.add_argument("--device", choices=("cpu", "cuda"), required=True)
    r.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), required=True)
    r.add_argument("--rest-fp8-kernel", choices=("triton", "humming"), required=True)
    r.add_argument("--collective", choices=("auto", "nccl", "ipc", "gloo"), required=True)
    r.add_argument("--enforce-eager", action="store_true")
    s = sub.add_parser("serve-scheduler")
    s.add_argument("--ranks", required=True)
    s.add_argument("--num-scheduler-steps", type=int, required=True)
    s.add_argument("--drafter")
    s.add_argument("--draft-hidden", action="store_true")
    s.add_argument("--tokenizer", required=True)
    s.add_argument("--kv-events-endpoint")
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, required=True)
    d = sub.add_parser("serve-drafter")
    for flag in ("--model", "--host"):
        d.add_argument(flag, required=True)
    d.add_argument("--port", type=int, required=True)
    d.add_argument("--method", choices=("copy", "mtp"), required=True)
    d.add_argument("--device", choices=("cpu", "cuda"), required=True)
    g = sub.add_parser("serve-gateway")
    g.add_argument("--model", required=True)
    g.add_argument("--scheduler", required=True)
    g.add_argument("--host", required=True)
    g.add_argument("--port", type=int, required=True)
    g.add_argument("--strict-request-fields", action="store_true")
    return p.parse_args(argv)


def _for_me(var: str, name: str) -> list[str] | None:
    parts = os.environ.get(var, "").split(":")
    return parts[1:] if parts[0] == name else None


def main() -> None:
    args = parse(sys.argv[1:])
    name = f"rank{args.rank}" if args.cmd == "serve-rank" else args.cmd.removeprefix("serve-")
    print(f"stand-in {name}: {json.dumps(sys.argv[1:])}", flush=True)
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):  # an MPS client on a GPU (tests/launcher/test_mps.py)
        print(f"stand-in {name}: CUDA_MPS_PIPE_DIRECTORY={os.environ['CUDA_MPS_PIPE_DIRECTORY']}", flush=True)
    if args.cmd == "serve-rank":
        assert 0 <= args.rank < args.world, "rank out of range"
        assert os.path.isdir(args.model), f"no model dir {args.model}"
    stubborn = os.environ.get("STANDIN_STUBBORN") == name
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the grandchild: only SIGKILL stops either
    else:
        signal.signal(signal.SIGTERM, lambda *_: (print(f"stand-in {name}: SIGTERM, exiting", flush=True),
                                                  os._exit(0)))
    piddir = os.environ.get("STANDIN_PIDDIR")
    if piddir:
        _write_pid(piddir, f"{name}.pid", os.getpid())
        gc = subprocess.Popen(["sleep", "600"])
        _write_pid(piddir, f"{name}.grandchild", gc.pid)
    fail = _for_me("STANDIN_FAIL_AT_START", name)
    if fail:
        print(f"stand-in {name}: boom, failing at start on purpose", flush=True)
        sys.exit(int(fail[0]))
    crash = _for_me("STANDIN_CRASH_ON", name)
    if crash:
        code, trigger = int(crash[0]), ":".join(crash[1:])

        def watch() -> None:
            while not os.path.exists(trigger):
                time.sleep(0.05)
            print(f"stand-in {name}: crashing on purpose with code {code}", flush=True)
            os.remove(trigger)
            os._exit(code)

        threading.Thread(target=watch, daemon=True).start()

    scheduler = args.scheduler.rsplit(":", 1) if args.cmd == "serve-gateway" else None

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/health":
                ok = True
                if scheduler is not None:
                    ok = os.environ.get("STANDIN_UNHEALTHY") != "1"
                    try:
                        socket.create_connection((scheduler[0], int(scheduler[1])), timeout=0.5).close()
                    except OSError:
                        ok = False
                self._reply(200 if ok else 503, {"status": "ok" if ok else "unavailable"})
            elif self.path == "/v1/models" and scheduler is not None:
                self._reply(200, {"object": "list", "data": [{"id": "standin-model", "object": "model"}]})
            else:
                self._reply(404, {"error": "not found"})

        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = HTTPServer((args.host, args.port), Handler)
    print(f"stand-in {name}: listening on {args.host}:{args.port}", flush=True)
    server.serve_forever(poll_interval=0.1)


if __name__ == "__main__":
    main()
