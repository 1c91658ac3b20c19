"""Which paths a run shares across nodes (the two-node check itself runs in test_multinode.py)."""

from __future__ import annotations

from pathlib import Path

from ragtrain.cluster.storage import check_shared_paths, shared_paths
from ragtrain.config import to_typed
from tests.conftest import compose


def test_the_shared_paths_of_a_run(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    cfg = to_typed(
        compose(
            [
                "data=documents",
                f"data.root={tmp_path / 'docs'}",
                f"index.cache_dir={tmp_path / 'c'}",
                f"logger.tracking_uri=sqlite:///{tmp_path / 'ml' / 'm.db'}",
                f"output_dir={tmp_path}",
            ]
        )
    )
    written, read = shared_paths(cfg, tmp_path / "out")
    assert written == {
        "output_dir": str(tmp_path / "out"),
        "index.cache_dir": str(tmp_path / "c"),
        "logger.tracking_uri": str(tmp_path / "ml"),
    }
    assert read == {"data.root": str(tmp_path / "docs")}  # retriever.model=minilm: the package, on every node
    server = to_typed(compose(["logger.tracking_uri=http://mlflow:5000", f"output_dir={tmp_path}"]))
    assert shared_paths(server, tmp_path)[0] == {"output_dir": str(tmp_path)}  # a server: nothing on disk to share


def test_one_node_has_nothing_to_check(tmp_path: Path) -> None:
    assert check_shared_paths({"output_dir": str(tmp_path)}, {}, nodes=[{"Alive": True, "NodeID": "a"}]) == []
    assert list(tmp_path.iterdir()) == []  # no probe written either
