"""The service's state: one SQLite file (stdlib ``sqlite3``, WAL journal) under the data directory.

One row per run. SQLite in WAL mode with ``synchronous=FULL`` commits durably and atomically, so
a server killed with SIGKILL mid-write loses at most the transaction in flight and never corrupts
the file; every write is one short transaction. Connections are per thread.

The database is private whatever the umask: the file is created 0600 before SQLite opens it (its
``-wal`` and ``-shm`` files take the database's mode, and are set to 0600 too), a data directory
this store creates is 0700, and ``runs/`` (the run directories' parent) is 0700.

Only a missing ``ampkit.db`` means a new service: a new database is created whole (its schema
written to a temporary file renamed into place), so a file that exists but is empty, is not
SQLite or fails ``PRAGMA quick_check`` is damaged, and the store refuses it (:class:`DamagedStore`,
naming the file and how to recover) instead of starting with every run forgotten.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
import threading
import time
from typing import Any, Optional

__all__ = ["STATUSES", "DamagedStore", "Store", "check_database", "disk_full"]

STATUSES = ("queued", "running", "succeeded", "failed", "cancelled", "interrupted")
_JSON = ("spec", "summary")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    spec TEXT NOT NULL,
    created REAL NOT NULL,
    started REAL,
    ended REAL,
    pid INTEGER,
    run_dir TEXT NOT NULL,
    summary TEXT,
    error TEXT,
    resumes INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS runs_owner ON runs (owner, created);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status);
CREATE TABLE IF NOT EXISTS settings (
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    value TEXT NOT NULL,
    updated REAL NOT NULL,
    PRIMARY KEY (owner, name)
);
"""


