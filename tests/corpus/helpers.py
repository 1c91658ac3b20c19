"""Small hand-made document folders and a whitespace tokenizer for the corpus tests."""

from __future__ import annotations

import json
import re
from pathlib import Path


class WhitespaceTokenizer:
    """One token per whitespace-separated word, with character offsets (the HF fast-tokenizer interface)."""

    model_max_length = 512

    def __call__(
        self, text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = True, verbose: bool = True
    ) -> dict:
        spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
        return {"input_ids": list(range(len(spans))), "offset_mapping": spans}


def write_folder(
    root: Path,
    files: dict[str, str | bytes],
    queries: dict[str, str] | None = None,
    qrels: dict[str, list[tuple[str, str]]] | None = None,
) -> Path:
    """Write documents, plus queries.jsonl and qrels/<split>.tsv (BEIR format) when given."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    if queries is not None:
        (root / "queries.jsonl").write_text(
            "".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in queries.items())
        )
    for split, rows in (qrels or {}).items():
        (root / "qrels").mkdir(exist_ok=True)
        (root / "qrels" / f"{split}.tsv").write_text(
            "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, d in rows)
        )
    return root


def small_folder(root: Path) -> Path:
    """Three documents in three formats, two queries each in train and dev (judged on document ids)."""
    return write_folder(
        root,
        {
            "a.txt": "Alpha is the first letter. It starts the alphabet.",
            "sub/b.md": "# Bravo\n\nBravo is the second letter.\n\n## Use\n\nPilots say bravo.",
            "c.html": "<html><head><title>Charlie</title></head><body><p>Charlie is third.</p></body></html>",
        },
        queries={"q1": "first letter", "q2": "second letter", "q3": "third letter", "q4": "pilots"},
        qrels={"train": [("q1", "a"), ("q2", "sub/b")], "dev": [("q3", "c"), ("q4", "sub/b")]},
    )


def mixed_folder(root: Path, many: int = 40) -> Path:
    """small_folder plus `many` text files (several read tasks), an exact duplicate of a.txt, a jsonl of two, and a
    binary file (zz.txt)."""
    small_folder(root)
    files: dict[str, str | bytes] = {
        f"many/{i:02d}.txt": f"Document {i} talks about topic {i % 7}. " * (3 + i % 5) for i in range(many)
    }
    files["dup.txt"] = "Alpha is the first letter. It starts the alphabet."  # same content as a.txt: dropped
    files["more.jsonl"] = "".join(
        json.dumps({"_id": f"j{i}", "title": f"J {i}", "text": f"Jay {i} text."}) + "\n" for i in range(2)
    )
    files["zz.txt"] = b"bin\x00ary"
    return write_folder(root, files)
