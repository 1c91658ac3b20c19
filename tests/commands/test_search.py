"""`python -m ragtrain search` on a finished run's folder: the run's ranking, and bad input or a damaged folder as one
line with exit 2 (`python -m ragtrain ask`, its generator's answer: tests/commands/test_ask.py; the export of the same
run: tests/pipeline/test_export.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragtrain.embed.model import build_encoder
from tests.conftest import REPO

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture
def finished_run(quickstart_run):
    """The session's one finished tiny quickstart (tests/conftest.py)."""
    return quickstart_run


def _search_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m ragtrain search`, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "ragtrain", "search", *args],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _search(*args: str) -> subprocess.CompletedProcess:
    """The same entry point in this process (its exit status and what it prints): a new interpreter costs seconds
    of imports, and one CLI run above checks the real command."""
    import contextlib
    import io

    from ragtrain.commands.search import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["ragtrain", "search", *args], code, out.getvalue(), err.getvalue())


@pytest.mark.integration
def test_search_cli_returns_the_runs_ranking(finished_run) -> None:
    import numpy as np

    from ragtrain.data import make_synthetic
    from ragtrain.embed.encoders import QueryEncoder
    from ragtrain.embed.weights import load_weights
    from ragtrain.index.sharded import open_saved

    cfg, _, _ = finished_run
    out = Path(cfg.output_dir)
    data = make_synthetic(num_entities=cfg.data.num_entities, seed=cfg.data.seed)
    question = data.queries[sorted(data.eval_qrels)[0]]
    res = _search_cli(cfg.output_dir, question, "-k", "3", "--json")
    assert res.returncode == 0 and "warning" not in res.stderr, res.stderr  # a complete run: no status warning
    hits = json.loads(res.stdout)["hits"]
    assert [h["rank"] for h in hits] == [1, 2, 3]
    assert all(h["text"] == data.corpus[h["id"]].text and h["title"] == data.corpus[h["id"]].title for h in hits)
    # the same ranking as the trained encoder + the saved index in this process
    model = build_encoder(cfg.retriever)
    model.load_state_dict(load_weights(out / "encoder"))
    # encoded as the CLI encodes queries: the index's precision (auto: bf16 weights where the CPU runs bf16)
    q = QueryEncoder(cfg.retriever, [model.state_dict()], precision=cfg.index.precision.value).encode([question])
    index = open_saved(out / "index")
    scores, rows = index.search(np.ascontiguousarray(q), 3)
    assert [h["id"] for h in hits] == [index.doc_ids[r] for r in rows[0]]
    assert [h["score"] for h in hits] == pytest.approx(scores[0].tolist(), abs=1e-5)


def test_search_of_a_folder_without_index_fails_in_one_line(tmp_path: Path) -> None:
    res = _search(str(tmp_path), "who founded it?")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "holds no index" in res.stderr and str(tmp_path) in res.stderr


def test_search_on_a_config_this_schema_cannot_read_fails_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "index_meta.json").write_text("{}")
    (tmp_path / "config.yaml").write_text("sync:\n  no_such_key: 1\n")  # e.g. written by another ragtrain version
    res = _search(str(tmp_path), "who founded it?")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "config.yaml" in res.stderr and "no_such_key" in res.stderr


def test_a_search_hit_is_one_line_and_a_cut_says_so() -> None:
    from ragtrain.commands.search import hit_line

    h = {"rank": 1, "score": 0.5, "id": "doc#3", "title": "T", "text": "Namesakes\n\nNot to be   confused"}
    assert hit_line(h) == "  1  0.5000  doc#3  T: Namesakes Not to be confused"
    long = hit_line({**h, "text": "word " * 100}, width=40)
    assert long.endswith("...") and len(long.split("  doc#3  ")[1]) == 40


def test_search_on_an_index_of_another_dimension_fails_in_one_line(finished_run, tmp_path: Path) -> None:
    # an index folder from another run (or a config edited after the index was built): a FAISS assertion before
    import shutil
    from dataclasses import asdict

    import numpy as np

    from ragtrain.index.faiss_index import build_index
    from ragtrain.index.integrity import seal_shard_list, sha256_file
    from ragtrain.index.sharded import MANIFEST, SHARDED, open_saved, persist

    cfg, _, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(cfg.output_dir, run, ignore=shutil.ignore_patterns("mlflow*", "checkpoints"))
    saved = open_saved(run / "index")
    other = np.random.default_rng(0).standard_normal((len(saved.doc_ids), 8)).astype(np.float32)
    built = build_index(other, saved.doc_ids, "Flat", saved.meta.corpus_fingerprint, saved.meta.encoder)
    shutil.rmtree(run / "index")  # the same layout as a run's (one index shard), with 8-dim vectors
    n = len(saved.doc_ids)
    meta = built.meta
    about = {"shard": 0, "start": 0, "stop": n, "version": 1, "encoder": meta.encoder}
    m = persist(built, run / "index" / "shard-0", {**about, "corpus_fingerprint": meta.corpus_fingerprint})
    (run / "index" / "index_meta.json").write_text(json.dumps(asdict(meta)))
    entry = {"shard": 0, "folder": "shard-0", "start": 0, "stop": n, "rows": n, "version": 1, "checksum": m["checksum"]}
    entry["manifest"] = sha256_file(run / "index" / "shard-0" / MANIFEST)  # sealed as a save seals its list
    listed = {"shards": [entry], "index_meta": sha256_file(run / "index" / "index_meta.json")}
    (run / "index" / SHARDED).write_text(json.dumps(seal_shard_list(listed)))
    open_saved(run / "index")  # a well-formed saved index: only its dimension differs from the run's encoder
    res = _search(str(run), "who founded it?")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "the index holds 8-dim vectors but the run's encoder" in res.stderr


@pytest.mark.parametrize(
    ("broken", "names", "says"),
    [
        ("corpus/passages.arrow", "corpus/passages.arrow", "not a readable "),
        # an index file is checked against its shard's manifest before FAISS reads it
        ("index/shard-0/index.faiss", "index/shard-0", "is corrupt"),
    ],
)
def test_search_on_a_truncated_file_names_it_in_one_line(
    finished_run, tmp_path: Path, broken: str, names: str, says: str, capsys
) -> None:
    """Arrow's and FAISS's own tracebacks before."""
    import shutil

    cfg, _, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(cfg.output_dir, run, ignore=shutil.ignore_patterns("mlflow*", "checkpoints"))
    data = (run / broken).read_bytes()
    (run / broken).write_bytes(data[: len(data) // 2])
    from ragtrain.commands.search import (
        main,  # the CLI's own entry point, in this process (the subprocess form is above)
    )

    assert main([str(run), "who founded it?"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0, err
    assert err.startswith("search error: ") and str(run / names) in err and says in err and "corrupt" in err


def test_search_of_a_run_that_did_not_finish_says_so(finished_run, tmp_path: Path, capsys) -> None:
    import shutil

    cfg, _, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(cfg.output_dir, run, ignore=shutil.ignore_patterns("mlflow*", "checkpoints"))
    assert json.loads((run / "status.json").read_text())["status"] == "complete"  # searched without a warning above
    (run / "status.json").write_text(json.dumps({"status": "running"}))
    from ragtrain.commands.search import main

    assert main([str(run), "who founded it?", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["hits"]  # it still answers
    assert (
        err.strip() == f"warning: {run / 'status.json'} says the run is 'running': it is still running or "
        "was stopped before it finished, so its index may not be the trained one"
    )
