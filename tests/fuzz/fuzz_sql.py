"""The SQL proxy's wire decoders (jukebox.sql.messages) on any bytes from the agent.

Each documents ProtocolError as its only refusal; anything else escaping is a crash of the
connection's handler. The first byte picks the message type, the rest is its body.
"""

from __future__ import annotations

import struct

from jukebox.sql import messages as m
from jukebox.sql.statements import split
from tests.fuzz.common import Target

_DECODERS = {
    ord("Q"): m.decode_query,
    ord("P"): m.decode_parse,
    ord("B"): m.decode_bind,
    ord("D"): m.decode_describe,
    ord("C"): m.decode_close,
    ord("E"): m.decode_execute,
    ord("K"): m.decode_cancel,
}


def _seeds() -> list[bytes]:
    bind = m.Bind("", "s1", [0, 1], [b"42", None], [1]).encode()[5:]
    return [
        b"Qselect 1\0",
        b"Ps1\0select $1\0\0\x01\0\0\0\x17",
        b"B" + bind,
        b"DSs1\0",
        b"CP\0",
        b"E\0\0\0\0\0",
        b"S" + struct.pack("!i", m.PROTOCOL_3) + b"user\0a\0database\0b\0\0",
        b"Qbegin; commit; savepoint jukebox_tx; vacuum\0",
    ]


def sql_input(data: bytes) -> None:
    if not data:
        return
    kind, body = data[0], data[1:]
    try:
        if kind == ord("S"):
            code = struct.unpack("!i", body[:4])[0] if len(body) >= 4 else m.PROTOCOL_3
            m.decode_startup(code, body[4:])
        else:
            decoded = _DECODERS.get(kind, m.decode_query)(body)
            if isinstance(decoded, str):
                split(decoded)  # the classifier takes whatever text decoded
            elif isinstance(decoded, (m.Parse, m.Bind)):
                again = decoded.encode()
                redo = m.decode_parse if isinstance(decoded, m.Parse) else m.decode_bind
                if redo(again[5:]) != decoded:
                    raise AssertionError(f"{decoded!r} does not survive encoding")
    except m.ProtocolError:
        pass


TARGETS = [Target("sql", sql_input, _seeds, "the SQL proxy's wire message decoders")]
