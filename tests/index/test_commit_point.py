"""The live index's commit point: written atomically into the run folder, read back whole, forgotten on request."""

from __future__ import annotations

import numpy as np

from ragtrain.index.commit_point import COMMIT_POINT, CommitPoint
from ragtrain.index.live_client import LiveVersion


def test_the_commit_point_is_read_back_as_written_and_replaced_whole(tmp_path) -> None:
    assert CommitPoint.load(tmp_path) is None
    live = LiveVersion(3, 40, [[1, 2], [5]], np.eye(2, dtype=np.float32), 0.0, 1.0)
    point = CommitPoint("live2", 2, 3, "/vectors", 2, 1, live, {0: 0, 2: 40}, {2: np.ones((4, 2))}, {0: np.eye(2)})
    point.save(tmp_path)
    got = CommitPoint.load(tmp_path)
    assert (got.tag, got.encoder_version, got.last_version, got.first) == ("live2", 2, 3, 1)
    assert got.published.negatives == [[1, 2], [5]] and got.encoder_steps == {0: 0, 2: 40}
    np.testing.assert_array_equal(got.maps[0], np.eye(2))
    CommitPoint("live4", 4, 4, "/vectors", 2, 1, None).save(tmp_path)  # the next one replaces it
    assert CommitPoint.load(tmp_path).tag == "live4" and [p.name for p in tmp_path.iterdir()] == [COMMIT_POINT]
    CommitPoint.remove(tmp_path)
    assert CommitPoint.load(tmp_path) is None
