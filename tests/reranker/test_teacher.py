"""The cross-encoder teacher: its KL term by hand, the batch layout, bad input before work, and one real run
(trained on Ray Train, scores on Ray Data, cached, the bi-encoder trained with the term, the reranker evaluated)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ragtrain.config import to_typed
from ragtrain.config.retriever import RetrieverConfig
from ragtrain.retriever.teacher.base import build_teacher_loss, teacher_matrix
from ragtrain.retriever.teacher.kl import KL
from ragtrain.retriever.teacher.margin_mse import MarginMSE
from ragtrain.runtime.errors import ConfigError
from tests.conftest import compose, tiny_overrides


def test_kl_equals_the_hand_computed_value_over_scored_candidates_only() -> None:
    torch.manual_seed(0)
    b, h, d = 2, 2, 4
    q = torch.nn.functional.normalize(torch.randn(b, d), dim=1)
    p = torch.nn.functional.normalize(torch.randn(b + b * h, d), dim=1)
    teacher = torch.tensor([[3.0, 1.0, -1.0], [2.0, float("nan"), 0.5]])  # query 1's first negative: a top-up
    got = KL()(q, p, teacher, temperature=0.5, teacher_temperature=2.0)

    def kl(t: np.ndarray, s: np.ndarray) -> float:
        pt, ps = np.exp(t - t.max()), np.exp(s - s.max())
        pt, ps = pt / pt.sum(), ps / ps.sum()
        return float((pt * np.log(pt / ps)).sum())

    qn, pn = q.numpy().astype(np.float64), p.numpy().astype(np.float64)
    s0 = np.array([qn[0] @ pn[0], qn[0] @ pn[2], qn[0] @ pn[3]]) / 0.5  # positive 0, negatives 2, 3
    s1 = np.array([qn[1] @ pn[1], qn[1] @ pn[5]]) / 0.5  # positive 1, negative 5 (4 is unscored)
    want = (kl(np.array([3.0, 1.0, -1.0]) / 2.0, s0) + kl(np.array([2.0, 0.5]) / 2.0, s1)) / 2
    assert got.item() == pytest.approx(want, rel=1e-5)
    qg = q.clone().requires_grad_(True)
    KL()(qg, p, teacher, 0.5, 2.0).backward()
    assert torch.isfinite(qg.grad).all() and qg.grad.abs().sum() > 0


def test_a_student_equal_to_the_teacher_pays_nothing() -> None:
    torch.manual_seed(1)
    q = torch.nn.functional.normalize(torch.randn(3, 8), dim=1)
    p = torch.nn.functional.normalize(torch.randn(3 + 3 * 2, 8), dim=1)
    cand = torch.cat([p[:3].unsqueeze(1), p[3:].view(3, 2, -1)], 1)
    logits = torch.einsum("bd,bkd->bk", q, cand) / 0.05
    assert KL()(q, p, logits, 0.05, 1.0).item() == pytest.approx(0.0, abs=1e-6)
    assert KL()(q, p, logits * 0.1, 0.05, 1.0).item() > 1e-3  # a flatter teacher: the student is pulled


def test_margin_mse_equals_the_hand_computed_value_over_scored_pairs_only() -> None:
    torch.manual_seed(2)
    b, h, d = 2, 2, 4
    q = torch.nn.functional.normalize(torch.randn(b, d), dim=1)
    p = torch.nn.functional.normalize(torch.randn(b + b * h, d), dim=1)
    teacher = torch.tensor([[3.0, 1.0, -1.0], [2.0, float("nan"), 0.5]])  # query 1's first negative: unscored
    got = MarginMSE()(q, p, teacher, temperature=0.5, teacher_temperature=2.0)
    qn, pn = q.numpy().astype(np.float64), p.numpy().astype(np.float64)

    def s(i: int, j: int) -> float:
        return float(qn[i] @ pn[j]) / 0.5

    # (query, positive, negative, teacher margin / T_t): query 0 with negatives 2 and 3, query 1 with negative 5
    pairs = [(0, 0, 2, (3.0 - 1.0) / 2.0), (0, 0, 3, (3.0 + 1.0) / 2.0), (1, 1, 5, (2.0 - 0.5) / 2.0)]
    want = np.mean([((s(i, pos) - s(i, neg)) - m) ** 2 for i, pos, neg, m in pairs])
    assert got.item() == pytest.approx(want, rel=1e-5)
    qg = q.clone().requires_grad_(True)
    MarginMSE()(qg, p, teacher, 0.5, 2.0).backward()
    assert torch.isfinite(qg.grad).all() and qg.grad.abs().sum() > 0
    # A student whose margins are the teacher's pays nothing, even with different absolute scores
    cand = torch.cat([p[:b].unsqueeze(1), p[b:].view(b, h, -1)], 1)
    logits = torch.einsum("bd,bkd->bk", q, cand) / 0.5
    assert MarginMSE()(q, p, logits + 7.0, 0.5, 1.0).item() == pytest.approx(0.0, abs=1e-9)
    # No pair scored: zero, with a graph
    none = torch.full((b, 1 + h), float("nan"))
    assert MarginMSE()(qg, p, none, 0.5, 1.0).item() == 0.0
    assert isinstance(build_teacher_loss("margin_mse"), MarginMSE) and isinstance(build_teacher_loss("kl"), KL)


def test_teacher_matrix_follows_the_local_batch_layout() -> None:
    table = {7: {10: 1.0, 20: 2.0, 21: 3.0}, 8: {11: 4.0}}
    pids = [10, 11, 20, 21, 30, 31]  # positives of queries 7, 8; then 2 negatives each
    m = teacher_matrix(table, [7, 8], pids, 2)
    assert m[0].tolist() == [1.0, 2.0, 3.0]
    assert m[1, 0].item() == 4.0 and torch.isnan(m[1, 1:]).all()


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (["retriever.teacher.weight=-1"], "retriever.teacher.weight"),
        (["retriever.teacher.weight=0.5"], "retriever.train.hard_negatives > 0"),
        (
            [
                "retriever.teacher.weight=0.5",
                "retriever.train.hard_negatives=1",
                "refresh.enabled=true",
                "refresh.every_steps=2",
            ],
            "refresh.enabled",
        ),
        (["retriever.teacher.temperature=0"], "retriever.teacher.temperature"),
        (["retriever.teacher.path=/nonexistent/teacher"], "retriever.teacher.path"),
    ],
)
def test_bad_teacher_settings_fail_in_the_config(tmp_path, extra, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace(">", ">")):
        to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path), *extra]))


def test_distillation_loss_is_kl_or_margin_mse(tmp_path) -> None:
    cfg = to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path), "retriever.teacher.loss=margin_mse"]))
    assert isinstance(build_teacher_loss(cfg.retriever.teacher.loss), MarginMSE)
    with pytest.raises(ConfigError) as e:  # one line naming the key and the registry's names
        to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path), "retriever.teacher.loss=mse"]))
    assert str(e.value) == "retriever.teacher.loss must be one of ['kl', 'margin_mse'], got 'mse'"


def test_a_teacher_for_another_tokenizer_is_refused(tmp_path) -> None:
    from transformers import BertTokenizerFast

    from ragtrain.reranker.model import TEACHER_META, build_cross_encoder, check_teacher, save_teacher

    tiny = RetrieverConfig(model="tiny")
    good = save_teacher(build_cross_encoder(tiny), tiny, tmp_path / "good", {})
    assert check_teacher(good, tiny)["base_model"] == "tiny"
    with pytest.raises(ConfigError, match="holds no ragtrain teacher"):
        check_teacher(tmp_path, tiny)
    # the same model files with another vocabulary beside them
    other = tmp_path / "other"
    other.mkdir()
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello"]) + "\n")
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(other)
    for f in ("config.json", "model.safetensors", TEACHER_META):
        (other / f).write_bytes((good / f).read_bytes())
    with pytest.raises(ConfigError, match="built for another tokenizer"):
        check_teacher(other, tiny)


def test_scores_on_ray_data_equal_in_process_scores(ray_session, tmp_path) -> None:
    """The pool's actors read passages from a PassageStore and return one score per (query, passage) pair, in order."""
    from ragtrain.config.resources import PoolResources
    from ragtrain.data import Passage
    from ragtrain.data.store import write_store
    from ragtrain.embed.model import load_tokenizer
    from ragtrain.reranker.model import build_cross_encoder, save_teacher, score_pairs
    from ragtrain.reranker.score import score_on_ray

    tiny = RetrieverConfig(model="tiny")
    torch.manual_seed(0)
    model = build_cross_encoder(tiny)
    torch.nn.init.normal_(model.classifier.weight, std=1.0)  # a head that tells pairs apart (init: std 0.02)
    folder = save_teacher(model, tiny, tmp_path / "teacher", {})
    words = "alpha beta gamma delta river mountain archive protein lattice quantum".split()
    texts = [" ".join(words[i % 7 :] + words[: i % 5]) for i in range(30)]
    store = write_store(tmp_path / "p.arrow", (Passage(f"p{i}", "", t) for i, t in enumerate(texts)))
    queries = ["what is alpha", "river archive", "quantum lattice protein"]
    pairs = [(q, p) for q in range(3) for p in range(0, 30, 2)][::-1]  # any order comes back in that order
    got = score_on_ray(tiny, folder, queries, store.texts(), pairs, 48, PoolResources(num_actors=2, cpus_per_actor=1))
    want = score_pairs(
        build_cross_encoder(tiny, folder),
        load_tokenizer(tiny),
        [queries[q] for q, _ in pairs],
        [texts[p] for _, p in pairs],
        48,
    )
    assert np.std(want) > 1e-3  # pairs score apart by far more than the tolerance: a misplaced score would show
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.slow(reason="a pipeline run with a teacher fit of its own (~80 s); the pieces are tested above")
def test_run_trains_the_teacher_scores_candidates_and_distils(ray_session, tmp_path) -> None:
    """A tiny quickstart with a teacher: trained on Ray Train, scores on Ray Data cached in the run folder, the
    bi-encoder trained with the KL term, the teacher's reranking evaluated."""
    from ragtrain.corpus.load import load_data
    from ragtrain.data.store import PassageStore
    from ragtrain.embed.model import load_tokenizer
    from ragtrain.pipeline.stages import run
    from ragtrain.reranker.model import build_cross_encoder, check_teacher, score_pairs
    from ragtrain.reranker.score import SCORES_FILE
    from tests.conftest import TEACHER

    cfg = to_typed(
        compose(["experiment=quickstart", *tiny_overrides(tmp_path), *TEACHER, "logger=none", "export=false"])
    )
    results = run(cfg)
    out = Path(cfg.output_dir)
    rerank = results["teacher_rerank"]  # the teacher reordering the zero-shot top 100: a full metric set
    assert 0.0 <= rerank["ndcg@10"] <= 1.0 and rerank["teacher_steps"] == 3
    assert rerank["recall@100"] == results["zeroshot"]["recall@100"]  # a reordering of the same 100
    assert results["train"]["train/teacher_kl"] > 0  # the bi-encoder trained with the term
    check_teacher(out / "teacher", cfg.retriever)  # saved, loadable, for this tokenizer
    cache = json.loads((out / "teacher" / SCORES_FILE).read_text())
    data = load_data(cfg.data)
    train_q, eval_q = sorted(data.train_qrels), sorted(data.eval_qrels)
    # query positions: the training queries (TrainExample.qidx), then the evaluated ones with their top 100
    assert {q for q, _ in cache["pairs"]} == set(range(len(train_q) + len(eval_q)))
    n_train_pairs = sum(1 for q, _ in cache["pairs"] if q < len(train_q))
    assert n_train_pairs >= 2 * len(train_q)  # each training query's positive and mined negatives
    # the cached scores are the saved teacher's: scored again in-process here
    texts = PassageStore(out / "corpus" / "passages.arrow").texts()
    model, tok = build_cross_encoder(cfg.retriever, out / "teacher"), load_tokenizer(cfg.retriever)
    every = max(1, len(cache["pairs"]) // 8)
    pairs, want = cache["pairs"][::every], cache["scores"][::every]
    qtext = [data.queries[q] for q in train_q + eval_q]
    mine = score_pairs(model, tok, [qtext[q] for q, _ in pairs], [texts[p] for _, p in pairs], 64)
    assert np.std(want) > 100 * 2e-6  # the scores differ between pairs by far more than the tolerance below
    np.testing.assert_allclose(mine, want, atol=2e-6)


def test_rerank_orders_each_list_by_its_own_scores() -> None:
    from ragtrain.reranker.stage import rerank_run

    run = {"a": ["x", "y", "z"], "b": ["u", "v"]}
    got = rerank_run(run, ["a", "b"], [0.1, 0.9, 0.5, 2.0, 2.0])
    assert got == {"a": ["y", "z", "x"], "b": ["u", "v"]}  # b: a tie keeps the first stage's order
    with pytest.raises(ValueError, match="4 scores for 5"):
        rerank_run(run, ["a", "b"], [0.1, 0.9, 0.5, 2.0])
