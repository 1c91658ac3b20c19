"""`python -m ragtrain search` checks every index file's checksum, hashing each file once: a file verified before and
unchanged since (size, mtime, ctime, inode) is not read again; a damaged one is hashed again and fails in one line."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from ragtrain.commands.search import VERIFIED_FILE
from ragtrain.commands.search import main as search_main
from ragtrain.index import integrity
from tests.conftest import REPO


def _script():
    spec = importlib.util.spec_from_file_location("search_verify", REPO / "benchmarks" / "search_verify.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def run(tmp_path: Path, monkeypatch) -> Path:
    """A finished run folder with a saved 2-shard index of 600 x 64 vectors (the tiny encoder's dim)."""
    script = _script()
    out = tmp_path / "run"
    script.save_random_index(out / "index", 600, 64, 2)
    script.write_run(out, 64)
    monkeypatch.setattr(integrity, "RACY_SECONDS", 0.0)  # the files were written just now: stamp them anyway
    return out


@pytest.fixture()
def hashed(monkeypatch) -> list[Path]:
    """Every file sha256 reads."""
    calls: list[Path] = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p: calls.append(Path(p)) or real(p))
    return calls


def _search(out: Path, capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = search_main([str(out), "who founded the company?", "-k", "3"])
    return rc, capsys.readouterr().err.strip().splitlines()


def test_an_unchanged_index_is_hashed_once(run, hashed, capsys) -> None:
    assert _search(run, capsys)[0] == 0
    # sharded.json is read on every call (a few hundred bytes): its checksum covers its own content
    files = {f for f in (run / "index").rglob("*") if f.is_file() and f.name != "sharded.json"}
    assert set(hashed) == files and len(hashed) == 9  # 2 shards x (index, ids, meta, manifest) + index_meta.json
    hashed.clear()
    assert _search(run, capsys)[0] == 0 and _search(run, capsys)[0] == 0
    assert hashed == []


@pytest.mark.parametrize("mtime", ["changed", "set back"])
def test_a_damaged_file_of_a_verified_index_is_one_line_and_exit_2(run, hashed, capsys, mtime) -> None:
    """Same size, bytes flipped; its mtime changed, or set back to the verified one (its ctime still moves)."""
    assert _search(run, capsys)[0] == 0
    path = run / "index" / "shard-1" / "index.faiss"
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    if mtime == "set back":
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    else:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    assert path.stat().st_size == before.st_size
    hashed.clear()
    rc, err = _search(run, capsys)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("search error: ") and "shard-1 is corrupt: index.faiss does not match" in err[0]
    assert hashed == [path]  # only the changed file was read again


def test_a_file_written_just_now_is_not_stamped(run, hashed, capsys, monkeypatch) -> None:
    """Within RACY_SECONDS of its last write a file could change again in the same timestamp tick: hash it again."""
    monkeypatch.setattr(integrity, "RACY_SECONDS", 3600.0)
    assert _search(run, capsys)[0] == 0 and _search(run, capsys)[0] == 0
    assert len(hashed) == 18
    assert not (run / VERIFIED_FILE).exists()


def test_unreadable_stamps_mean_a_full_check(run, hashed, capsys) -> None:
    (run / VERIFIED_FILE).write_text("{not json")
    assert _search(run, capsys)[0] == 0
    assert len(hashed) == 9
