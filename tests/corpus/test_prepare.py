"""Corpus preparation on Ray Data (data.prepare=ray): the same store as the driver's, the same errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragtrain.config import to_typed
from ragtrain.corpus.load import load_data
from ragtrain.corpus.prepare import RAY_MIN_BYTES, use_ray
from ragtrain.data.types import DataError
from tests.conftest import compose

from .helpers import mixed_folder, small_folder, write_folder


def test_auto_prepares_on_ray_from_the_threshold_up() -> None:
    assert not use_ray("auto", RAY_MIN_BYTES - 1) and use_ray("auto", RAY_MIN_BYTES)
    assert use_ray("ray", 0) and not use_ray("driver", 10 * RAY_MIN_BYTES)
    with pytest.raises(ValueError, match=r"data.prepare must be one of \['auto', 'driver', 'ray'\]"):
        use_ray("cluster", 0)


def _folder(root: Path) -> Path:
    return mixed_folder(root, many=40)


def test_ray_prepare_writes_the_drivers_store_and_reports_the_same(ray_session, tmp_path: Path) -> None:
    root = _folder(tmp_path / "docs")
    base = [
        "data=documents",
        f"data.root={root}",
        "retriever=tiny",
        "data.chunk.max_tokens=8",
        "data.chunk.overlap=2",
        "data.on_error=skip",
        f"output_dir={tmp_path / 'out'}",
    ]
    driver = load_data(
        to_typed(compose(base + ["data.prepare=driver"])).data, to_typed(compose(base)).retriever, tmp_path / "driver"
    )
    cfg = to_typed(compose(base + ["data.prepare=ray"]))
    on_ray = load_data(cfg.data, cfg.retriever, tmp_path / "ray", ray_tasks=2)
    for name in ("documents.arrow", "passages.arrow"):  # byte for byte: same rows, same order, same fingerprint
        assert (tmp_path / "ray" / "corpus" / name).read_bytes() == (tmp_path / "driver" / "corpus" / name).read_bytes()
    assert on_ray.fingerprint() == driver.fingerprint() and on_ray.doc_of == driver.doc_of
    assert len(set(on_ray.doc_of.values())) == 45 and "dup" not in set(on_ray.doc_of.values())  # the duplicate dropped
    assert (on_ray.train_qrels, on_ray.eval_qrels) == (driver.train_qrels, driver.eval_qrels)

    with pytest.raises(DataError, match=r"zz\.txt: binary file \(NUL byte at byte offset 3\) \(data.on_error=fail"):
        cfg = to_typed(compose([b for b in base if b != "data.on_error=skip"] + ["data.prepare=ray"]))
        load_data(cfg.data, cfg.retriever, tmp_path / "fail")
    assert not (tmp_path / "fail" / "corpus" / "documents.arrow").exists()  # nothing half-written
    write_folder(root, {"zz.txt": "fine now", "zz2.jsonl": json.dumps({"_id": "c", "text": "another c"}) + "\n"})
    with pytest.raises(DataError, match=r"duplicate document id 'c': in .*c\.html and in .*zz2\.jsonl:1"):
        load_data(cfg.data, cfg.retriever, tmp_path / "dup")  # both places named, the first found by a re-scan
    write_folder(root, {"zz2.jsonl": '{"_id": "z", "text": "ok"}\n{not json\n'})
    with pytest.raises(DataError, match=r"zz2\.jsonl:2: invalid JSON") as e:  # a bad record: the reader's own line
        load_data(cfg.data, cfg.retriever, tmp_path / "json")
    # the driver's own DataError, one line: not Ray's task error (a DataError subclass carrying a remote traceback)
    assert e.type is DataError and "\n" not in str(e.value)


def test_a_document_that_cannot_be_chunked_fails_on_ray_as_in_the_driver(ray_session, tmp_path: Path) -> None:
    root = write_folder(
        tmp_path / "docs",
        {"long.md": "# " + "word " * 20 + "\n\nbody text here."},
        queries={"q": "x"},
        qrels={"dev": [("q", "long")], "train": [("q", "long")]},
    )
    for prepare in ("driver", "ray"):
        cfg = to_typed(
            compose(
                [
                    "data=documents",
                    f"data.root={root}",
                    "retriever=tiny",
                    "data.chunk.max_tokens=16",
                    "data.chunk.overlap=2",
                    f"data.prepare={prepare}",
                    f"output_dir={tmp_path}",
                ]
            )
        )
        with pytest.raises(DataError, match=r"the title of document 'long' takes \d+ of data.chunk.max_tokens=16"):
            load_data(cfg.data, cfg.retriever, tmp_path / prepare)


@pytest.mark.parametrize("on_ray", [False, True], ids=["driver", "ray"])
def test_a_listed_file_missing_when_read_fails_even_under_skip(ray_session, tmp_path: Path, on_ray: bool) -> None:
    # On a cluster, a node that does not mount data.root sees none of the driver's files: skipping them would
    # silently shrink the corpus, so a file gone between listing and reading is an error whatever on_error says
    from ragtrain.corpus.dataset import load_documents
    from ragtrain.corpus.read import list_documents

    root = write_folder(small_folder(tmp_path / "docs"), {"extra.txt": "An unjudged document."})
    files = list_documents(root)
    gone = root / "extra.txt"
    gone.unlink()
    pattern = (
        rf"{gone.name}: listed when the run started but missing when read{' on Ray node [0-9a-f]+' if on_ray else ''}: "
    )
    with pytest.raises(DataError, match=pattern) as e:
        load_documents(root, on_error="skip", files=files, on_ray=on_ray, log=lambda _: None)
    assert "data.on_error=skip does not skip a missing file" in str(e.value) and "\n" not in str(e.value)
    assert len(load_documents(root, on_error="skip", on_ray=on_ray, log=lambda _: None)[0].corpus) == 3  # listed anew