class Store:
    """Runs in ``<data_dir>/ampkit.db``."""

    def __init__(self, data_dir: str) -> None:
        if not os.path.isdir(data_dir):
            os.makedirs(data_dir, mode=0o700)
            os.chmod(data_dir, 0o700)
        runs = os.path.join(data_dir, "runs")
        os.makedirs(runs, mode=0o700, exist_ok=True)
        os.chmod(runs, 0o700)
        self.path = os.path.join(data_dir, "ampkit.db")
        if os.path.exists(self.path):
            check_database(self.path)  # damaged: refused, never taken for a new one
        elif os.path.exists(self.path + "-wal") and os.path.getsize(self.path + "-wal") > 0:
            raise DamagedStore(
                errno.ENOENT,
                _damaged(
                    self.path,
                    "it is missing but its -wal file is there (the database was deleted or moved)",
                ),
            )
        else:
            _create(self.path)  # only a missing file means a new service
        self._local = threading.local()
        db = self._conn()
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(_SCHEMA)
        for suffix in ("", "-wal", "-shm"):  # also a database an older server left 0644
            if os.path.exists(self.path + suffix):
                os.chmod(self.path + suffix, 0o600)

    def _db(self) -> _Tx:
        return _Tx(self._conn())

    def _conn(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(
                self.path, timeout=30, isolation_level=None
            )  # autocommit; explicit BEGIN below
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA busy_timeout=30000")
            self._local.db = db
        return db

    @staticmethod
    def _row(row: Optional[sqlite3.Row]) -> Optional[dict[str, Any]]:
        if row is None:
            return None
        out = dict(row)
        for k in _JSON:
            out[k] = json.loads(out[k]) if out.get(k) else None
        return out

    def create(
        self, run_id: str, owner: str, kind: str, spec: dict[str, Any], run_dir: str
    ) -> dict[str, Any]:
        with self._db() as db:
            db.execute(
                "INSERT INTO runs (id, owner, kind, status, spec, created, run_dir) VALUES (?,?,?,?,?,?,?)",
                (run_id, owner, kind, "queued", json.dumps(spec), time.time(), run_dir),
            )
        row = self.get(run_id)
        assert row is not None
        return row

    def get(self, run_id: str, owner: Optional[str] = None) -> Optional[dict[str, Any]]:
        with self._db() as db:
            row = db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        out = self._row(row)
        if out is None or (owner is not None and out["owner"] != owner):
            return None  # another owner's run does not exist for you
        return out

    def list(
        self, owner: Optional[str] = None, status: Optional[str] = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        sql, args = "SELECT * FROM runs WHERE 1=1", []
        if owner is not None:
            sql += " AND owner = ?"
            args.append(owner)
        if status is not None:
            sql += " AND status = ?"
            args.append(status)
        sql += " ORDER BY created DESC LIMIT ?"
        args.append(limit)
        with self._db() as db:
            rows = db.execute(sql, args).fetchall()
        return [r for r in (self._row(x) for x in rows) if r is not None]

    def count(self, status: str, owner: Optional[str] = None) -> int:
        """Runs in ``status`` (``owner``'s only, when given)."""
        sql, args = "SELECT COUNT(*) FROM runs WHERE status = ?", [status]
        if owner is not None:
            sql, args = sql + " AND owner = ?", [status, owner]
        with self._db() as db:
            return int(db.execute(sql, args).fetchone()[0])

    def put_setting(self, owner: str, name: str, value: Any) -> None:
        """An owner's named setting (JSON), e.g. the mixed-precision setup of the compatibility API."""
        with self._db() as db:
            db.execute(
                "INSERT INTO settings (owner, name, value, updated) VALUES (?,?,?,?) ON CONFLICT(owner, name) "
                "DO UPDATE SET value = excluded.value, updated = excluded.updated",
                (owner, name, json.dumps(value), time.time()),
            )

    def get_setting(self, owner: str, name: str) -> Any:
        with self._db() as db:
            row = db.execute(
                "SELECT value FROM settings WHERE owner = ? AND name = ?", (owner, name)
            ).fetchone()
        return None if row is None else json.loads(row[0])

    def update(
        self, run_id: str, *, expect: Optional[tuple[str, ...]] = None, **fields: Any
    ) -> bool:
        """Set ``fields``; with ``expect``, only if the status is one of those (atomic). True if changed."""
        for k in _JSON:
            if k in fields and fields[k] is not None:
                fields[k] = json.dumps(fields[k])
        sets = ", ".join(f"{k} = ?" for k in fields)
        sql, args = f"UPDATE runs SET {sets} WHERE id = ?", [*fields.values(), run_id]
        if expect:
            sql += f" AND status IN ({','.join('?' * len(expect))})"
            args += list(expect)
        with self._db() as db:
            return db.execute(sql, args).rowcount > 0


_HEADER = b"SQLite format 3\0"


class DamagedStore(OSError):
    """The service's database exists but is not a whole SQLite database (the server refuses to start)."""


def check_database(path: str) -> None:
    """:class:`DamagedStore` naming ``path``, why and how to recover, when the file is empty, is not
    SQLite, or fails SQLite's ``quick_check``. A 0-byte file is never a new database here: this
    store creates a new one whole (:func:`_create`), so an empty file is one that lost its data."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_HEADER))
    except OSError as e:
        raise DamagedStore(
            e.errno or errno.EIO, _damaged(path, f"it cannot be read ({e.strerror or e})")
        ) from None
    if not head:
        raise DamagedStore(errno.EIO, _damaged(path, "it is empty (0 bytes)"))
    if head != _HEADER:
        raise DamagedStore(
            errno.EIO, _damaged(path, "it is not an SQLite database (its header is wrong)")
        )
    try:
        db = sqlite3.connect(path, timeout=30)
        try:
            verdict = db.execute("PRAGMA quick_check").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error as e:
        if disk_full(e):
            raise
        verdict = str(e)
    if verdict != "ok":
        raise DamagedStore(errno.EIO, _damaged(path, f"SQLite's quick_check says: {verdict}"))


def _damaged(path: str, why: str) -> str:
    path = os.path.abspath(path)
    return (
        f"the service's database {path} is damaged: {why}. Refusing to start rather than forget every run. "
        f"To recover: stop every server on this data directory, then restore {os.path.basename(path)} from a "
        f"backup, or move it (and any -wal/-shm beside it) aside to start with an empty database "
        f"(runs/ is kept, but the database will not list its runs)"
    )


def _create(path: str) -> None:
    """A new database at ``path``, created whole: its schema is written to a private temporary file
    that is renamed into place, so ``path`` never exists empty."""
    tmp = f"{path}.new-{os.getpid()}"
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp + suffix)
    os.close(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    try:
        db = sqlite3.connect(tmp, isolation_level=None)
        try:
            db.executescript(_SCHEMA)
            db.execute("PRAGMA journal_mode=WAL")
        finally:
            db.close()  # the last connection: the WAL is checkpointed into the file and removed
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp + suffix)


def disk_full(exc: BaseException) -> bool:
    """Is ``exc`` a full disk (or quota) from the filesystem or from SQLite?"""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    if isinstance(exc, sqlite3.Error):
        return getattr(
            exc, "sqlite_errorcode", None
        ) == sqlite3.SQLITE_FULL or "disk is full" in str(exc)
    return False


class _Tx:
    """``with store._db() as db``: one IMMEDIATE transaction, committed on exit, rolled back on error."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        try:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            if self.db.in_transaction:  # a COMMIT that failed (a full disk) leaves it open: end it,
                with contextlib.suppress(
                    sqlite3.Error
                ):  # or every later BEGIN on this connection fails
                    self.db.execute("ROLLBACK")
