"""End to end on a real local Ray cluster, real FAISS and a real MLflow SQLite store read back through MLflow."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ragtrain.config import to_typed
from ragtrain.data import make_synthetic
from ragtrain.embed.model import build_encoder
from ragtrain.index.sharded import open_saved
from ragtrain.pipeline.stages import run
from ragtrain.retriever.lora import trainable
from ragtrain.runtime.errors import ConfigError
from ragtrain.sync.comm import all_reduce_bytes
from tests.conftest import compose, tiny_overrides

METRICS = ["ndcg@10", "mrr@10", "recall@1", "recall@5", "recall@10", "recall@100"]


@pytest.mark.integration
def test_results_have_both_phases(quickstart_run) -> None:
    cfg, results, _ = quickstart_run
    assert set(results) == {"zeroshot", "trained", "train", "stale", "stale_aligned"}  # index.align_anchors=32
    assert results["stale_aligned"]["anchors"] == 32 and 0 <= results["stale_aligned"]["ndcg@10"] <= 1
    train = results["train"]
    assert train["steps"] == cfg.retriever.train.max_steps and train["train/samples_per_s"] > 0
    assert train["train/peak_rss_mb"] > 100  # rank 0 imported torch and holds a replica: never near 0
    assert train["comm/bytes_per_step"] > 0 and train["drift/param_divergence_mean"] < 1e-6  # ddp: replicas equal
    for phase in (results["zeroshot"], results["trained"]):
        for m in METRICS:
            assert 0.0 <= phase[m] <= 1.0
        assert phase["encode_docs_per_s"] > 0


@pytest.mark.integration
def test_encoded_corpora_go_to_the_cache(quickstart_run) -> None:
    """index.cache_dir: both encodes of the run (zero-shot, trained) are stored, each equal to the run's own shards."""
    import numpy as np

    from ragtrain.corpus.encode import VectorSet

    cfg, results, tmp = quickstart_run
    entries = sorted(p for p in (tmp / "vector_cache").iterdir() if not p.name.startswith("."))
    assert len(entries) == 2  # nothing half-written (temporary names) is left either
    assert not [p for p in (tmp / "vector_cache").iterdir() if p.name.startswith(".")]
    run_sets = [VectorSet.load(Path(cfg.output_dir) / "vectors" / tag) for tag in ("zeroshot", "trained")]
    for mine in run_sets:  # each of the run's encodes is one cache entry, vector for vector
        ids, vec = mine.read_all()
        assert any(np.array_equal(VectorSet.load(e).read_all(order=ids)[1], vec) for e in entries)
    assert "encode_cache_hit" not in results["zeroshot"] and results["zeroshot"]["encode_docs_per_s"] > 0


@pytest.mark.integration
def test_outputs_written(quickstart_run) -> None:
    cfg, results, _ = quickstart_run
    out = Path(cfg.output_dir)
    saved = json.loads((out / "metrics.json").read_text())
    assert set(saved) == set(results)
    for phase in results:
        assert saved[phase] == pytest.approx(results[phase])
    assert "batch_size: 4" in (out / "config.yaml").read_text()
    assert (out / "encoder" / "encoder.safetensors").exists()
    data = make_synthetic(num_entities=cfg.data.num_entities, seed=cfg.data.seed)
    index = open_saved(out / "index", expect_corpus=data.fingerprint())
    assert index.meta.dim == cfg.retriever.tiny.hidden_size
    assert index.ntotal == len(data.corpus)
    # the corpus the run read: a passage store in the run folder (Ray Data's read tasks and the trainers read it)
    from ragtrain.data.store import PassageStore

    store = PassageStore(out / "corpus" / "passages.arrow")
    assert list(store) == list(data.corpus) and store.fingerprint() == data.fingerprint()
    assert index.meta.encoder_step == cfg.retriever.train.max_steps
    # the run's own log lines, timestamped, next to its outputs
    log = (out / "ragtrain.log").read_text()
    assert "[zeroshot] encoding" in log and "ndcg@10" in log and "outputs:" in log
    # the checks' lines too (logged before the file may be written, kept and written after), with their own times
    assert re.match(r"^\d{4}-\d\d-\d\d [\d:,]+ INFO \[driver\] ragtrain\.pipeline\.stages: \[data\] ", log), log[:300]
    # rank 0's step lines (a Train worker's process) land in the same file, marked as such
    assert any("[retriever rank 0]" in line and "[retriever] step 4/4" in line for line in log.splitlines()), log
    assert json.loads((out / "status.json").read_text())["status"] == "complete"
    # profile=true: Ray's timeline holds the run's Ray Data encode actors and Train workers
    events = json.loads((out / "ray_timeline.json").read_text())
    cats = {e.get("cat", "") for e in events}  # "task::<class>.<method>" per actor call
    assert any("EncodeBatch" in c for c in cats) and any("RayTrainWorker" in c for c in cats), sorted(cats)[:30]


@pytest.mark.integration
def test_validation_during_training_equals_the_final_evaluation(quickstart_run) -> None:
    """retriever.train.val_every: with every passage and every dev query in the sample, rank 0's dev nDCG@10 of its
    replica at the last step is the trained index's (fp32 both; ddp keeps replicas equal)."""
    from mlflow.tracking import MlflowClient

    cfg, results, tmp = quickstart_run
    client = MlflowClient(cfg.logger.tracking_uri)
    exp = client.get_experiment_by_name(cfg.logger.experiment_name)
    run = client.search_runs([exp.experiment_id])[0]
    val = client.get_metric_history(run.info.run_id, "val/ndcg_at_10")
    assert [m.step for m in val] == [2, 4]  # every 2 steps, with the log window
    assert val[-1].value == pytest.approx(results["trained"]["ndcg@10"], abs=1e-6)


def test_mlflow_run_read_back(quickstart_run) -> None:
    cfg, results, tmp = quickstart_run
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.get_experiment_by_name("qs-test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    r = runs[0]
    assert r.info.status == "FINISHED"
    assert r.data.params["retriever.train.batch_size"] == "4"
    assert r.data.params["retriever.model"] == "tiny"
    assert r.data.params["data.source"] == "synthetic"
    # the precision each phase ran in is logged next to the setting (auto's resolution: tests/embed/test_precision.py)
    assert r.data.params["index.precision"] == "fp32"
    assert (r.data.params["precision/index"], r.data.params["precision/retriever_train"]) == ("fp32", "fp32")
    for phase in ("zeroshot", "trained"):
        assert r.data.metrics[f"{phase}/ndcg_at_10"] == pytest.approx(results[phase]["ndcg@10"])
    # Per-step training metrics, logged by rank 0 only (one point per logged step, no duplicates).
    loss = client.get_metric_history(r.info.run_id, "train/loss")
    assert [m.step for m in loss] == [2, 4]  # log_every=2
    assert client.get_metric_history(r.info.run_id, "train/samples_per_s")[0].value > 0
    artifacts = {a.path for a in client.list_artifacts(r.info.run_id)}
    assert {"config.yaml", "metrics.json", "index_meta.json"} <= artifacts


@pytest.mark.integration
def test_ddp_sends_every_trainable_parameter_once_a_step_and_logs_its_training_clock(quickstart_run) -> None:
    """The gradient bytes are the ring all-reduce of every trainable fp32 parameter, 2(W-1)/W x 4 x P per worker (the
    tiny encoder's P, not MiniLM's: what a link's rate is to be compared with), and every window logs the cumulative
    training seconds (train/seconds) that the run's summary ends at."""
    cfg, results, tmp = quickstart_run
    n = sum(p.numel() for p in trainable(build_encoder(cfg.retriever)))
    world = cfg.resources.trainer.num_workers
    assert results["train"]["comm/bytes_per_step/grad"] == all_reduce_bytes(4 * n, world)
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    run_id = client.search_runs([client.get_experiment_by_name("qs-test").experiment_id])[0].info.run_id
    seconds = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/seconds"))
    assert [s for s, _ in seconds] == [2, 4] and 0 < seconds[0][1] < seconds[1][1]
    assert seconds[1][1] <= results["train"]["train/seconds"]


def test_unwritable_output_dir_fails_before_work(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path), f"output_dir={blocker}/sub"]))
    with pytest.raises(ConfigError, match="output_dir"):
        run(cfg)


def test_a_failed_check_removes_the_folders_it_made_with_their_new_parents(tmp_path: Path) -> None:
    from ragtrain.pipeline.stages import prepare_output_dir, undo_on_failure

    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "mine.txt").write_text("x")
    with pytest.raises(ConfigError):
        with undo_on_failure(str(tmp_path / "new" / "a" / "b"), str(tmp_path / "kept")):
            prepare_output_dir(str(tmp_path / "new" / "a" / "b"))
            (tmp_path / "kept" / "written.txt").write_text("y")
            raise ConfigError("a check failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]  # new/a/b and the parents made for it are gone
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["mine.txt"]


def test_resume_without_an_earlier_run_names_the_folder(tmp_path) -> None:
    cfg = to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path), "resume=true"]))
    with pytest.raises(ConfigError, match="resume=true but output_dir=.* holds no earlier run"):
        run(cfg)


@pytest.mark.slow(reason="a pipeline run of its own (the default suite shares one: conftest.quickstart_run")
def test_stale_index_aligned_onto_the_trained_space(ray_session, tmp_path) -> None:
    """index.align_anchors: the zero-shot index mapped by Procrustes is closer to the trained vectors."""
    cfg = to_typed(
        compose(
            [
                "experiment=quickstart",
                *tiny_overrides(tmp_path),
                "retriever.train.max_steps=20",
                "retriever.train.lr=1e-3",
                "index.align_anchors=64",
                "logger=none",
            ]
        )
    )
    results = run(cfg)
    stale, aligned = results["stale"], results["stale_aligned"]
    assert aligned["anchors"] == 64
    assert aligned["drift_vs_trained"] < stale["drift_vs_trained"]
    assert aligned["ndcg@10"] >= stale["ndcg@10"] - 0.02  # never much worse than not aligning at all


