"""Tokens and owners (``service/auth.py``): bad token settings are refused at start with the value
and why, and the generated ``tokens.json`` is never left half written."""

import json
import os

import pytest

from ampkit.service import auth


def test_one_token_given_to_two_owners_is_refused():
    """``AMPKIT_TOKENS=alice:T,bob:T`` started, and every request with T acted as bob: alice's runs
    were bob's to see and cancel. The error names the owners, not the secret."""
    with pytest.raises(ValueError, match="alice and bob") as e:
        auth.load_tokens("/nonexistent", {"AMPKIT_TOKENS": "alice:s3cret,bob:s3cret"})
    assert "s3cret" not in str(e.value)
    two = auth.load_tokens("/x", {"AMPKIT_TOKENS": "alice:a1,bob:b2"})
    assert two == {"a1": "alice", "b2": "bob"}


def test_a_tokens_file_without_a_token_is_refused(tmp_path):
    """A ``tokens.json`` of ``{}`` started a server that answered 401 to everyone."""
    (tmp_path / "tokens.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no token"):
        auth.load_tokens(str(tmp_path), {})


def test_the_first_tokens_file_is_never_left_half_written(tmp_path, monkeypatch):
    """The first start wrote ``tokens.json`` in place: a crash mid-write left a file that is not
    JSON, and every later start was refused. Written beside and renamed, it is whole or absent;
    a damaged one's error says how to recover."""
    real = json.dump

    def crash(obj, f, **kw):
        f.write('{"half')
        f.flush()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(auth.json, "dump", crash)
    with pytest.raises(OSError):
        auth.load_tokens(str(tmp_path), {})
    assert not (tmp_path / "tokens.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file left either
    monkeypatch.setattr(auth.json, "dump", real)
    tokens = auth.load_tokens(str(tmp_path), {})
    assert list(tokens.values()) == ["default"]
    assert os.stat(tmp_path / "tokens.json").st_mode & 0o777 == 0o600
    assert auth.load_tokens(str(tmp_path), {}) == tokens  # read back, not written again
    (tmp_path / "tokens.json").write_text('{"half')
    with pytest.raises(ValueError, match="not valid JSON.*delet"):
        auth.load_tokens(str(tmp_path), {})
