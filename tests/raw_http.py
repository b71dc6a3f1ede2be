"""Requests written on raw sockets, for servers that must refuse any ``Authorization``
value: aiohttp's client refuses to send most of these, and a server must not rely on
clients being polite. Used by the builtin server's and the URL bucket sender's tests,
which share one authorisation rule (``inference.server.auth``)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable


def random_authorization_values(n: int, *, seed: int, token: bytes) -> list[bytes]:
    """``n`` header values no valid request carries (the right one is ``Bearer token``):
    fixed edge cases, then random bytes of every kind."""
    right = b"Bearer " + token
    rng = random.Random(seed)
    fixed = [
        b"",
        right.lower(),  # wrong case
        right.upper(),
        token,  # no scheme
        b"Bearer  " + token,
        b"Basic dGVzdC10b2tlbg==",
        right + b"\x00",  # the right key, then a control byte
        b"Bearer \xff\xfe\xfd",  # not UTF-8
        b"Bearer \xed\xa0\x80",  # a UTF-8-encoded surrogate
        b"Bearer caf\xe9",  # latin-1
        b"Bearer \x7f\x01\x1b[0m",
        b"Bearer " + b"A" * 8000,  # long, still under aiohttp's 8190-byte line limit
        b"Bearer " + b"A" * 20000,  # over it: refused by the parser itself
        right[:9] + b"\r\n-" + right[9:] + b": 1",  # a line break inside the key
    ]
    values = [v for v in fixed if v != right]
    while len(values) < n:
        kind = rng.randrange(4)
        if kind == 0:  # any byte at all
            value = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        elif kind == 1:  # bytes >= 0x80 only: never valid UTF-8 in some of them
            value = b"Bearer " + bytes(rng.randrange(128, 256) for _ in range(rng.randrange(1, 32)))
        elif kind == 2:  # one control byte inside the right value
            # Not HTAB, CR or LF: at either end the parser strips or ends the line
            # there, and what is left is the valid header.
            edited = bytearray(right)
            control = rng.choice([c for c in (*range(32), 127) if c not in (9, 10, 13)])
            edited.insert(rng.randrange(len(edited) + 1), control)
            value = bytes(edited)
        else:  # printable but wrong, sometimes huge
            size = rng.choice([1, 16, 200, 9000])
            value = bytes(rng.randrange(33, 127) for _ in range(size))
        if value != right:
            values.append(value)
    return values


def splits_the_head(value: bytes) -> bool:
    """A CR or LF ends the header line there; the rest would be read as a next request."""
    return b"\r" in value or b"\n" in value


async def read_reply(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """Status, lower-cased headers and body of one HTTP/1.x reply."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    version, status = status_line.split()[:2]
    if version == "HTTP/1.0":  # a reply to a head the parser refused: closed after it
        headers.setdefault("connection", "close")
    return int(status), headers, body


async def send_each(
    port: int, values: list[bytes], request: Callable[[bytes, bool], bytes]
) -> list[tuple[int, dict[str, str], bytes]]:
    """One reply per ``Authorization`` value, ``request(value, close)`` writing the
    request; a connection is reused while the server keeps it open."""
    replies = []
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    try:
        for value in values:
            split = splits_the_head(value)
            if connection is None or split:
                if connection is not None:
                    connection[1].close()
                connection = await asyncio.open_connection("127.0.0.1", port)
            reader, writer = connection
            writer.write(request(value, split))
            await writer.drain()
            status, headers, body = await asyncio.wait_for(read_reply(reader), 30)
            replies.append((status, headers, body))
            if split or headers.get("connection", "").lower() == "close":
                writer.close()
                connection = None
    finally:
        if connection is not None:
            connection[1].close()
    return replies
