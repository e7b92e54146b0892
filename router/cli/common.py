"""What the CLI's subcommands share: where Redis and the proxy are, tables, one-line errors.

The command is the edge of the program, so it may read the environment; it hands what it read
to the same code the proxy runs (``KeyStore``, the ledger's readers). Heavy imports (Redis,
the ledger, urllib's HTTP stack) wait until a command runs, so ``kvledger --help`` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

if TYPE_CHECKING:
    from router.ledger import Ledger
    from router.ledger.connect import RedisClient

T = TypeVar("T")
Run = Callable[[argparse.Namespace], int]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PROXY_URL = "http://127.0.0.1:8000"
DEFAULT_TOKEN_ENV = "KVL_ADMIN_TOKEN"


class CliError(Exception):
    """Ends the command with one line on stderr and ``code`` (2: usage, 1: anything else)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def cli_errors(run: Run) -> Run:
    """A command's failures become one line and an exit code, never a traceback."""

    @functools.wraps(run)
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except CliError as exc:
            print(f"kvledger: {exc.message}", file=sys.stderr)
            return exc.code
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:
            # The reader (``| head``) left; point stdout at /dev/null so the interpreter's
            # final flush does not complain about the pipe either.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0

    return wrapped


# Redis ------------------------------------------------------------------------------------


def add_redis_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url",
        help=f"Redis to use (default: $KVL_REDIS_URL, $REDIS_URL, --config's, {DEFAULT_REDIS_URL})",
    )
    parser.add_argument("--config", type=Path, help="take redis_url from this proxy config")


def redis_url(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """--redis-url, else the environment, else --config's redis_url, else the local default:
    the order ``kvledger serve`` uses, so the command finds the proxy's Redis."""
    if args.redis_url:
        return str(args.redis_url)
    from_env = env.get("KVL_REDIS_URL") or env.get("REDIS_URL")
    if from_env:
        return from_env
    if args.config is not None:
        from router.settings import SettingsError, load_settings

        try:
            return load_settings(args.config, {}).redis_url
        except SettingsError as exc:
            raise CliError(str(exc), code=2) from None
    return DEFAULT_REDIS_URL


def shown_url(url: str) -> str:
    """The URL without its user and password, for messages."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    return scheme + sep + netloc.rpartition("@")[2] + slash + path


def with_redis(url: str, use: Callable[[RedisClient], Awaitable[T]]) -> T:
    """Run ``use`` with a client of the Redis at ``url``; its failures become a CliError."""
    from router.ledger import LedgerUnavailable
    from router.ledger.connect import connect
    from router.ledger.errors import REDIS_FAILURES

    async def go() -> T:
        try:
            client = connect(url, timeout_s=10, connect_timeout_s=2, health_check_s=0)
        except ValueError as exc:
            raise CliError(f"bad Redis URL {shown_url(url)}: {exc}", code=2) from None
        try:
            return await use(client)
        finally:
            await client.aclose()

    try:
        return asyncio.run(go())
    except (LedgerUnavailable, *REDIS_FAILURES) as exc:
        raise CliError(f"Redis not reachable at {shown_url(url)}: {exc}") from None


def reader(client: RedisClient) -> Ledger:
    """A ledger for reading only. It is never started, so its spool file is never opened."""
    import structlog

    from router.ledger import Ledger, LedgerConfig

    unused = Path(tempfile.gettempdir()) / "kvledger-cli-spool.jsonl"
    # A CLI may read a large lineage over a slow link: allow more than the request path does.
    config = LedgerConfig(spool_path=unused, redis_timeout_s=10.0)
    return Ledger(client, config, structlog.get_logger("kvledger.cli"))


# The proxy's admin API --------------------------------------------------------------------


def add_admin_options(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """--url, --admin-token-env and --json. ``suppress`` leaves an option unset when absent, so
    a subcommand does not overwrite what its parent command parsed."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--url", default=default(None), help=f"the proxy (default: $KVL_URL or {DEFAULT_PROXY_URL})"
    )
    parser.add_argument(
        "--admin-token-env",
        default=default(DEFAULT_TOKEN_ENV),
        metavar="NAME",
        help=f"the environment variable holding the admin token (default {DEFAULT_TOKEN_ENV})",
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="JSON lines, not a table"
    )


@dataclass(frozen=True)
class AdminApi:
    url: str
    token: str
    token_env: str

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str]) -> AdminApi:
        url = args.url or env.get("KVL_URL") or DEFAULT_PROXY_URL
        token = env.get(args.admin_token_env)
        if not token:
            raise CliError(
                f"set {args.admin_token_env} to the proxy's admin token"
                " (or name another variable with --admin-token-env)",
                code=2,
            )
        return cls(url.rstrip("/"), token, args.admin_token_env)

    def call(self, method: str, path: str, body: Any = None, timeout_s: float = 10) -> Any:
        """The JSON answer, or a CliError that says in one line what went wrong."""
        lines = list(self.stream(method, path, body, timeout_s, whole=True))
        return lines[0]

    def stream(
        self, method: str, path: str, body: Any = None, timeout_s: float = 10, whole: bool = False
    ) -> Iterator[Any]:
        """The answer's JSON lines as they arrive (``whole``: the body is one JSON document);
        a CliError says in one line what went wrong."""
        import http.client
        import urllib.error
        import urllib.request

        data = orjson.dumps(body) if body is not None else (b"" if method == "POST" else None)
        request = urllib.request.Request(
            self.url + path,
            method=method,
            data=data,
            headers={
                "Authorization": f"Bearer {self.token}",
                "Accept": "application/json",
                "Content-Type": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                if whole:
                    yield self._json(response.read())
                    return
                for line in response:
                    if line.strip():
                        yield self._json(line)
        except urllib.error.HTTPError as exc:
            raise CliError(self._refused(exc.code, exc.read())) from None
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CliError(f"proxy not reachable at {self.url}: {reason}") from None

    def _json(self, data: bytes) -> Any:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            raise CliError(
                f"{self.url} did not answer with JSON; is it a kvledger proxy?"
            ) from None

    def _refused(self, status: int, body: bytes) -> str:
        try:
            message = str(orjson.loads(body)["error"]["message"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            message = body.decode(errors="replace").strip()[:200] or "no details"
        if status == 401:
            return f"the proxy rejected the admin token in ${self.token_env} (401): {message}"
        return f"the proxy answered {status}: {message}"


# Output -----------------------------------------------------------------------------------


def cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def print_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    widths: Sequence[int] = (),
    header: bool = True,
) -> None:
    """Left-aligned columns; ``widths`` are minimums, so batches printed apart line up."""
    cells = [[cell(v) for v in row] for row in rows]
    sizes = [
        max([len(name), widths[i] if i < len(widths) else 0, *(len(r[i]) for r in cells)])
        for i, name in enumerate(columns)
    ]
    lines = ([list(columns)] if header else []) + cells
    for line in lines:
        print("  ".join(v.ljust(n) for v, n in zip(line, sizes, strict=True)).rstrip())
    sys.stdout.flush()


def print_json_lines(rows: Iterable[object]) -> None:
    for row in rows:
        sys.stdout.write(orjson.dumps(row).decode() + "\n")
    sys.stdout.flush()
