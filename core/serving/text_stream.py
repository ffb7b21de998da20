"""A growing text answer as append-only pieces: what a stream may send of each cumulative text (no web imports).

The engine publishes the CUMULATIVE answer after every step that changed it
(``Ticket.updates``). A stream sends differences, and a client only ever
appends them, so nothing it has received can be taken back. Two rules keep
the concatenated pieces equal to the final answer:

- a trailing U+FFFD (the detokenizer's stand-in for a character whose bytes
  are still incomplete) is held back until a later text replaces or confirms
  it;
- a cumulative text that does not start with what was already sent (the
  detokenizer revised the tail) sends nothing; sending resumes once a later
  text extends what was sent again. If the final text never does, the stream
  ends without the difference and ``TextDeltas.diverged`` is set (the caller
  logs it): the pieces are never re-sent or corrected.

``omni-run chat`` and the HTTP stream (``chat_text.py``) both use this.
"""
from __future__ import annotations

import queue

HELD = "\ufffd"  # the replacement character a byte-level detokenizer shows for an incomplete character


class TextDeltas:
    """What was sent of one answer so far, and what to send next."""

    def __init__(self):
        self.sent = ""
        self.diverged = False

    def push(self, cumulative: str) -> str:
        """The new piece of ``cumulative`` that is safe to send ("" when there is none yet)."""
        return self._extend(cumulative.rstrip(HELD))

    def finish(self, final: str) -> str:
        """The last piece: the rest of the final answer (nothing is held back any more)."""
        piece = self._extend(final)
        self.diverged = not final.startswith(self.sent)
        return piece

    def _extend(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece


def latest_update(ticket) -> str | None:
    """The newest cumulative text a ticket published since the last call (None: nothing new).

    Tickets of handles without streaming (multi-process replicas) have no ``updates``: their answer
    arrives whole with the result.
    """
    updates = getattr(ticket, "updates", None)
    latest = None
    while updates is not None:
        try:
            latest = updates.get_nowait()
        except queue.Empty:
            break
    return latest
