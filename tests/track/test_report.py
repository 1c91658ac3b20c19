"""The comparison files of a set of variants run over several seeds: per-seed rows, mean [min, max], a plot."""

import pandas as pd

from ragtrain.track.report import comparison_frame, seed_summary, write_comparison


def _rows() -> list[dict]:
    return [
        {"strategy": "frozen", "seed": 0, "rag/em": 0.25, "closed_book/em": 0.0, "oracle/em": 0.5, "seconds": 10.0},
        {"strategy": "frozen", "seed": 1, "rag/em": 0.375, "closed_book/em": 0.125, "oracle/em": 0.5, "seconds": 12.0},
        {"strategy": "joint", "seed": 0, "rag/em": 0.5, "closed_book/em": 0.0, "oracle/em": 0.625, "seconds": 30.0},
        {"strategy": "joint", "seed": 1, "rag/em": 0.25, "closed_book/em": 0.0, "oracle/em": 0.75, "seconds": 34.0},
    ]


def test_seed_summary_gives_mean_and_range_per_variant_in_run_order() -> None:
    s = seed_summary(comparison_frame(_rows()))
    assert list(s["strategy"]) == ["frozen", "joint"] and list(s["seeds"]) == [2, 2]
    assert s.loc[0, "rag/em"] == "0.3125 [0.25, 0.375]"
    assert s.loc[1, "oracle/em"] == "0.6875 [0.625, 0.75]"
    assert s.loc[1, "seconds"] == "32 [30, 34]"


def test_write_comparison_over_seeds_writes_the_rows_the_summary_and_a_plot(tmp_path) -> None:
    df = comparison_frame(_rows())
    files = write_comparison(df, tmp_path, "squad_rag")
    assert [f.name for f in files] == ["comparison.csv", "comparison.md", "comparison.png"]
    back = pd.read_csv(tmp_path / "comparison.csv")
    assert list(back["seed"]) == [0, 1, 0, 1]
    md = (tmp_path / "comparison.md").read_text()
    assert "## Mean over seeds [min, max]" in md and "0.3125 [0.25, 0.375]" in md
    assert (tmp_path / "comparison.png").stat().st_size > 5000


def test_strategies_trained_without_an_index_get_their_table_and_no_plot(tmp_path) -> None:
    """compare.strategies with stages=[retriever]: no nDCG@10 to plot against the bytes, so the table only (and a
    plot left by an earlier run of the folder is removed: it would show other figures)."""
    rows = [
        {"strategy": "ddp", "comm/bytes_per_step": 9.0e7, "train/samples_per_s": 20.0},
        {"strategy": "topk", "comm/bytes_per_step": 1.8e6, "train/samples_per_s": 18.0},
    ]
    (tmp_path / "comparison.png").write_bytes(b"stale")
    files = write_comparison(comparison_frame(rows), tmp_path, "sync_network")
    assert [f.name for f in files] == ["comparison.csv", "comparison.md"]
    assert not (tmp_path / "comparison.png").exists()
    assert "topk" in (tmp_path / "comparison.md").read_text()
