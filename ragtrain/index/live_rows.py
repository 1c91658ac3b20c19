"""One index shard's live rows: its passages' vectors, the encoder version of each, and the partial re-encode.

An `IndexShard` (index/sharded.py) holds one `LiveRows` while training refreshes its part of the live index
(index/refresh_service.py drives every shard). A refresh round hands the shard a new encoder snapshot; the shard
re-encodes a share `refresh.fraction` of its rows, chosen by `refresh.priority` (one class each in
`ragtrain/index/priority/`: oldest, drift, hot).

New vectors wait (`pending`) until the service applies them: it decides when a shard's new rows become searchable
(`refresh.consistency`). The index a search sees is built from the stored vectors; under `aligned`, rows still at
an older encoder version enter it through a linear map into the newest version's space. The state (vectors and
versions) is persisted on every apply, so a restarted shard continues from its last applied round.

Under `global` a round becomes searchable everywhere at one barrier, and each shard applies it after: the round is
journaled (`JOURNAL`: its rows, vectors and cursor) when the shard stages it, before the barrier. A shard that dies
between the barrier and its apply finds the journal on restart and `resolve`s it against the newest version the
service committed: applied if that is the journal's version (roll forward), dropped otherwise (roll back), so every
shard ends on the committed version.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ragtrain.index.priority.base import RefreshPriority, RoundRows

STATE = "live_state.npz"
JOURNAL = "live_journal.npz"  # a staged round not yet applied (global): finished or dropped by `resolve`


class LiveRows:
    """A shard's live vectors (`vectors`, [rows, dim] float32), each row's encoder version, and a pending round."""

    def __init__(self, folder: Path, vectors: np.ndarray, read_texts: Callable[[np.ndarray], list[str]]) -> None:
        self.folder = folder
        self.read_texts = read_texts  # local rows -> their passage texts
        self.vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        self.versions = np.zeros(len(vectors), dtype=np.int64)
        self.cursor = 0
        self.applied = 0  # the version of the last round applied (0: none yet)
        # (version, rows, their new vectors, the round-robin cursor once they are applied)
        self.pending: tuple[int, np.ndarray, np.ndarray, int] | None = None
        state = folder / STATE
        if state.exists():  # a restarted shard continues from its last applied round
            with np.load(state) as z:
                if z["vectors"].shape == self.vectors.shape:
                    self.vectors, self.versions, self.cursor = z["vectors"], z["versions"], int(z["cursor"])
                    self.applied = int(z["applied"]) if "applied" in z else int(self.versions.max(initial=0))

    @property
    def rows(self) -> int:
        return len(self.vectors)

    def encode_round(
        self,
        version: int,
        encode: Callable[[list[str]], np.ndarray],
        fraction: float,
        priority: RefreshPriority,
        hot: np.ndarray | None,
        seed: int,
    ) -> dict:
        """Re-encode this round's share of the rows with `encode` (the new snapshot), the rows chosen by
        `priority`; kept pending until `apply`."""
        t0 = time.perf_counter()
        budget = self.rows if fraction >= 1.0 else max(1, round(fraction * self.rows))
        choice = priority.choose(
            RoundRows(
                self.vectors, self.versions, self.cursor, budget, version, seed, hot,
                lambda local: encode(self.read_texts(local)),
            )
        )  # fmt: skip
        got_rows, got_vecs = [choice.encoded_rows], []
        if choice.encoded_vectors is not None:
            got_vecs.append(choice.encoded_vectors)
        chosen = np.sort(choice.rows)
        if len(chosen):
            got_rows.append(chosen)
            got_vecs.append(encode(self.read_texts(chosen)))
        rows = np.concatenate(got_rows).astype(np.int64)
        vecs = np.concatenate(got_vecs) if got_vecs else np.zeros((0, self.vectors.shape[1]), np.float32)
        # the cursor moves when the round is applied: a round that never lands leaves its rows next in turn
        cursor = (self.cursor + len(chosen)) % self.rows if priority.moves_cursor else self.cursor
        moved = 1.0 - np.sum(vecs * self.vectors[rows], axis=1) if len(rows) else np.zeros(0)
        self.pending = (version, rows, np.ascontiguousarray(vecs, dtype=np.float32), cursor)
        return {
            "version": version,
            "encoded": int(len(rows)),
            "rows": self.rows,
            "seconds": time.perf_counter() - t0,
            "drift_cosine": float(moved.mean()) if len(moved) else 0.0,
        }

    def _pending(self, version: int) -> tuple[int, np.ndarray, np.ndarray, int]:
        if self.pending is None or self.pending[0] != version:
            raise RuntimeError(f"no pending round of version {version} (a restarted shard drops the round it had)")
        return self.pending

    def apply(self, version: int) -> dict:
        """Make the pending round's vectors this shard's stored ones (and persist them); returns the version mix.
        A round already applied (a journal finished on restart, then the service's apply retried) is a no-op."""
        if self.pending is None and self.applied == version:
            return self.mix()
        _, rows, vecs, cursor = self._pending(version)
        self.vectors[rows] = vecs
        self.versions[rows] = version
        self.cursor, self.applied = cursor, version
        self.pending = None
        self._persist()  # first: a crash before the journal goes finds the state applied, and drops the journal
        (self.folder / JOURNAL).unlink(missing_ok=True)
        return self.mix()

    def journal(self, version: int) -> None:
        """Persist the pending round of `version` (atomically) before the barrier makes it searchable: a restart
        between the barrier and the apply finishes it (`resolve`)."""
        _, rows, vecs, cursor = self._pending(version)
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{JOURNAL}.{os.getpid()}.npz"
        np.savez(tmp, version=np.int64(version), rows=rows, vectors=vecs, cursor=np.int64(cursor))
        os.replace(tmp, self.folder / JOURNAL)

    def drop_journal(self) -> None:
        """Forget a staged round that will not be applied (the round failed before its barrier)."""
        (self.folder / JOURNAL).unlink(missing_ok=True)

    def resolve(self, committed: int) -> str | None:
        """On restart: finish a journaled round the service committed (`committed`: the newest version searches
        were switched to), or drop one it did not. Returns what happened, or None when there was no journal."""
        path = self.folder / JOURNAL
        if not path.exists():
            return None
        with np.load(path) as z:
            version, rows, vecs, cursor = int(z["version"]), z["rows"], z["vectors"], int(z["cursor"])
        if self.applied >= version:  # applied, and the crash came before the journal was removed
            path.unlink(missing_ok=True)
            return None
        if version == committed:
            self.pending = (version, rows, np.ascontiguousarray(vecs, dtype=np.float32), cursor)
            self.apply(version)
            return "rolled forward"
        path.unlink(missing_ok=True)
        return "rolled back"

    def staged(self, version: int) -> np.ndarray:
        """The stored vectors with the pending round of `version` in place, before it is applied: what a build
        that becomes searchable at a barrier holds (`global`), while the persisted state stays the last round's."""
        _, rows, vecs, _ = self._pending(version)
        out = self.vectors.copy()
        out[rows] = vecs
        return out

    def mix(self) -> dict:
        """{encoder version: rows at it} of the stored vectors."""
        vs, counts = np.unique(self.versions, return_counts=True)
        return {int(v): int(c) for v, c in zip(vs, counts)}

    def searchable(self, maps: dict[int, np.ndarray] | None = None) -> np.ndarray:
        """The vectors a search sees: stored ones, rows at a mapped version through its map (re-normalised)."""
        if not maps:
            return self.vectors
        out = self.vectors.copy()
        for v, w in maps.items():
            at = self.versions == v
            if at.any():
                y = self.vectors[at].astype(np.float64) @ w
                out[at] = (y / np.clip(np.linalg.norm(y, axis=1, keepdims=True), 1e-12, None)).astype(np.float32)
        return out

    def rows_of(self, local: Sequence[int], maps: dict[int, np.ndarray] | None = None) -> np.ndarray:
        """Searchable vectors of some local rows (the staleness probe, the anchors, gold passages)."""
        idx = np.asarray(local, dtype=np.int64)
        if not maps:
            return self.vectors[idx].copy()
        sub = LiveRows.__new__(LiveRows)
        sub.vectors, sub.versions = self.vectors[idx], self.versions[idx]
        return sub.searchable(maps)

    def _persist(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{STATE}.{os.getpid()}.npz"
        np.savez(
            tmp,
            vectors=self.vectors,
            versions=self.versions,
            cursor=np.int64(self.cursor),
            applied=np.int64(self.applied),
        )
        os.replace(tmp, self.folder / STATE)  # atomic: a crash leaves the previous round's state


def version_summary(mixes: Sequence[dict], steps: dict[int, int], step: int) -> dict[str, float]:
    """Metrics of what searches see, from every shard's {version: rows}: index/version_skew (newest - oldest
    version searched; a failed round's number is skipped, so it counts rounds started), the shares of rows at the
    newest and at the oldest version, index/staleness_steps (training steps since the snapshot of the oldest rows),
    index/version_count."""
    total: dict[int, int] = {}
    for m in mixes:
        for v, c in m.items():
            total[int(v)] = total.get(int(v), 0) + int(c)
    rows = sum(total.values())
    newest, oldest = max(total), min(total)
    return {
        "index/version_skew": float(newest - oldest),
        "index/newest_version_share": total[newest] / rows,
        "index/oldest_version_share": total[oldest] / rows,
        "index/staleness_steps": float(step - steps.get(oldest, 0)),
        "index/version_count": float(len(total)),
    }
