"""PassageStore: the corpus on disk, read on demand, equal to the in-memory corpus it replaces."""

from __future__ import annotations

import pickle

import pytest

from ragtrain.data import DataError, Passage, RetrievalData, load_beir, make_synthetic, write_beir
from ragtrain.data.store import PassageStore, StoreWriter, write_store


def _corpus() -> dict[str, Passage]:
    ps = [
        Passage("a", "Alpha", "first text"),
        Passage("b", "", "no title here"),
        Passage("c#0", "Gamma", "a chunk", doc_id="c", start=0, end=7),
        Passage("d", "Déjà", "vu ünïcode"),
    ]
    return {p.id: p for p in ps}


def test_store_is_the_same_mapping_as_the_dict(tmp_path):
    corpus = _corpus()
    store = write_store(tmp_path / "p.arrow", corpus.values())
    assert list(store) == list(corpus) and len(store) == 4
    assert dict(store.items()) == corpus and list(store.values()) == list(corpus.values())
    assert store["c#0"] == corpus["c#0"] and "d" in store and "zz" not in store
    with pytest.raises(KeyError):
        store["zz"]
    assert store.get("zz") is None
    assert store.doc_of() == {"c#0": "c"}
    # the fingerprint a saved index carries is unchanged by the move to disk
    data = lambda c: RetrievalData("x", c, {}, {}, {}, "dev")  # noqa: E731
    assert data(store).fingerprint() == data(corpus).fingerprint()
    assert PassageStore(tmp_path / "p.arrow").fingerprint() == data(corpus).fingerprint()


def test_text_view_reads_positions_slices_and_lists(tmp_path):
    corpus = _corpus()
    texts = write_store(tmp_path / "p.arrow", corpus.values()).texts()
    full = [p.full_text() for p in corpus.values()]
    assert [texts[i] for i in range(4)] == full and texts[-1] == full[-1]
    assert texts[1:3] == full[1:3] and texts[[3, 0]] == [full[3], full[0]]
    assert texts.lengths() == [len(t) for t in full]  # "no title here" has no leading space
    with pytest.raises(IndexError):
        texts[4]


def test_pickles_as_its_path(tmp_path):
    big = (Passage(str(i), "t", "word " * 200) for i in range(2000))
    store = write_store(tmp_path / "p.arrow", big)
    blob = pickle.dumps(store.texts())
    assert len(blob) < 500  # 2000 passages of ~1 kB: only the path travels to a worker
    again = pickle.loads(blob)
    assert again[1999] == store.texts()[1999] and len(again) == 2000


def test_duplicate_id_and_failed_write_leave_nothing(tmp_path):
    path = tmp_path / "p.arrow"
    with pytest.raises(DataError, match="duplicate passage id 'a'"):
        write_store(path, [Passage("a", "", "x"), Passage("a", "", "y")])
    assert list(tmp_path.iterdir()) == []  # neither the store nor its temporary file
    with pytest.raises(RuntimeError):
        with StoreWriter(path) as w:
            w.add(Passage("a", "", "x"))
            raise RuntimeError("reader failed half-way")
    assert list(tmp_path.iterdir()) == []


def test_beir_corpus_streams_into_a_store(tmp_path):
    data = make_synthetic(num_entities=12, seed=0)
    write_beir(data, tmp_path / "beir", {"train": data.train_qrels, "dev": data.eval_qrels})
    in_memory = load_beir(tmp_path / "beir")
    stored = load_beir(tmp_path / "beir", store_path=tmp_path / "corpus" / "passages.arrow")
    assert isinstance(stored.corpus, PassageStore) and not isinstance(in_memory.corpus, PassageStore)
    assert dict(stored.corpus.items()) == dict(in_memory.corpus)
    assert stored.fingerprint() == in_memory.fingerprint()
    assert stored.eval_qrels == in_memory.eval_qrels and stored.train_qrels == in_memory.train_qrels
