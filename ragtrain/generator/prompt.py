"""Prompt = question + passages, built on token ids so truncation can never cut the question.

Layout (one string per piece, tokenised separately and concatenated; `[X]` = the tokenizer's special token,
left out when the tokenizer has none — e.g. T5 has no [CLS] and no [SEP]):

    [CLS] {question_prefix} question [SEP] {passage_prefix} passage_1 [SEP] ... {passage_prefix} passage_k [SEP]
    + for causal LMs: {answer_prefix}                  (the answer tokens + EOS follow as the target)

With `chat=True` (`generator.prompt=chat`, causal LMs with a chat template) the same pieces, separated by
newlines, form the user turn of the tokenizer's own chat template, and the template's assistant header takes the
place of `answer_prefix`:

    {template up to the user's text} {question_prefix} question \n {passage_prefix} passage_1 \n ...
    {template from the end of the user's text to the assistant's answer}

A causal LM's tokenizer without `[SEP]` (GPT-2, Llama) separates the pieces with a newline in either style.

`passage_i` is `"{title}: {text}"` (or `text` without titles), cut to `passage_max_tokens`. Passages are added
in the given order until the source budget (`max_source_length`) is spent; the passage that crosses the budget
is cut to the tokens left (dropped if fewer than MIN_PASSAGE_TOKENS are left) and later ones are dropped. The
question is never cut: a question that alone exceeds the budget is an error, not a silently shortened prompt.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MIN_PASSAGE_TOKENS = 4  # a passage stub shorter than this carries no fact, only noise


class PromptTooLongError(ValueError):
    """The question (plus the template's fixed tokens) does not fit in the source budget."""


class ChatTemplateError(ValueError):
    """generator.prompt=chat with a tokenizer that has no usable chat template."""


_USER_SLOT = "\x00ragtrain-user-text\x00"  # stands for the user's text while the template is rendered


def chat_frame(tokenizer) -> tuple[str, str]:
    """The chat template's text before and after the user's message (the latter ends with the assistant header),
    from rendering it once around a placeholder: the pieces are then tokenised like every other prompt piece."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the tokenizer has no chat template: use generator.prompt=plain")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _USER_SLOT}], add_generation_prompt=True, tokenize=False
    )
    head, found, tail = text.partition(_USER_SLOT)
    if not found:
        raise ChatTemplateError("the chat template drops the user's message: use generator.prompt=plain")
    return head, tail


@dataclass(frozen=True)
class Template:
    question_prefix: str = ""  # e.g. "question:" for T5-style models; BERT2BERT uses the [SEP] layout alone
    passage_prefix: str = ""  # e.g. "context:"
    answer_prefix: str = "answer:"  # causal LMs only: generation starts after it


def passage_text(title: str, text: str, include_title: bool) -> str:
    """The text of one passage as it appears in the prompt."""
    return f"{title}: {text}" if include_title and title else text


class PromptPassages(Mapping[str, str]):
    """{passage id: prompt text}, read from the corpus mapping on access (a PassageStore pickles as its path, so
    the generator workers read the texts they retrieve instead of receiving every passage)."""

    def __init__(self, corpus: Mapping[str, Any], include_title: bool):
        self.corpus, self.include_title = corpus, include_title

    def __getitem__(self, pid: str) -> str:
        p = self.corpus[pid]
        return passage_text(p.title, p.text, self.include_title)

    def __len__(self) -> int:
        return len(self.corpus)

    def __iter__(self) -> Iterator[str]:
        return iter(self.corpus)


class PromptBuilder:
    """Token-level prompt assembly for one tokenizer (passage token ids are cached by text)."""

    def __init__(
        self,
        tokenizer,
        max_source_length: int,
        passage_max_tokens: int,
        template: Template,
        causal: bool = False,
        chat: bool = False,
    ):
        self.tok, self.max_len, self.template, self.causal = tokenizer, max_source_length, template, causal
        self.passage_max = passage_max_tokens if passage_max_tokens > 0 else max_source_length
        # Specials are taken from the tokenizer: BERT-style [CLS]/[SEP]; T5 has only EOS (used as the end marker).
        self.start = [tokenizer.cls_token_id] if tokenizer.cls_token_id is not None else []
        sep = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else None
        self.sep = [sep] if sep is not None else []
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else sep
        if not self.sep and (causal or chat or not template.passage_prefix):
            # No [SEP] (GPT-2, Llama, T5) and, for T5-style models, no passage prefix: without a marker the question
            # and the passages would run into one another, so pieces end with a newline, or EOS where the tokenizer
            # drops newlines (T5). (T5's own "question: ... context: ..." layout needs no marker.)
            self.sep = self._ids("\n") or ([eos] if eos is not None else [])
        # Seq2seq sources end with EOS (T5 is trained that way) unless the [SEP] after each piece already ends it.
        ended = self.sep[-1:] in ([sep], [eos])  # the last piece's marker already ends the source
        self.end = [] if ended or causal or eos is None else [eos]
        self.eos = eos
        self.q_prefix = self._ids(template.question_prefix)
        self.p_prefix = self._ids(template.passage_prefix)
        self.a_prefix = self._ids(template.answer_prefix) if causal else []
        if chat:  # the template's own frame around the user turn; its assistant header is the answer prefix
            head, tail = chat_frame(tokenizer)
            self.start, self.a_prefix, self.end = self._ids(head), self._ids(tail), []
        self._cache: dict[str, list[int]] = {}

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def passage_ids(self, text: str) -> list[int]:
        """Token ids of one passage, cut to passage_max_tokens (cached: the corpus repeats across epochs)."""
        ids = self._cache.get(text)
        if ids is None:
            ids = self._ids(text)[: self.passage_max]
            self._cache[text] = ids
        return ids

    def _fixed(self, question: str) -> tuple[list[int], list[int]]:
        """(tokens before the passages, tokens after them); PromptTooLongError if they alone exceed the budget."""
        head = self.start + self.q_prefix + self._ids(question) + self.sep
        tail = self.end + self.a_prefix  # fixed tokens after the passages
        if len(head) + len(tail) > self.max_len:
            raise PromptTooLongError(
                f"the question takes {len(head) + len(tail)} tokens with the template's fixed tokens, more than "
                f"generator.max_source_length={self.max_len}: raise max_source_length (questions are never cut): "
                f"{question[:80]!r}"
            )
        return head, tail

    def whole_passages(self, question: str, passages: Sequence[str]) -> int:
        """How many of `passages`, in this order, `source` would include whole (not cut, not dropped)."""
        head, tail = self._fixed(question)
        used = len(head) + len(tail)
        for i, text in enumerate(passages):
            used += len(self.p_prefix) + len(self.passage_ids(text)) + len(self.sep)
            if used > self.max_len:
                return i
        return len(passages)

    def source(self, question: str, passages: Sequence[str] = ()) -> list[int]:
        """Source token ids: the whole question, then as many passages as fit in max_source_length."""
        head, tail = self._fixed(question)
        ids = list(head)
        for text in passages:
            left = self.max_len - len(ids) - len(tail)
            piece = self.p_prefix + self.passage_ids(text)
            need = len(piece) + len(self.sep)
            if need <= left:
                ids += piece + self.sep
                continue
            if left - len(self.sep) >= MIN_PASSAGE_TOKENS:  # the last passage that fits only in part is cut
                ids += piece[: left - len(self.sep)] + self.sep
            break
        return ids + tail

    def target(self, answer: str, max_target_length: int) -> list[int]:
        """Target token ids: the answer then EOS (the decoder learns to stop)."""
        ids = self._ids(answer)[: max(1, max_target_length - 1)]
        return ids + ([self.eos] if self.eos is not None else [])
