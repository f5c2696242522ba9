"""Running the app under uvicorn: connection timeouts, the request log on stderr, and a start
that says why it cannot (a full disk, a data directory it cannot write).

uvicorn 0.54's h11 protocol closes an idle keep-alive connection after ``timeout_keep_alive``
seconds, but only between requests and only until the next byte arrives: a connection that
never sends a full request head (or trickles it a byte at a time), or stops in the middle of a
body, is kept forever. :func:`guarded_protocol` adds two deadlines to it: the request head
(line and headers) must arrive within ``header_timeout`` seconds of the connection opening or
the previous response ending, and a body may not pause longer than ``header_timeout`` between
chunks. h11's own limit on an incomplete head (``h11_max_incomplete_event_size``) bounds its size.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import sqlite3
import stat
import sys
import warnings
from collections.abc import Callable
from typing import Any, Optional

from . import lock

__all__ = ["guarded_protocol", "preflight", "serve"]


def guarded_protocol(header_timeout: float) -> type:
    """uvicorn's h11 protocol with the two deadlines of the module doc."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _deadline: Optional[asyncio.TimerHandle] = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            waiting = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
            if waiting and not self.transport.is_closing():
                self.transport.close()  # the app, if it waits for the body, sees a disconnect

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()  # the first request head must arrive in time

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.SEND_BODY:
                self._arm()  # a body may pause, but not for longer than the deadline
            elif self.conn.their_state is not h11.IDLE:
                self._disarm()  # the request is in: the app's time is its own
            # still IDLE: the head is incomplete; the deadline set when it started keeps running

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request head, on a kept-alive connection

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


def preflight(data_dir: str) -> None:
    """Raise ``OSError`` naming the data directory and the reason when the server could not keep
    its state there (it cannot create it, write to it, or the disk is full)."""
    try:
        if not os.path.isdir(
            data_dir
        ):  # a new data directory is private (0700) whatever the umask;
            os.makedirs(data_dir, mode=0o700)  # an existing one keeps the mode its operator gave it
            os.chmod(data_dir, 0o700)
        _warn_if_open(data_dir)
        probe = os.path.join(data_dir, f".write-test-{os.getpid()}")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * 65536)  # room for a few transactions, not just a directory entry
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise OSError(
            e.errno,
            f"cannot keep the service's state in {os.path.abspath(data_dir)}: {e.strerror or e}",
        ) from None


def _warn_if_open(data_dir: str) -> None:
    """One warning when others may read or write the data directory (its database holds tokens'
    owners and every run's settings); the operator's mode is theirs to change, not ours."""
    mode = stat.S_IMODE(os.stat(data_dir).st_mode)
    if mode & 0o077:
        path = os.path.abspath(data_dir)
        who = "writable" if mode & 0o022 else "readable"
        warnings.warn(
            f"the data directory {path} is {who} by others (mode {mode:o}); make it private "
            f"with: chmod 700 {path}",
            stacklevel=2,
        )


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` for uvicorn; ``OSError`` naming the address and what to do
    when it cannot be (a port in use: another server, or this one started twice)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = (
            "the port is in use (another server?); stop it or choose another --port"
            if e.errno == errno.EADDRINUSE
            else f"{e.strerror or e}; choose another --host or --port"
        )
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {why}") from None
    return sock


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    header_timeout: float = 10.0,
    keep_alive: int = 5,
    announce: Optional[Callable[[], None]] = None,
    **config: Any,
) -> None:
    """Run the service with uvicorn until interrupted (``config``: :class:`ServiceConfig` fields);
    ``announce()`` once it holds its data directory and listens (the CLI's start line).
    Raises ``OSError`` (the CLI prints it and exits 2) when the data directory cannot hold its state."""
    from .schemas import ServiceConfig

    cfg = ServiceConfig(**config)
    preflight(cfg.data_dir)
    key = lock.hold(
        cfg.data_dir
    )  # a second server on this directory: DataDirBusy (the CLI says it, exits 2)
    try:
        _serve(cfg, host, port, header_timeout, keep_alive, announce)
    finally:
        lock.release(key)


def _serve(
    cfg: Any,
    host: str,
    port: int,
    header_timeout: float,
    keep_alive: int,
    announce: Optional[Callable[[], None]] = None,
) -> None:
    import uvicorn

    from .app import create_app
    from .store import disk_full

    sock = listening_socket(host, port)  # a port in use: said before the database is opened
    try:
        app = create_app(
            cfg
        )  # a damaged database: DamagedStore (an OSError naming the file and the way back)
    except sqlite3.Error as e:  # opening the database: a full disk, a read-only or corrupt file
        code = errno.ENOSPC if disk_full(e) else errno.EIO
        raise OSError(
            code, f"cannot open the service's database in {os.path.abspath(cfg.data_dir)}: {e}"
        ) from None
    _log_to_stderr()
    if announce is not None:
        announce()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            http=guarded_protocol(header_timeout),
            timeout_keep_alive=keep_alive,
            h11_max_incomplete_event_size=64 * 1024,
        )
    )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if (
        getattr(server, "started", True) is False
    ):  # the lifespan failed (uvicorn logged why): not a clean exit
        raise OSError(errno.EIO, "the service did not start (see the error above)")


def _log_to_stderr() -> None:
    """The request log (``ampkit.service``, INFO) on stderr, unless the host already configured it."""
    log = logging.getLogger("ampkit.service")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
