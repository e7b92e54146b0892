"""What the proxy reads of a replica's TensorRT-LLM engine directory: a checksum and the config.

The directory is the one the ``tensorrt_llm`` model's ``gpt_model_path`` names, as this process
sees it (a replica's ``engine_dir`` setting, e.g. a read-only mount of the engines in compose; by
default the path Triton reports, which works when proxy and replica share a file system).

An engine is gigabytes, and the monitor asks for the engine digest every few seconds, so the
checksum is only re-read when the caller says the engine may have been reloaded, and even then a
file is hashed again only when its size, mtime, ctime or inode changed. Hashing runs in a worker
thread. A directory the proxy cannot read gives the checksum ``"unreadable"`` (logged once), so
the digest still covers the model configs and the reuse flag.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import structlog

_log = structlog.get_logger("kvledger.backend")
_CHUNK = 1 << 20
Signature = tuple[int, int, int, int]  # size, mtime_ns, ctime_ns, inode


def _signature(stat: os.stat_result) -> Signature:
    return (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def max_input_len(config: dict[str, Any]) -> int | None:
    """``build_config.max_input_len`` (``builder_config`` in engines before TensorRT-LLM 0.8)."""
    for section in ("build_config", "builder_config"):
        value = (config.get(section) or {}).get("max_input_len")
        if isinstance(value, int) and value > 0:
            return value
    return None


class EngineDir:
    """The checksum and config of one replica's engine directory, cached between reloads."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self._hashes: dict[str, tuple[Signature, str]] = {}
        self._checksum: str | None = None
        self._config: dict[str, Any] | None = None
        self._path = ""
        self._unreadable: str | None = None

    def stale(self) -> None:
        """The engine may have been reloaded: read the directory again on the next request."""
        self._checksum = None
        self._config = None

    async def checksum(self, path: str) -> str:
        if self._checksum is not None and path == self._path:
            return self._checksum
        self._path = path
        checksum, self._config = await asyncio.to_thread(self._read, path)
        self._checksum = checksum
        return checksum

    async def config(self, path: str) -> dict[str, Any] | None:
        await self.checksum(path)
        return self._config

    def _read(self, path: str) -> tuple[str, dict[str, Any] | None]:
        root = Path(path)
        try:
            files = sorted(p for p in root.rglob("*") if p.is_file()) if path else []
            if not files:
                raise OSError(f"no engine files in {path!r}")
            digest = hashlib.sha256()
            for file in files:
                digest.update(f"{file.relative_to(root)}\0{self._file_hash(file)}\n".encode())
        except OSError as exc:
            if self._unreadable != str(exc):
                _log.warning("engine_dir_unreadable", replica=self.replica_id, error=str(exc))
                self._unreadable = str(exc)
            return "unreadable", None
        self._unreadable = None
        try:
            config = json.loads((root / "config.json").read_text())
        except (OSError, ValueError):
            config = None
        return digest.hexdigest(), config if isinstance(config, dict) else None

    def _file_hash(self, file: Path) -> str:
        key, signature = str(file), _signature(file.stat())
        cached = self._hashes.get(key)
        if cached is None or cached[0] != signature:
            cached = (signature, _hash_file(file))
            self._hashes[key] = cached
        return cached[1]
