"""`align` (post hoc, on embeddings): map one embedding space onto a reference space with a linear map.

Given anchor embeddings X (source: a replica's or a stale encoder's) and Y (reference) for the same N anchor
texts, fit W minimising ||X W - Y||_F:
- `orthogonal` (Procrustes): W = U V^T from the SVD X^T Y = U S V^T. Preserves norms and angles, so unit vectors
  stay unit vectors and a pure rotation between spaces is recovered exactly.
- `lstsq`: unconstrained least squares (more expressive, can overfit with few anchors); rows re-normalised.
Apply W to every vector of the source index (or to queries) so both sides live in one space.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METHODS = ("orthogonal", "lstsq")


@dataclass
class LinearAlignment:
    weight: np.ndarray  # [d_source, d_reference]
    method: str

    def apply(self, x: np.ndarray, normalize: bool = True) -> np.ndarray:
        """Map source vectors into the reference space (re-normalised to unit length by default)."""
        y = np.asarray(x, dtype=np.float64) @ self.weight
        if normalize:
            y /= np.clip(np.linalg.norm(y, axis=1, keepdims=True), 1e-12, None)
        return y.astype(np.float32)


def fit_alignment(source: np.ndarray, reference: np.ndarray, method: str = "orthogonal") -> LinearAlignment:
    """Fit the map from `source` anchors to `reference` anchors (rows correspond)."""
    if method not in METHODS:
        raise ValueError(f"sync.align method={method!r} is unknown; valid choices: {list(METHODS)}")
    x, y = np.asarray(source, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    if x.shape[0] != y.shape[0] or x.ndim != 2 or y.ndim != 2:
        raise ValueError(f"anchor sets must be [N, d] with the same N, got {x.shape} and {y.shape}")
    if method == "orthogonal":
        if x.shape[1] != y.shape[1]:
            raise ValueError(f"orthogonal alignment needs equal dims, got {x.shape[1]} and {y.shape[1]}")
        u, _, vt = np.linalg.svd(x.T @ y)
        return LinearAlignment(u @ vt, method)
    w, *_ = np.linalg.lstsq(x, y, rcond=None)
    return LinearAlignment(w, method)


def embedding_drift(a: np.ndarray, b: np.ndarray) -> float:
    """Mean 1 - cos(a_i, b_i) between corresponding rows (the drift the alignment should remove)."""
    a = a / np.clip(np.linalg.norm(a, axis=1, keepdims=True), 1e-12, None)
    b = b / np.clip(np.linalg.norm(b, axis=1, keepdims=True), 1e-12, None)
    return float(np.mean(1.0 - np.sum(a * b, axis=1)))
