"""Retrieval datasets: BEIR-format loading/writing and a synthetic fictional-people KB.

Pure Python on purpose (no torch / ray / mlflow / hydra imports), so data handling can be
imported and tested anywhere, including Ray workers that have not set up a GPU yet.
"""

from .beir import load_beir, write_beir
from .synthetic import make_synthetic
from .types import DataError, Passage, RetrievalData

__all__ = ["DataError", "Passage", "RetrievalData", "load_beir", "make_synthetic", "write_beir"]
