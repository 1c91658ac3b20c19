"""The cross-encoder: one relevance logit per (query, passage) pair, from the retriever's own base model.

`retriever.model`'s encoder with a fresh one-logit head (`AutoModelForSequenceClassification`, num_labels=1), or
for `retriever=tiny` a tiny BERT of the same shape; a trained one is a `save_pretrained` folder with the
tokenizer beside it and `ragtrain_teacher.json`, which names the vocabulary it was built for.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ragtrain.config.retriever import RetrieverConfig
from ragtrain.embed.model import load_tokenizer, resolve_model_path
from ragtrain.runtime.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TEACHER_META = "ragtrain_teacher.json"


def build_cross_encoder(retriever: RetrieverConfig, path: str | Path | None = None) -> PreTrainedModel:
    """A trained cross-encoder from `path`, else a new one from retriever.model's encoder (seeded head)."""
    # lazy: transformers is heavy (~1 s); this module imports without it
    from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification

    if path:
        return AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1)
    if retriever.model == "tiny":
        t = retriever.tiny
        return BertForSequenceClassification(
            BertConfig(
                vocab_size=load_tokenizer(retriever).vocab_size,
                hidden_size=t.hidden_size,
                num_hidden_layers=t.num_layers,
                num_attention_heads=t.num_heads,
                intermediate_size=t.intermediate_size,
                hidden_dropout_prob=t.dropout,
                attention_probs_dropout_prob=t.dropout,
                max_position_embeddings=512,
                num_labels=1,
            )
        )
    return AutoModelForSequenceClassification.from_pretrained(resolve_model_path(retriever.model), num_labels=1)


def pair_inputs(tokenizer, queries: Sequence[str], passages: Sequence[str], max_length: int) -> dict:
    """Tokenised (query, passage) pairs; only the passage is cut when a pair is too long."""
    return tokenizer(
        list(queries),
        list(passages),
        truncation="only_second",
        max_length=max_length,
        padding=True,
        return_tensors="pt",
    )


@torch.inference_mode()
def score_pairs(
    model: nn.Module, tokenizer, queries: Sequence[str], passages: Sequence[str], max_length: int, batch_size: int = 32
) -> np.ndarray:
    """The model's logit for each (queries[i], passages[i]); inner batches sorted by length (less padding)."""
    model.eval()
    order = np.argsort([len(q) + len(p) for q, p in zip(queries, passages)], kind="stable")
    out = np.empty(len(order), dtype=np.float32)
    device = next(model.parameters()).device
    for s in range(0, len(order), batch_size):
        rows = order[s : s + batch_size]
        enc = pair_inputs(tokenizer, [queries[i] for i in rows], [passages[i] for i in rows], max_length)
        out[rows] = model(**{k: v.to(device) for k, v in enc.items()}).logits.view(-1).float().cpu().numpy()
    return out


def vocab_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary (token -> id): two tokenizers that split text alike agree on it."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def save_teacher(model: PreTrainedModel, retriever: RetrieverConfig, folder: str | Path, extra: dict) -> Path:
    """The model, its tokenizer and `ragtrain_teacher.json` (base model, vocabulary fingerprint, `extra`)."""
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer = load_tokenizer(retriever)
    tokenizer.save_pretrained(folder)
    meta = {"base_model": retriever.model, "vocab": vocab_fingerprint(tokenizer), **extra}
    (folder / TEACHER_META).write_text(json.dumps(meta, indent=1))
    return folder


def check_teacher(path: str | Path, retriever: RetrieverConfig) -> dict:
    """A saved teacher folder that this retriever's tokenizer matches; ConfigError naming retriever.teacher.path
    otherwise. Returns its metadata."""
    from transformers import AutoTokenizer  # lazy: transformers is heavy (~1 s); this module imports without it

    folder = Path(path)
    meta_file = folder / TEACHER_META
    if not (folder / "config.json").exists() or not meta_file.exists():
        raise ConfigError(
            f"retriever.teacher.path={str(path)!r} holds no ragtrain teacher (config.json and "
            f"{TEACHER_META}): give the <output_dir>/teacher of a run that trained one, or leave it "
            "empty to train one in this run"
        )
    meta = json.loads(meta_file.read_text())
    mine = vocab_fingerprint(load_tokenizer(retriever))
    theirs = vocab_fingerprint(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    if theirs != mine or meta.get("vocab") != mine:
        raise ConfigError(
            f"retriever.teacher.path={str(path)!r} was built for another tokenizer (base model "
            f"{meta.get('base_model')!r}, vocabulary {theirs}) than retriever.model={retriever.model!r} "
            f"(vocabulary {mine}): train a teacher from the same base model"
        )
    return meta
