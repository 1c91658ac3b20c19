"""experiment=docs_quickstart end to end (tiny encoder): generated documents -> chunks -> train -> MaxP evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragtrain.config import to_typed
from ragtrain.index.sharded import open_saved
from ragtrain.pipeline.stages import run
from tests.conftest import compose, tiny_overrides


@pytest.mark.slow(
    reason="a pipeline run of its own (~50 s); documents, chunks, the store and MaxP are unit-tested in tests/corpus"
)
def test_docs_quickstart_runs_on_chunks_and_evaluates_documents(ray_session, tmp_path: Path) -> None:
    cfg = to_typed(
        compose(
            [
                "experiment=docs_quickstart",
                *tiny_overrides(tmp_path),
                "data.num_entities=24",
                "data.chunk.max_tokens=48",
                "data.chunk.overlap=12",
                "retriever.train.max_steps=2",
                "retriever.train.hard_negatives=1",
                "logger=none",
                "data.prepare=ray",
            ]
        )
    )  # read, clean and chunk on Ray Data, as a large corpus is
    results = run(cfg)
    out = Path(cfg.output_dir)
    assert len(list((out / "docs" / "articles").iterdir())) == 24  # generated into the run's folder
    ids = open_saved(out / "index").doc_ids  # the saved index: its shards' ids, in row order
    assert len(ids) > 24 and all("#" in i for i in ids)  # the index holds chunks
    for phase in ("zeroshot", "trained"):
        # every one of the 24 documents is within the top 100 only if chunk hits are mapped to documents (MaxP)
        assert results[phase]["recall@100"] == 1.0
        assert 0.0 < results[phase]["ndcg@10"] <= 1.0
    assert results["train"]["steps"] == 2
