"""Peer watchdog: a rank whose peer is gone leaves at once (exit 5) instead of hanging inside a collective.

Ranks of one group meet in collectives every round; when a peer dies, the survivors block in gloo / NCCL until
their (30-minute) timeout, holding the scheduler's round and the supervisor's restart hostage. torch gives no
asynchronous peer-death signal outside a collective (the TCPStore is only read when asked; monitored_barrier is
itself a collective that must be entered), so the watchdog is hand-rolled: a dedicated TCP heartbeat connection
per peer, in a star around rank 0, with daemon threads that never touch torch.

- rank 0 listens on `--peer-port`; every other rank connects to master-addr:peer-port (retrying until the connect
  timeout: rank 0 may still be on its way) and sends its rank.
- both ends send one heartbeat byte every `HEARTBEAT_S`; a peer silent for `timeout_s` (a frozen process, a cut
  link) or an EOF / reset (a dead process: the kernel closes a killed process's sockets) is lost.
- lost → log an error naming the peer and the reason, then `os._exit(EXIT_PEER_LOST)`: the main thread may be stuck
  inside a collective, so nothing short of ending the process frees it. The supervisor restarts the group.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from typing import Callable

log = logging.getLogger("twinspark.rank")

EXIT_PEER_LOST = 5  # next to server.EXIT_BAD_PLAN (3) and the fingerprint refusal (4)
HEARTBEAT_S = 0.5
_HELLO = struct.Struct("<4sI")  # magic, rank: what a connecting rank says first
_MAGIC = b"TSPW"
_BEAT = b"."


def leave_group(peer: int, reason: str) -> None:
    """The default reaction to a lost peer: log and end the process now (no cleanup, no atexit: see above)."""
    # The log handlers flush every record, so the line is out before the process ends.
    log.error("lost rank %d (%s): leaving the group so the supervisor restarts it", peer, reason)
    os._exit(EXIT_PEER_LOST)


class PeerWatch:
    """Heartbeats with the other ranks of one group; `on_lost(peer, reason)` is called once, from a daemon thread."""

    def __init__(self, rank: int, world: int, *, master_addr: str, port: int, timeout_s: float = 3.0,
                 connect_timeout_s: float = 60.0, on_lost: Callable[[int, str], None] = leave_group) -> None:
        if timeout_s <= HEARTBEAT_S:
            raise ValueError(f"the peer timeout must exceed the heartbeat interval {HEARTBEAT_S} s, got {timeout_s}")
        self.rank, self.world = rank, world
        self.master_addr, self.port = master_addr, port
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.on_lost = on_lost
        self._peers: dict[int, socket.socket] = {}
        self._lost = threading.Event()
        self._lost_lock = threading.Lock()

    def start(self) -> None:
        """Connect the star (blocks until every peer is connected; raises TimeoutError / OSError if it cannot),
        then start the heartbeat threads. A world of one has nobody to watch."""
        if self.world == 1:
            return
        self._peers = self._accept_all() if self.rank == 0 else {0: self._connect()}
        for peer, sock in self._peers.items():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout_s)  # a recv that waits this long means the peer went silent
            threading.Thread(target=self._listen, args=(peer, sock), name=f"peer-watch-rank{peer}",
                             daemon=True).start()
        threading.Thread(target=self._beat, name="peer-watch-heartbeat", daemon=True).start()
        log.info("peer watchdog: watching rank(s) %s (heartbeat %.1f s, timeout %.1f s)",
                 ", ".join(map(str, sorted(self._peers))), HEARTBEAT_S, self.timeout_s)

    def _accept_all(self) -> dict[int, socket.socket]:
        deadline = time.monotonic() + self.connect_timeout_s
        peers: dict[int, socket.socket] = {}
        with socket.create_server(("", self.port)) as server:  # every interface, like the torch TCPStore
            while len(peers) < self.world - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self.world)) - set(peers))
                    raise TimeoutError(f"peer watchdog: rank(s) {missing} did not connect to port {self.port} "
                                       f"within {self.connect_timeout_s:g} s")
                server.settimeout(left)
                try:
                    sock, addr = server.accept()
                except socket.timeout:
                    continue
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    magic, peer = _HELLO.unpack(_recv_exactly(sock, _HELLO.size))
                except (OSError, EOFError, struct.error) as exc:
                    log.warning("peer watchdog: dropped a connection from %s that did not say its rank (%s)", addr, exc)
                    sock.close()
                    continue
                if magic != _MAGIC or not 0 < peer < self.world or peer in peers:
                    log.warning("peer watchdog: dropped a connection from %s claiming to be rank %d", addr, peer)
                    sock.close()
                    continue
                peers[peer] = sock
        return peers

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                sock = socket.create_connection((self.master_addr, self.port), timeout=2.0)
                sock.sendall(_HELLO.pack(_MAGIC, self.rank))
                return sock
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"peer watchdog: cannot reach rank 0 at {self.master_addr}:{self.port} "
                                       f"within {self.connect_timeout_s:g} s ({exc})") from exc
                time.sleep(0.2)

    def _listen(self, peer: int, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(64)
            except socket.timeout:
                return self._lose(peer, f"silent for {self.timeout_s:g} s")
            except ConnectionResetError:  # a killed peer that had heartbeats unread resets instead of closing
                return self._lose(peer, "connection reset")
            except OSError as exc:
                return self._lose(peer, f"connection error: {exc}")
            if not data:
                return self._lose(peer, "connection closed")

    def _beat(self) -> None:
        while not self._lost.is_set():
            for peer, sock in list(self._peers.items()):
                try:
                    sock.sendall(_BEAT)
                except OSError as exc:
                    return self._lose(peer, f"heartbeat failed: {exc}")
            time.sleep(HEARTBEAT_S)

    def _lose(self, peer: int, reason: str) -> None:
        with self._lost_lock:  # a dead peer is often seen by its listener and the heartbeat at once: report it once
            if self._lost.is_set():
                return
            self._lost.set()
        self.on_lost(peer, reason)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf
