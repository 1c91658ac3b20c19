"""A resumed run's MLflow history: the checkpointed run's points up to the checkpoint, then its own."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from ragtrain.config.logger import LoggerConfig
from ragtrain.track.mlflow import RunLogger, find_runs
from tests.conftest import mlflow_db


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float, int]]:
    return sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))


def train(logger: RunLogger, steps: range, offset: float) -> None:
    """Training as a resumed run replays it: every step from 1, values that differ from the first run's."""
    sink = logger.sink()
    assert sink is not None
    sink.skip_logged = logger.resumed
    for step in steps:
        sink.log({"train/loss": offset + step, "eval/ndcg@10": offset - step}, step)


def test_a_resumed_run_holds_the_checkpointed_history_then_its_own(tmp_path: Path) -> None:
    uri = mlflow_db(tmp_path / "m.db")
    cfg = LoggerConfig(tracking_uri=uri, experiment_name="resume-test")
    client = MlflowClient(uri)
    first = RunLogger(cfg, run_name="r")
    first.log_params({"lr": 0.1, "seed": 7})
    first.set_tags({"ragtrain.sync": "ddp"})
    first.log_metrics({"zeroshot/ndcg@10": 0.25}, step=0)
    first.log_metrics({"gen_train/loss": 9.0}, step=2)  # a stage whose checkpoint is final: kept whole
    train(first, range(1, 7), offset=100.0)  # steps 1..6 logged; the checkpoint is at step 3
    first.end("FAILED")
    old = {k: history(client, first.run_id, k) for k in ("train/loss", "eval/ndcg_at_10", "zeroshot/ndcg_at_10")}

    def cut(at: int):
        return lambda key: None if key.startswith("gen_") else at

    second = RunLogger(cfg, run_name="ignored", resume_of=first.run_id, keep_through=cut(3))
    assert second.run_id != first.run_id and second.resumed
    train(second, range(1, 8), offset=200.0)  # replays 1..3 (skipped: the copies hold them), then 4..7
    second.end("FAILED")

    new = client.get_run(second.run_id)
    assert new.info.run_name == "r" and new.info.experiment_id == client.get_run(first.run_id).info.experiment_id
    assert new.data.params == {"lr": "0.1", "seed": "7"}
    assert new.data.tags["ragtrain.sync"] == "ddp"
    assert new.data.tags["ragtrain.resumed_from"] == first.run_id
    gone = client.get_run(first.run_id)
    assert gone.info.status == "KILLED" and gone.data.tags["ragtrain.resumed_as"] == second.run_id
    loss = history(client, second.run_id, "train/loss")
    assert loss[:3] == old["train/loss"][:3]  # steps, values and timestamps of the checkpointed run
    assert [(s, v) for s, v, _ in loss] == [(1, 101), (2, 102), (3, 103), (4, 204), (5, 205), (6, 206), (7, 207)]
    assert history(client, second.run_id, "eval/ndcg_at_10")[:3] == old["eval/ndcg_at_10"][:3]
    assert history(client, second.run_id, "zeroshot/ndcg_at_10") == old["zeroshot/ndcg_at_10"]
    assert [(s, v) for s, v, _ in history(client, second.run_id, "gen_train/loss")] == [(2, 9.0)]

    third = RunLogger(cfg, run_name="r", resume_of=second.run_id, keep_through=cut(5))  # a second resume chains
    train(third, range(1, 8), offset=300.0)
    third.end()
    loss = [(s, v) for s, v, _ in history(client, third.run_id, "train/loss")]
    assert loss == [(1, 101), (2, 102), (3, 103), (4, 204), (5, 205), (6, 306), (7, 307)]
    assert client.get_run(third.run_id).data.tags["ragtrain.resumed_from"] == second.run_id
    assert client.get_run(second.run_id).info.status == "KILLED"

    runs = find_runs(uri, experiment="resume-test")  # what compare and the reports read: the last run only
    assert [r.run_id for r in runs] == [third.run_id]
    assert runs[0].metrics["train/loss"] == 307


def test_the_kept_steps_are_each_stages_checkpoint_step(tmp_path: Path) -> None:
    """What the take-over keeps: a stage's metrics up to its latest checkpoint; all of a finished stage's; the
    steps of a stage with no checkpoint yet (it trains from its first step again) none but step 0's."""
    import json

    import torch

    from ragtrain.config import to_typed
    from ragtrain.pipeline.stages import checkpointed_steps
    from ragtrain.train.checkpoint import save_train_state
    from tests.conftest import compose, tiny_overrides

    cfg = to_typed(
        compose(
            ["experiment=quickstart", *tiny_overrides(tmp_path), "stages=[retriever,index,generator]", "resume=true"]
        )
    )
    model = torch.nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0)
    for step in (2, 3):
        Path(cfg.output_dir, "ray", "retriever", f"checkpoint_{step}").mkdir(parents=True)
        save_train_state(
            Path(cfg.output_dir, "ray", "retriever", f"checkpoint_{step}"), 0, 1, step, model, optim, sched, {}
        )
    keep = checkpointed_steps(cfg)
    assert keep("train/loss") == 3 and keep("index/version") == 3 and keep("gen_train/loss") == 0

    final = Path(cfg.output_dir, "ray", "retriever", "checkpoint_final")  # the stage finished: nothing is cut
    final.mkdir()
    (final / "encoder.safetensors").write_bytes(b"")
    (final / "meta.json").write_text(json.dumps({"step": 4, "world": 1, "final": True}))
    assert checkpointed_steps(cfg)("train/loss") is None
