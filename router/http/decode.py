"""Request bodies in their ``Content-Encoding``: decoded here, not by aiohttp.

aiohttp's own decompression (turned off where the server is built, ``router.cli.serve``)
passed an unknown coding (``x-bogus``) through as if it were plain, answered ``zstd`` with a
text/plain 400 asking the operator to install a package, and decoded only the last of stacked
codings (``gzip, gzip``). Here every coding the header lists is decoded, last applied first
(RFC 9110, 8.4), each bounded to the body limit (a small body that inflates past it is a 413, as
a large one is); a coding we do not know is a 415 naming the ones we do, and data that is not
what its coding says is a 400 naming the coding. Supported: identity, gzip (also ``x-gzip``),
deflate (zlib-wrapped or raw, as browsers send it) and br (the ``brotli`` package, a
dependency; without it, br is refused as unknown).
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable
from typing import Any

from router.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:  # a dependency; without it, its coding is refused as unknown
        return None


_BROTLI = _module("brotli")

# More codings than this is not a client, it is a way to spend the proxy's CPU.
MAX_CODINGS = 4
_GZIP_WBITS = 16 + zlib.MAX_WBITS


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"request body too large once decoded: more than {limit} bytes", param="Content-Encoding"
    )


def _zlib(data: bytes, wbits: int, limit: int) -> bytes:
    """Every member of a zlib, raw deflate or gzip stream, at most ``limit`` bytes of output."""
    out: list[bytes] = []
    size = 0
    while True:
        inflater = zlib.decompressobj(wbits)
        chunk = inflater.decompress(data, limit + 1 - size)
        size += len(chunk)
        out.append(chunk)
        if size > limit or inflater.unconsumed_tail:
            raise _too_large(limit)
        if not inflater.eof:
            raise zlib.error("the data ends before the end of its stream")
        data = inflater.unused_data
        # gzip allows several members one after the other (RFC 1952, 2.2); zlib does not.
        if not data or wbits != _GZIP_WBITS:
            if data:
                raise zlib.error("data after the end of the stream")
            return b"".join(out)


def _gzip(data: bytes, limit: int) -> bytes:
    return _zlib(data, _GZIP_WBITS, limit)


def _deflate(data: bytes, limit: int) -> bytes:
    # "deflate" means zlib-wrapped (RFC 9110, 8.4.1.2); some clients send raw deflate.
    try:
        return _zlib(data, zlib.MAX_WBITS, limit)
    except zlib.error:
        return _zlib(data, -zlib.MAX_WBITS, limit)


def _brotli(data: bytes, limit: int) -> bytes:
    decoder = _BROTLI.Decompressor()
    out = [decoder.process(data, output_buffer_limit=limit + 1)]
    size = len(out[0])
    while size <= limit and not decoder.is_finished() and not decoder.can_accept_more_data():
        out.append(decoder.process(b"", output_buffer_limit=limit + 1 - size))
        size += len(out[-1])
    if size > limit:
        raise _too_large(limit)
    if not decoder.is_finished():
        raise ValueError("the data ends before the end of its stream")
    return b"".join(out)


def _identity(data: bytes, limit: int) -> bytes:
    return data


_DECODERS: dict[str, Callable[[bytes, int], bytes]] = {
    "identity": _identity,
    "gzip": _gzip,
    "x-gzip": _gzip,
    "deflate": _deflate,
}
if _BROTLI is not None:
    _DECODERS["br"] = _brotli
# What a coding's decoder raises on data that is not in that coding.
_CORRUPT: tuple[type[Exception], ...] = (zlib.error, ValueError)
if _BROTLI is not None:
    _CORRUPT += (_BROTLI.error,)

SUPPORTED = tuple(name for name in _DECODERS if name != "x-gzip")


def codings(header: str) -> list[str]:
    """The header's codings in the order they were applied; 415 for one we cannot decode."""
    names = [part.strip().lower() for part in header.split(",")]
    names = [name for name in names if name]
    for name in names:
        if name not in _DECODERS:
            raise UnsupportedMediaType(
                f"Content-Encoding {name!r} is not supported; send the body in one of:"
                f" {', '.join(SUPPORTED)}",
                param="Content-Encoding",
            )
    if len(names) > MAX_CODINGS:
        raise BadRequest(
            f"Content-Encoding lists {len(names)} codings; at most {MAX_CODINGS} are decoded",
            param="Content-Encoding",
        )
    return names


def decode_body(raw: bytes, header: str | None, limit: int) -> bytes:
    """``raw`` as sent with ``Content-Encoding: header``, decoded to at most ``limit`` bytes."""
    if header is None:
        return raw
    data = raw
    for name in reversed(codings(header)):
        try:
            data = _DECODERS[name](data, limit)
        except _CORRUPT as exc:
            raise BadRequest(
                f"the request body could not be decoded as Content-Encoding {name!r}: {exc}",
                param="Content-Encoding",
            ) from exc
    return data
