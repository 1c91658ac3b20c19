"""One Ray Data stream (read -> clean -> chunk -> encode -> write) gives the two-step path's store and vectors, survives
a killed encode actor with every passage once, and leaves nothing behind when a bad file or id fails it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ragtrain.config import to_typed
from ragtrain.config.index import IndexConfig
from ragtrain.config.resources import PoolResources
from ragtrain.config.retriever import Precision
from ragtrain.corpus.encode import VectorSet
from ragtrain.corpus.load import load_data
from ragtrain.corpus.stream import StreamEncode
from ragtrain.data.types import DataError
from ragtrain.embed.encoders import EncodeFault
from ragtrain.pipeline.stages import initial_weights
from ragtrain.runtime.errors import ConfigError
from tests.conftest import compose

from .helpers import mixed_folder, write_folder

POOL = PoolResources(num_actors=2, cpus_per_actor=1)
# many encode calls: the injected death lands mid-stream; fp32 as the in-process reference encodes (auto may be bf16)
INDEX = IndexConfig(batch_size=8, shard_size=16, precision=Precision.fp32)


def _folder(root: Path) -> Path:
    return mixed_folder(root, many=30)


def _cfg(root: Path, tmp_path: Path, *extra: str):
    return to_typed(
        compose(
            [
                "data=documents",
                f"data.root={root}",
                "retriever=tiny",
                "data.chunk.max_tokens=8",
                "data.chunk.overlap=2",
                "data.prepare=ray",
                f"output_dir={tmp_path / 'out'}",
                *extra,
            ]
        )
    )


def _stream(cfg, out: Path, weights, fault=None) -> StreamEncode:
    return StreamEncode(
        weights=lambda: weights,
        index=INDEX,
        pool=POOL,
        folder=out / "vectors" / "zeroshot",
        fault=fault,
        key=lambda w, fp: f"key-of-{fp}",
    )


def _same_as_two_steps(root: Path, tmp_path: Path, out: Path, weights):
    """Assert the stream's store and shards in `out` equal the two-step path's: the store prepared in the driver
    (byte-identical to Ray's: test_prepare.py) and encoded in this process by the corpus actors' own class.
    Returns (the two-step data, the stream's shards)."""
    from ragtrain.embed.encoders import QueryEncoder
    from ragtrain.index.faiss_index import build_index
    from ragtrain.index.vector_files import build_from_vectors

    driver = to_typed(
        compose(
            [
                "data=documents",
                f"data.root={root}",
                "retriever=tiny",
                "data.chunk.max_tokens=8",
                "data.chunk.overlap=2",
                "data.prepare=driver",
                "data.on_error=skip",
                f"output_dir={tmp_path / 'o'}",
            ]
        )
    )
    two = load_data(driver.data, driver.retriever, tmp_path / "two")
    texts = [p.full_text() for p in two.corpus.values()]
    want = QueryEncoder(driver.retriever, [weights], INDEX.batch_size).encode(texts, role="passage")
    # the same passage store byte for byte: rows, order, fingerprint
    store = "corpus/passages.arrow"
    assert (out / store).read_bytes() == (tmp_path / "two" / store).read_bytes()
    # every passage exactly once, in corpus order, with the vector the two-step encode gave it
    shards = VectorSet.load(out / "vectors" / "zeroshot")
    ids = list(two.corpus)
    assert shards.ids() == ids and shards.rows == len(ids) > 36
    assert shards.stats["streamed"] and shards.stats["corpus"] == two.fingerprint()
    _, got = shards.read_all()
    np.testing.assert_allclose(got, want, atol=1e-5)
    # a Flat index from the streamed shards answers as one from the two-step vectors: the same scores, and its ids
    # score the same under the two-step vectors (repeated sentences make exact ties, whose order floats decide)
    a = build_from_vectors(shards, "Flat", "fp", "tiny")
    b = build_index(want, ids, "Flat", "fp", "tiny")
    queries = want[::7] + 0.01
    (sa, ia), (sb, _) = a.search(queries, 10), b.search(queries, 10)
    np.testing.assert_allclose(sa, sb, atol=1e-5)
    row = {p: i for i, p in enumerate(ids)}
    rescored = np.array([[want[row[a.doc_ids[j]]] @ q for j in hits] for q, hits in zip(queries, ia)])
    np.testing.assert_allclose(rescored, sb, atol=1e-5)
    return two, shards


@pytest.mark.slow(
    reason="the same through pipeline.run runs by default (below); this one also compares doc_of and qrels"
)
def test_one_stream_equals_prepare_then_encode_even_when_an_actor_dies(ray_session, tmp_path: Path) -> None:
    root = _folder(tmp_path / "docs")
    cfg = _cfg(root, tmp_path, "data.on_error=skip")
    weights = initial_weights(cfg)
    marker = tmp_path / "killed"
    one = load_data(
        cfg.data,
        cfg.retriever,
        tmp_path / "one",
        ray_tasks=2,
        stream=_stream(cfg, tmp_path / "one", weights, EncodeFault(at_batch=1, marker=str(marker))),
    )
    assert marker.exists(), "the injected actor death never fired"
    two, shards = _same_as_two_steps(root, tmp_path, tmp_path / "one", weights)
    assert shards.stats["key"] == f"key-of-{one.fingerprint()}"
    assert one.fingerprint() == two.fingerprint() and one.doc_of == two.doc_of  # the chunk map and qrels too
    assert (one.train_qrels, one.eval_qrels) == (two.train_qrels, two.eval_qrels)
    assert "dup" not in set(one.doc_of.values()) and len(set(one.doc_of.values())) == 35  # 36 read, 1 duplicate


@pytest.mark.parametrize("case", ["repeated_id", "ivf_lists", "too_many_shards"])
def test_whole_corpus_checks_fail_the_stream_before_encoding_and_leave_nothing(
    ray_session, tmp_path: Path, case: str
) -> None:
    """A repeated id in the last file, or more IVF lists than the corpus has passages, fails in the stream's first
    pass (ids and digests only), before the encoder's weights are even built; nothing is left."""
    from ragtrain.pipeline.stages import stream_encode

    root = _folder(tmp_path / "docs")
    extra: tuple[str, ...] = ()
    if case == "repeated_id":
        write_folder(root, {"zz.txt": "fine now", "zz2.jsonl": json.dumps({"_id": "c", "text": "another c"}) + "\n"})
        match = r"duplicate document id 'c': in .*c\.html and in .*zz2\.jsonl:1"
    elif case == "ivf_lists":
        extra, match = (
            ("index=ivf", "index.factory='IVF4096,Flat'", "data.on_error=skip"),
            r"asks for 4096 IVF lists but the corpus has only \d+ vectors",
        )
    else:  # data.prepare=ray with more index shards than passages: it failed after the whole encode
        extra, match = (
            ("index.shards=999", "data.on_error=skip"),
            r"index.shards=999 asks for 999 shards but the corpus has only \d+ passages",
        )
    cfg = _cfg(root, tmp_path, *extra)
    out = tmp_path / case
    built = []
    enc = stream_encode(cfg, out, lambda: built.append(1) or initial_weights(cfg))
    with pytest.raises((DataError, ConfigError), match=match) as e:
        load_data(cfg.data, cfg.retriever, out, stream=enc)
    assert "\n" not in str(e.value) and not built  # the driver's one line, before any weights or encoding
    assert not (out / "vectors" / "zeroshot").exists() and not list((out / "corpus").glob("*passages*"))


@pytest.mark.slow(reason="one more stream; the driver path's test of the same file runs by default (test_prepare.py)")
def test_a_bad_file_fails_the_stream_under_on_error_fail_and_leaves_nothing(ray_session, tmp_path: Path) -> None:
    root = _folder(tmp_path / "docs")
    cfg = _cfg(root, tmp_path)  # data.on_error=fail
    out = tmp_path / "bin"
    with pytest.raises(DataError, match=r"zz\.txt: binary file \(NUL byte at byte offset 3\) \(data.on_error=fail"):
        load_data(cfg.data, cfg.retriever, out, stream=_stream(cfg, out, initial_weights(cfg)))
    assert not (out / "vectors" / "zeroshot").exists() and not list((out / "corpus").glob("*passages*"))


def test_a_run_indexes_what_the_stream_encoded_without_encoding_again(ray_session, tmp_path: Path, caplog) -> None:
    """stages=[index] on a documents folder prepared on Ray, one encode actor killed mid-stream: every passage is
    encoded once, as the two-step path encodes it, and the zero-shot index is built from the stream's shards."""
    import logging

    from ragtrain.index.sharded import open_saved
    from ragtrain.pipeline.stages import run
    from tests.conftest import tiny_overrides

    root = _folder(tmp_path / "docs")
    cfg = _cfg(
        root,
        tmp_path,
        "data.on_error=skip",
        *tiny_overrides(tmp_path)[4:],
        "stages=[index]",
        "logger=none",
        "index.shard_size=16",
        "index.precision=fp32",
        "fault.kill_encode_actor_at_batch=1",
    )
    with caplog.at_level(logging.INFO, logger="ragtrain"):
        results = run(cfg)
    out = Path(cfg.output_dir)
    assert (out / "vectors" / ".encode_actor_killed").exists(), "the injected actor death never fired"
    text = caplog.text
    assert "in one Ray Data stream" in text and "passage vectors from the corpus stream" in text
    assert "encoding" not in text  # Retrieval.build encoded nothing itself
    shards = VectorSet.load(out / "vectors" / "zeroshot")
    saved = open_saved(out / "index")
    assert shards.stats["streamed"] and shards.ids() == saved.doc_ids
    assert saved.ntotal == shards.rows
    assert 0.0 < results["zeroshot"]["ndcg@10"] <= 1.0 and results["zeroshot"]["encode_docs_per_s"] > 0
    _same_as_two_steps(root, tmp_path, out, initial_weights(cfg))