@pytest.mark.slow(reason="a pipeline run of its own (the default suite shares one: conftest.quickstart_run")
def test_whole_rag_loop_through_the_pipeline(ray_session, tmp_path) -> None:
    """retriever -> index -> generator in one `run`, composed like `experiment=rag_quickstart` (tiny models)."""
    cfg = to_typed(
        compose(
            [
                "experiment=rag_quickstart",
                *tiny_overrides(tmp_path),
                "generator=tiny_t5",
                "generator.train.max_steps=4",
                "generator.train.num_workers=1",
                "generator.train.cpus_per_worker=1",
                "generator.eval.max_new_tokens=4",
                "logger.experiment_name=rag-loop",
            ]
        )
    )
    results = run(cfg)
    assert {"train", "trained", "gen_closed_book", "gen_rag", "gen_oracle", "gen_train"} <= set(results)
    client = MlflowClient(cfg.logger.tracking_uri)
    r = client.search_runs([client.get_experiment_by_name("rag-loop").experiment_id])[0]
    for key in ("trained/ndcg_at_10", "gen_rag/em", "gen_closed_book/f1", "gen_oracle/em"):
        assert key in r.data.metrics, key
    assert (Path(cfg.output_dir) / "generator" / "metrics.json").exists()


def test_generator_alone_needs_a_saved_index(tmp_path) -> None:
    cfg = to_typed(compose(["experiment=rag_quickstart", *tiny_overrides(tmp_path), "stages=[generator]"]))
    with pytest.raises(ConfigError, match="generator.retrieval.index_dir: .*needs a retrieval index and there is none"):
        run(cfg)
    assert not (Path(cfg.output_dir) / "config.yaml").exists()  # a failed check leaves no run behind


@pytest.mark.slow(reason="a pipeline run of its own (the default suite shares one: conftest.quickstart_run")
def test_same_seed_same_weights_with_dropout(ray_session, tmp_path) -> None:
    """Dropout draws from torch's generator in each worker: two runs of one config must train the same weights."""
    import torch
    from safetensors.torch import load_file

    weights = []
    for name in ("a", "b"):
        cfg = to_typed(
            compose(
                [
                    "experiment=quickstart",
                    *tiny_overrides(tmp_path / name),
                    "zeroshot_eval=false",
                    "stages=[retriever]",
                    "logger=none",
                    "retriever.tiny.dropout=0.1",
                    "retriever.train.lr=1e-3",
                ]
            )
        )
        assert cfg.retriever.tiny.dropout == 0.1
        run(cfg)
        weights.append(load_file(str(Path(cfg.output_dir) / "encoder" / "encoder.safetensors")))
    for k in weights[0]:
        torch.testing.assert_close(weights[0][k], weights[1][k], rtol=0, atol=1e-6)


def test_the_stage_table_runs_the_configured_stages_in_its_order(tmp_path, monkeypatch) -> None:
    """Every stage a config may name has one entry, in config.STAGES's order; `run_stages` runs those named."""
    from ragtrain.config import STAGES
    from ragtrain.pipeline import stages

    assert tuple(stages.STAGES) == STAGES
    ran: list[str] = []

    class Record:
        def __init__(self, name: str) -> None:
            self.name = name

        def run(self, s) -> None:
            ran.append(self.name)

    monkeypatch.setattr(stages, "STAGES", {name: Record(name) for name in STAGES})
    cfg = to_typed(compose(tiny_overrides(tmp_path) + ["stages=[index,generator]"]))
    stages.run_stages(stages.RunState(cfg, None, tmp_path, None, None, {}, "init"))
    assert ran == ["index", "generator"]


def test_resume_of_a_finished_run_runs_nothing_and_returns_its_results(quickstart_run) -> None:
    """resume=true on a run that completed: its saved results, and the folder and the MLflow store untouched (it
    used to train "8 steps in 0.0s", rewrite its figures with a wall time of 0 and log a second run)."""
    from dataclasses import replace

    cfg, results, _ = quickstart_run
    out = Path(cfg.output_dir)
    files = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    client = MlflowClient(cfg.logger.tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = len(client.search_runs(experiments))
    again = run(replace(cfg, resume=True))
    assert again == json.loads((out / "metrics.json").read_text())
    assert again["trained"]["ndcg@10"] == pytest.approx(results["trained"]["ndcg@10"], abs=1e-12)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == files
    assert len(client.search_runs(experiments)) == runs


def test_a_comparison_whose_variants_all_finished_logs_no_second_comparison_run(quickstart_run, tmp_path) -> None:
    """compare's resume after every variant finished: the table written again from their saved results (the same
    figures), and no new run in the MLflow store."""
    from dataclasses import replace

    from ragtrain.commands.variants import run_variants

    cfg, results, _ = quickstart_run
    client = MlflowClient(cfg.logger.tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = len(client.search_runs(experiments))
    df = run_variants({"shared": replace(cfg, resume=True)}, tmp_path / "compare")
    assert df.loc[0, "ndcg@10"] == pytest.approx(results["trained"]["ndcg@10"], abs=1e-12)
    assert len(client.search_runs(experiments)) == runs
