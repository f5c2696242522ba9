"""Every TOML file ampkit reads or writes goes through here: ``tomllib`` (``tomli`` before
Python 3.11) to read, ``tomli_w`` to write, and an atomic replace so that a reader never sees
half a file. A leaf: it imports nothing from ampkit, and it is the only module that imports a
TOML library (tests/test_layout.py checks that).

What ampkit writes is ``{table: {key: value}}`` with str, bool, int, float and (nested) lists of
those; ``None`` means "the reader's default" and is left out (TOML has no null).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

import tomli_w

try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:  # pragma: no cover - older Pythons
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["TomlError", "dumps", "loads", "write"]

_SCALARS = (str, bool, int, float)


class TomlError(ValueError):
    """Bytes that are not TOML: the message says why (not UTF-8, or the parser's line and column)."""


def loads(data: bytes) -> dict[str, Any]:
    """The TOML document in ``data`` (UTF-8 bytes). Raises :class:`TomlError`."""
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise TomlError(f"not UTF-8 ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise TomlError(str(e)) from None


def dumps(tables: Mapping[str, Mapping[str, Any]]) -> str:
    """TOML text of ``{table: {key: value}}``; ``None`` values are left out.

    ``loads(dumps(t).encode())`` equals ``t`` without its ``None`` values (tuples read back as
    lists). Raises ``TypeError`` for a value that is not a str, bool, int, float or a list of
    them (a nested dict, a ``None`` inside a list), and ``ValueError`` for a string that is not
    valid Unicode (a lone surrogate), before anything is written."""
    doc = {}
    for name, values in tables.items():
        doc[name] = {k: _checked(v, k) for k, v in values.items() if v is not None}
    text = tomli_w.dumps(doc)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start : e.end]
        raise ValueError(
            f"a value holds a lone surrogate (U+{ord(bad[0]):04X}), which is not valid "
            f"Unicode: {e.object[max(0, e.start - 20) : e.end + 20]!r}"
        ) from None
    return text


def write(path: str, text: str, *, mode: Optional[int] = None) -> str:
    """Write ``text`` to ``path`` atomically (a temporary file beside it, then ``os.replace``);
    ``mode`` (e.g. ``0o600``) is set whatever the umask, else the umask decides. Returns ``path``.
    A full disk raises ``OSError`` and leaves ``path`` as it was."""
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _checked(value: Any, key: str) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return [_checked(v, key) for v in value]
    raise TypeError(
        f"cannot write {key} = {value!r} ({type(value).__name__}) to TOML: a str, bool, int, "
        "float or a list of them"
    )
