"""`causal`: any AutoModelForCausalLM (decoder-only): prompt + answer in one sequence, the loss on the answer only;
generator.model=tiny builds a small GPT-2 from a config, a packaged model (PACKAGED) loads its GGUF file."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ragtrain.config.generator import GeneratorConfig
from ragtrain.generator.archs.base import end_of_answer, load_saved, pretrained

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Causal:
    causal = True
    hf_class = "AutoModelForCausalLM"
    pipeline_tag = "text-generation"
    warm_start: str | None = None

    def load(self, folder: str) -> PreTrainedModel:
        return load_saved(self.hf_class, folder)

    def build(self, g: GeneratorConfig, tok: Any) -> PreTrainedModel:
        if g.model != "tiny":
            return pretrained(g, self.hf_class)
        from transformers import GPT2Config, GPT2LMHeadModel  # lazy: transformers is heavy (~1 s)

        t, p = g.tiny, 0.1 if g.dropout is None else g.dropout
        cfg = GPT2Config(
            vocab_size=len(tok),
            n_embd=t.d_model,
            n_layer=t.num_layers,
            n_head=t.num_heads,
            n_inner=t.d_ff,
            n_positions=max(512, g.max_source_length + g.max_target_length),
            resid_pdrop=p,
            embd_pdrop=p,
            attn_pdrop=p,
            bos_token_id=tok.cls_token_id,
            eos_token_id=end_of_answer(tok),
            pad_token_id=tok.pad_token_id,
        )
        return GPT2LMHeadModel(cfg)

    def mismatch(self, g: GeneratorConfig, hf_config: Any) -> str | None:
        # lazy: transformers is heavy (~1 s); this module imports without it
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_MASKED_LM_MAPPING_NAMES,
            MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        )

        t = hf_config.model_type
        # BERT and its kin are in transformers' causal-LM table too (as decoders), but a checkpoint saved as an
        # encoder attends to later tokens: trained as a causal LM it copies the answer and generates nothing
        encoder_only = (
            t in MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and t not in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
            and not getattr(hf_config, "is_decoder", False)
        )
        if encoder_only:
            return "a decoder-only causal LM (this checkpoint is an encoder, which attends to later tokens)"
        return None if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else "a causal LM"

    def positions(self, g: GeneratorConfig) -> tuple[int, str]:
        # prompt and answer are one sequence
        need = g.max_source_length + g.max_target_length
        return need, "generator.max_source_length + generator.max_target_length"

    def collate(
        self, sources: Sequence[list[int]], targets: Sequence[list[int]], pad_id: int, for_generation: bool = False
    ) -> dict[str, torch.Tensor]:
        """Prompt + target in one sequence with -100 over the prompt (right-padded), or the prompt alone
        left-padded for generation."""
        seqs = list(sources) if for_generation else [s + t for s, t in zip(sources, targets)]
        n = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), n), dtype=torch.long)
        labels = torch.full((len(seqs), n), -100, dtype=torch.long)
        for i, s in enumerate(seqs):
            if for_generation:  # left padding: the next token follows the prompt's last token directly
                ids[i, n - len(s) :], mask[i, n - len(s) :] = torch.tensor(s), 1
            else:
                ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
                labels[i, len(sources[i]) : len(s)] = torch.tensor(targets[i])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def logits(self, model: Any, input_ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> tuple:
        target = labels[:, 1:]  # labels already hold -100 over the prompt; predict token t+1 from t
        if model.keeps_logits:
            # Only the positions that predict a target token (in any row) go through the LM head: over a
            # whole prompt, SmolLM2's 49k x 576 head is a fifth of the step and its fp32 logits hundreds of MB.
            keep = (target >= 0).any(dim=0).nonzero().flatten()
            logits = model.hf(input_ids=input_ids, attention_mask=mask, logits_to_keep=keep).logits
            return logits, target[:, keep]
        return model.hf(input_ids=input_ids, attention_mask=mask).logits[:, :-1], target

    def prompt_length(self, input_ids: torch.Tensor) -> int:
        return input_ids.shape[1]  # decoder-only output repeats the (left-padded) prompt first

    def generate_kwargs(self, start_id: int) -> dict[str, Any]:
        return {"decoder_start_token_id": None}
