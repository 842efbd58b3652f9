"""A relayed stream's head goes out with its first piece in one write (`HeldWrites`):
one system call and one wake-up of the client before its first token, not two."""

from __future__ import annotations

import asyncio

from rps_astro_cli.protocol.http_server import HOLD_WRITES, HeldWrites
from rps_astro_cli.services.scheduler.relay import RelayResponse


class Transport:
    """Records each write, as a socket would see it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing


def test_held_writes_go_out_as_one_and_then_pass_straight_on():
    t = Transport()
    h = HeldWrites(t)
    h.write(b"a")
    h.hold()
    h.write(b"b")
    h.write(b"c")
    assert t.writes == [b"a"]  # held
    h.flush()
    h.write(b"d")
    h.flush()  # nothing held: no empty write
    assert t.writes == [b"a", b"bc", b"d"]
    assert h.is_closing() is False  # the transport's own
    h.hold()
    h.write(b"e")
    t.closing = True
    h.flush()  # the connection went away meanwhile: nothing is written to it
    assert t.writes == [b"a", b"bc", b"d"]


def relay_writes(pieces: list[bytes], hold: bool) -> list[bytes]:
    """The writes a `RelayResponse` of `pieces` makes through a server that writes each
    ASGI message as it comes (as uvicorn's HTTP/1.1 protocol does)."""
    t = Transport()
    held = HeldWrites(t)

    async def content():
        for p in pieces:
            await asyncio.sleep(0)
            yield p

    async def send(msg):
        if msg["type"] == "http.response.start":
            held.write(b"HEAD")
        elif msg["body"] or not msg["more_body"]:
            held.write(msg["body"] or b"END")

    async def receive():
        await asyncio.sleep(3600)  # the client stays

    async def nothing():
        return None

    scope = {"type": "http", "extensions": {HOLD_WRITES: held} if hold else {}}
    asyncio.run(RelayResponse(content(), nothing, 200, {"content-type": "text/event-stream"})(scope, receive, send))
    return t.writes


def test_a_relayed_stream_writes_its_head_with_its_first_piece():
    events = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    assert relay_writes(events, hold=True) == [b"HEAD" + events[0], events[1], events[2], b"END"]
    # a server without the extension: one write per message, as before
    assert relay_writes(events, hold=False) == [b"HEAD", *events, b"END"]
    # an empty body still sends its head (at the end of the pieces, with none held back)
    assert relay_writes([], hold=True) == [b"HEAD", b"END"]
