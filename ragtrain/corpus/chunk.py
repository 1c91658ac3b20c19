"""Split a document into passages of at most `max_tokens` retriever tokens, preferring sentence boundaries.

Rules (tested in tests/corpus/test_chunk.py):
- Budget: the title is prepended to every chunk (`Passage.full_text`), so a chunk's body gets
  `max_tokens - tokens(title)` tokens; `max_tokens` is then the whole passage as the encoder sees it (special
  tokens aside).
- A window ends at the last sentence start inside it that keeps it at least half full, else after the budget.
- The next window starts `overlap` tokens before the previous end, moved forward to the first sentence start in
  that tail when there is one (so overlap is at most `overlap` tokens, exactly `overlap` without a boundary).
- Offsets are characters of the cleaned document text: `text[start:end]` is the chunk body, exactly.
- Passage ids are `<doc_id>#<k>`, k = 0, 1, ... (also for a document that fits in one window).
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from typing import Any

from ragtrain.data.types import DataError, Passage

__all__ = ["chunk_document", "chunk_passage", "sentence_starts", "token_spans"]

# A sentence starts after . ! ? (and closing quotes/brackets) plus whitespace, after the CJK full stops 。！？
# (no space follows them), and at every line start.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+|[。！？][」』）\"')]*\s*|\n+")


def token_spans(tokenizer: Any, text: str) -> list[tuple[int, int]]:
    """Character spans of the tokenizer's tokens of `text` (no special tokens); needs a fast tokenizer."""
    # verbose=False: a whole document is longer than the model on purpose (no "sequence length" warning)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return [(int(s), int(e)) for s, e in enc["offset_mapping"] if e > s]


def sentence_starts(text: str, spans: list[tuple[int, int]]) -> list[int]:
    """Token indices at which a sentence (or line) starts, ascending, excluding 0."""
    starts = [s for s, _ in spans]
    out: list[int] = []
    for m in _SENTENCE_END.finditer(text):
        t = bisect_left(starts, m.end())  # first token at or after the next sentence's first character
        if 0 < t < len(spans) and (not out or out[-1] != t):
            out.append(t)
    return out


def chunk_document(doc: dict[str, str], tokenizer: Any, max_tokens: int, overlap: int) -> list[dict[str, Any]]:
    """Passages {id, doc_id, title, text, start, end} of one cleaned document (see module doc)."""
    if not 0 <= overlap < max_tokens:
        raise ValueError(f"need 0 <= overlap < max_tokens, got overlap={overlap}, max_tokens={max_tokens}")
    text, title = doc["text"], doc.get("title", "")
    n_title = len(token_spans(tokenizer, title)) if title else 0
    budget = max_tokens - n_title
    if budget <= overlap:
        raise DataError(
            f"{doc.get('source', '?')}: the title of document {doc['id']!r} takes {n_title} of "
            f"data.chunk.max_tokens={max_tokens} tokens, leaving {budget} for text with "
            f"data.chunk.overlap={overlap}: raise max_tokens or shorten the title"
        )
    spans = token_spans(tokenizer, text)
    if not spans:  # nothing the tokenizer keeps: one passage, so the document is still retrievable by title
        return [_passage(doc, 0, 0, len(text))]
    bounds = sentence_starts(text, spans)
    n, i = len(spans), 0
    out: list[dict[str, Any]] = []
    while True:
        j = min(i + budget, n)
        if j < n:
            lo = max(i + overlap + 1, i + (budget + 1) // 2)  # progress, and no window under half the budget
            k = bisect_right(bounds, j) - 1
            if k >= 0 and bounds[k] >= lo:
                j = bounds[k]
        out.append(_passage(doc, len(out), spans[i][0], spans[j - 1][1]))
        if j >= n:
            return out
        nxt = j - overlap
        k = bisect_left(bounds, nxt)
        if k < len(bounds) and bounds[k] < j:  # a sentence start inside the overlap: begin the window there
            nxt = bounds[k]
        i = nxt


def chunk_passage(p: Passage, tokenizer: Any, max_tokens: int, overlap: int) -> list[Passage]:
    """`chunk_document` of one passage, as Passages whose doc_id is `p.id` (data=squad's paragraphs: offsets index
    the paragraph's text as given, so answer spans map onto chunks)."""
    record = {"id": p.id, "title": p.title, "text": p.text, "source": f"passage {p.id!r}"}
    return [Passage(**c) for c in chunk_document(record, tokenizer, max_tokens, overlap)]


def _passage(doc: dict[str, str], k: int, start: int, end: int) -> dict[str, Any]:
    """One chunk record."""
    return {
        "id": f"{doc['id']}#{k}",
        "doc_id": doc["id"],
        "title": doc.get("title", ""),
        "text": doc["text"][start:end],
        "start": start,
        "end": end,
    }
