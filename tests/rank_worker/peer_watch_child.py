"""One rank's peer watchdog alone, as a process (no torch, no model): `python peer_watch_child.py RANK WORLD PORT
TIMEOUT`. Prints "watching" once the star is connected, then idles; the watchdog ends it with exit code 5."""

from __future__ import annotations

import logging
import sys
import time

from services.rank_worker.peer_watch import PeerWatch

if __name__ == "__main__":
    rank, world, port, timeout = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    logging.basicConfig(level="INFO", format=f"rank{rank} %(levelname)s %(message)s")
    PeerWatch(rank, world, master_addr="127.0.0.1", port=port, timeout_s=timeout, connect_timeout_s=30).start()
    print("watching", flush=True)
    while True:
        time.sleep(60)
