"""experiments/refresh_curve.py: a shard_refresh run's variant folders -> the curve's table and PNG."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.experiments import script


def _script():
    return script("refresh_curve")


def _variant(run: Path, name: str, fraction: float, priority: str, ndcg: float, rounds: list[dict]) -> None:
    folder = run / name
    folder.mkdir(parents=True)
    refresh = {"consistency": "global", "fraction": fraction, "priority": priority}
    (folder / "config.yaml").write_text(yaml.safe_dump({"refresh": refresh}))
    (folder / "metrics.json").write_text(
        json.dumps({"train": {"train/samples_per_s": 3.0}, "trained": {"ndcg@10": ndcg}})
    )
    (folder / "refresh_history.json").write_text(json.dumps({"history": rounds, "failures": []}))


def _round(fraction: float, seconds: list[float], recall: list[float], agree: list[float], step: int = 8) -> dict:
    metrics = {
        "index/encoded_fraction": fraction,
        **{f"index/shard{i}_encode_seconds": s for i, s in enumerate(seconds)},
    }
    states = [{"index/mixed_recall_at_10": r, "index/mined_agreement": a} for r, a in zip(recall, agree)]
    return {"ok": True, "step": step, "metrics": metrics, "state_metrics": states}


def test_the_table_sums_encode_seconds_and_averages_the_states(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    _variant(run, "full_global", 1.0, "oldest", 0.87, [_round(1.0, [2.0, 3.0], [1.0], [1.0])] * 2)
    _variant(run, "partial_hot", 0.25, "hot", 0.86,
             [_round(0.25, [0.5, 0.5], [0.8, 0.9], [0.5, 0.7]), {"ok": False, "error": "boom"}])  # fmt: skip
    (run / "not_a_variant").mkdir()  # e.g. an unfinished one: skipped
    png = tmp_path / "curve.png"
    assert _script().main([str(run), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in out.splitlines()
            if line.startswith("| full") or line.startswith("| partial")}  # fmt: skip
    # columns: consistency, fraction, priority, rounds, encoded_per_round, shard_encode_s, mixed, mined, sps, ndcg
    assert rows["full_global"][2] == "(all rows)" and rows["full_global"][5] == "10"
    assert rows["partial_hot"][3] == "1" and rows["partial_hot"][5] == "1"  # the failed round counts for nothing
    assert float(rows["partial_hot"][6]) == pytest.approx(0.85) and float(rows["partial_hot"][7]) == pytest.approx(0.6)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_folder_without_variants_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    assert _script().main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: no finished variant (config.yaml, metrics.json, ")


def test_the_rounds_view_takes_each_rounds_worst_state(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _variant(run, "shards_eager", 1.0, "oldest", 0.7,
             [_round(1.0, [1.0], [0.9, 0.8, 1.0], [0.7, 0.6, 1.0], step=15), {"ok": False, "error": "boom"},
              _round(1.0, [1.0], [1.0], [1.0], step=30)])  # fmt: skip
    module = _script()
    assert module.round_rows(run / "shards_eager") == [
        {"step": 15, "index/mixed_recall_at_10": 0.8, "index/mined_agreement": 0.6},
        {"step": 30, "index/mixed_recall_at_10": 1.0, "index/mined_agreement": 1.0},
    ]
    png = tmp_path / "rounds.png"
    assert module.main([str(run), "--png", str(tmp_path / "curve.png"), "--rounds-png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        ("refresh_history.json", lambda b: b[: len(b) // 2], r"refresh_history.json: not readable JSON \(.*\): the"),
        ("metrics.json", lambda b: b"{}", r"metrics.json: no 'trained' figures \(.*\): the"),
        ("config.yaml", lambda b: b"refresh: [", r"config.yaml: not readable YAML \(.*\): the"),
        ("refresh_history.json", lambda b: b'{"history": [{"ok": true}]', r"refresh_history.json: not readable JSON"),
    ],
)
def test_a_truncated_file_of_a_variant_is_one_line_and_exit_2(tmp_path: Path, capsys, name, damage, message) -> None:
    """A truncated refresh_history.json ended in a JSONDecodeError traceback."""
    run = tmp_path / "run"
    _variant(run, "full_global", 1.0, "oldest", 0.87, [_round(1.0, [2.0, 3.0], [1.0], [1.0])] * 2)
    path = run / "full_global" / name
    path.write_bytes(damage(path.read_bytes()))
    assert _script().main([str(run), "--png", str(tmp_path / "curve.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: "), err
    assert re.search(message, err[0]) and "truncated or damaged" in err[0], err
