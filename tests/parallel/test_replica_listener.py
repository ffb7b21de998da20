"""``ReplicaListener``: the server's wait for its replicas' connections, which a failed launch or a deadline ends."""
from __future__ import annotations

import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest

from omni.parallel.replica_listener import POLL_S, ConnectAbandoned, ReplicaListener

pytestmark = pytest.mark.timeout(60)  # a wait that does not end must fail, not hang the suite


def test_a_wait_nobody_answers_ends_with_the_reason_give_up_gives():
    listener = ReplicaListener(b"key")
    asked = []

    def give_up():
        asked.append(time.monotonic())
        return "the launch failed" if len(asked) == 3 else None

    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectAbandoned, match="the launch failed"):
            listener.accept(give_up)
        assert len(asked) == 3 and time.monotonic() - t0 >= 2 * POLL_S, "asked between slices, not in a busy loop"
    finally:
        listener.close()


def test_a_rank_connecting_with_the_key_gets_a_working_link():
    listener = ReplicaListener(b"key")
    sent = []

    def rank():
        with Client(listener.address, authkey=b"key") as c:
            c.send(("ready", 0, {"rank": 0}))
            sent.append(c.recv())

    thread = threading.Thread(target=rank)
    thread.start()
    try:
        conn = listener.accept(lambda: None)
        assert conn.recv() == ("ready", 0, {"rank": 0})
        conn.send("ack")
        thread.join(10)
        assert sent == ["ack"]
    finally:
        listener.close()


def test_a_client_with_another_key_is_dropped_and_the_rank_after_it_accepted():
    """A stray connection (another key) fails its handshake on both sides; the wait goes on and the real rank
    connecting next gets the link."""
    listener = ReplicaListener(b"key")
    stranger_errors = []

    def clients():
        try:
            Client(listener.address, authkey=b"other")
        except (AuthenticationError, OSError, EOFError) as e:
            stranger_errors.append(e)
        with Client(listener.address, authkey=b"key") as c:
            c.send("rank 0")

    thread = threading.Thread(target=clients)
    thread.start()
    try:
        conn = listener.accept(lambda: None)
        assert conn.recv() == "rank 0"
        thread.join(10)
        assert stranger_errors, "the stranger's side fails too"
    finally:
        listener.close()


def test_a_client_that_connects_and_says_nothing_is_dropped_after_the_handshake_time(monkeypatch):
    """A connection that never answers the challenge cannot hold the wait: it is dropped after
    ``HANDSHAKE_S`` and the rank connecting after it is accepted, its link without that timeout."""
    import socket

    from omni.parallel import replica_listener

    monkeypatch.setattr(replica_listener, "HANDSHAKE_S", 0.3)
    listener = ReplicaListener(b"key")
    silent = socket.create_connection(listener.address)
    got = []

    def rank():
        time.sleep(0.5)
        with Client(listener.address, authkey=b"key") as c:
            time.sleep(0.6)  # longer than the handshake's time: the accepted link must still wait for it
            c.send("rank 0")
            got.append(c.recv())

    thread = threading.Thread(target=rank)
    thread.start()
    try:
        conn = listener.accept(lambda: None)
        assert conn.recv() == "rank 0"
        conn.send("ack")
        thread.join(10)
        assert got == ["ack"]
    finally:
        silent.close()
        listener.close()
