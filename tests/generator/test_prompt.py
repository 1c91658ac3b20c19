"""Prompt building: the question is never cut, passages fill the budget in order, the template is as documented."""

from __future__ import annotations

import random

import pytest

from ragtrain.generator.prompt import (
    MIN_PASSAGE_TOKENS,
    PromptBuilder,
    PromptTooLongError,
    Template,
    passage_text,
)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from ragtrain.embed.model import minilm_path

    return AutoTokenizer.from_pretrained(minilm_path())


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_layout_is_the_documented_template(tok) -> None:
    b = PromptBuilder(tok, 64, 0, Template("question:", "context:"))
    src = b.source("Who plays the oboe?", [passage_text("Ann Lee", "Ann plays the oboe.", True), "Bob sings."])
    text = tok.decode(src)
    assert (
        text == "[CLS] question : who plays the oboe? [SEP] context : ann lee : ann plays the oboe. [SEP] "
        "context : bob sings. [SEP]"
    )
    assert tok.convert_ids_to_tokens(b.target("hurdy-gurdy", 16))[-1] == "[SEP]"  # the decoder learns to stop
    assert passage_text("T", "x", False) == "x" and passage_text("", "x", True) == "x"


def test_question_is_never_truncated_randomised(tok) -> None:
    """Random questions, passages and budgets: the prompt starts with the whole question and fits the budget."""
    rng = random.Random(0)
    words = [
        "oboe",
        "harp",
        "town",
        "river",
        "glassworks",
        "founded",
        "year",
        "Varnel",
        "Oskatine",
        "who",
        "which",
        "what",
        "when",
        "born",
        "company",
        "hurdy-gurdy",
        "O'Neil",
    ]
    for trial in range(300):
        q = " ".join(rng.choices(words, k=rng.randint(1, 30))) + "?"
        passages = [" ".join(rng.choices(words, k=rng.randint(0, 80))) for _ in range(rng.randint(0, 6))]
        causal = trial % 3 == 0
        t = Template(*rng.choice([("", "", "answer:"), ("question:", "context:", "answer:")]))
        q_ids = _ids(tok, q)
        fixed = 1 + len(_ids(tok, t.question_prefix)) + 1 + (len(_ids(tok, t.answer_prefix)) if causal else 0)
        max_len = rng.randint(8, 200)
        b = PromptBuilder(tok, max_len, rng.choice([0, 5, 20]), t, causal=causal)
        if len(q_ids) + fixed > max_len:
            with pytest.raises(PromptTooLongError, match="questions are never cut"):
                b.source(q, passages)
            continue
        src = b.source(q, passages)
        head = [tok.cls_token_id] + _ids(tok, t.question_prefix) + q_ids + [tok.sep_token_id]
        assert src[: len(head)] == head, "the whole question comes first"
        assert len(src) <= max_len
        if causal:
            assert src[len(src) - len(_ids(tok, t.answer_prefix)) :] == _ids(tok, t.answer_prefix)


def test_passages_fill_in_order_then_cut_then_drop(tok) -> None:
    b = PromptBuilder(tok, 24, 0, Template())
    p1, p2, p3 = "one two three four five", "six seven eight nine ten eleven twelve", "thirteen"
    q = "what"
    src = b.source(q, [p1, p2, p3])
    # [CLS] what [SEP] = 3; p1 + [SEP] = 6 -> 9 used; 15 left: p2 (7 + [SEP]) fits -> 17; p3 (1 + [SEP]) fits
    assert tok.decode(src) == f"[CLS] {q} [SEP] {p1} [SEP] {p2} [SEP] {p3} [SEP]"
    short = PromptBuilder(tok, 14, 0, Template())
    src = short.source(q, [p1, p2, p3])  # 9 used, 5 left: p2 cut to 4 tokens (= MIN_PASSAGE_TOKENS) + [SEP]
    assert tok.decode(src) == f"[CLS] {q} [SEP] {p1} [SEP] six seven eight nine [SEP]"
    assert MIN_PASSAGE_TOKENS == 4
    tiny = PromptBuilder(tok, 12, 0, Template())
    assert tok.decode(tiny.source(q, [p1, p2])) == f"[CLS] {q} [SEP] {p1} [SEP]"  # 3 left < 4 + [SEP]: p2 dropped


def test_per_passage_cap(tok) -> None:
    b = PromptBuilder(tok, 128, 3, Template())
    src = b.source("q", ["a b c d e", "f g h i"])
    assert tok.decode(src) == "[CLS] q [SEP] a b c [SEP] f g h [SEP]"


def test_question_alone_too_long_is_a_clear_error(tok) -> None:
    b = PromptBuilder(tok, 8, 0, Template())
    with pytest.raises(PromptTooLongError, match="max_source_length=8"):
        b.source("one two three four five six seven", ["p"])


def _bpe_tokenizer(keep_newlines: bool):
    """A GPT-2-style byte-level BPE tokenizer (no [CLS]/[SEP], EOS only) trained here on a few words; with
    keep_newlines=False its normaliser drops newlines as T5's SentencePiece does."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    if not keep_newlines:
        t.normalizer = normalizers.Replace("\n", "")
    trainer = trainers.BpeTrainer(special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["who plays the oboe", "ann plays the oboe", "bob sings", "answer:"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")


@pytest.mark.parametrize("causal", [True, False])
def test_pieces_are_separated_when_the_tokenizer_has_no_sep_and_no_prefix_is_set(causal: bool) -> None:
    """GPT-2 and T5 tokenizers have no [SEP]: with empty prefixes the question and passages used to run together."""
    tok = _bpe_tokenizer(keep_newlines=True)
    b = PromptBuilder(tok, 64, 0, Template("", "", "answer:"), causal=causal)
    text = tok.decode(b.source("who plays the oboe", ["ann plays the oboe", "bob sings"]))
    assert text == (
        "who plays the oboe\nann plays the oboe\nbob sings\nanswer:"
        if causal
        else "who plays the oboe\nann plays the oboe\nbob sings\n<eos>"
    )  # seq2seq sources still end with EOS
    # a passage prefix separates the pieces itself: no marker added (T5's "question: ... context: ..." layout)
    b = PromptBuilder(tok, 64, 0, Template("", "bob", ""), causal=False)
    assert tok.decode(b.source("who", ["sings"])) == "whobobsings<eos>"
    # a tokenizer that drops newlines (T5) separates with EOS instead, and does not end twice
    t5ish = _bpe_tokenizer(keep_newlines=False)
    b = PromptBuilder(t5ish, 64, 0, Template("", "", ""), causal=False)
    assert t5ish.decode(b.source("who", ["sings"])) == "who<eos>sings<eos>"
