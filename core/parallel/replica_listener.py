"""Where the server waits for its replicas to connect: a localhost listener whose waits can be given up.

``multiprocessing.connection.Listener.accept()`` blocks in the kernel, and closing
the listener from another thread does not wake it on Linux: a launch whose
ranks died, or a connect timeout, would leave the server waiting for ever.
``ReplicaListener.accept`` waits in short slices instead and asks ``give_up``
between them. A connection it accepts is authenticated exactly as the
Listener would (the same challenge, both ways), so the ranks connect with
``multiprocessing.connection.Client(address, authkey=...)`` unchanged.
"""
from __future__ import annotations

import logging
import select
import socket
import struct
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Callable

log = logging.getLogger(__name__)
POLL_S = 0.2  # how often a wait looks at ``give_up`` (a failed launch, the deadline)
HANDSHAKE_S = 10.0  # a client that connects and then says nothing is dropped after this long


class ConnectAbandoned(Exception):
    """``give_up`` gave a reason to stop waiting; the message is that reason."""


class ReplicaListener:
    """One listening socket on 127.0.0.1 (a free port); ``address`` is what the ranks connect to."""

    def __init__(self, authkey: bytes):
        self.authkey = authkey
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = self._sock.getsockname()

    def accept(self, give_up: Callable[[], str | None]) -> Connection:
        """The next rank's authenticated connection; raises ``ConnectAbandoned`` once ``give_up()`` returns a
        reason (it is asked every ``POLL_S`` while nobody connects). A client that fails the handshake (another
        key, a hang-up) is dropped and the wait goes on: a stray connection must not end the launch."""
        while True:
            while not select.select([self._sock], [], [], POLL_S)[0]:
                reason = give_up()
                if reason:
                    raise ConnectAbandoned(reason)
            conn = self._authenticated(self._sock.accept()[0])
            if conn is not None:
                return conn

    def _authenticated(self, sock: socket.socket) -> Connection | None:
        sock.setblocking(True)
        _receive_timeout(sock, HANDSHAKE_S)  # the kernel's own: the connection reads the bare descriptor
        fd = sock.detach()
        conn = Connection(fd)
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
        except (AuthenticationError, OSError, EOFError) as e:
            log.warning("dropped a connection to the replica listener that failed the handshake: %r", e)
            conn.close()
            return None
        link = socket.socket(fileno=fd)  # a view of the same descriptor, to lift the timeout: the link waits
        _receive_timeout(link, 0.0)      # as long as a replica takes (requests, warm-up)
        link.detach()
        return conn

    def close(self) -> None:
        self._sock.close()


def _receive_timeout(sock: socket.socket, seconds: float) -> None:
    """``SO_RCVTIMEO`` (a Linux ``struct timeval``; 0 waits for ever): a blocking read past it fails."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))
