"""`seq2seq`: any AutoModelForSeq2SeqLM (T5-style); generator.model=tiny builds a small T5 from a config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ragtrain.config.generator import GeneratorConfig
from ragtrain.generator.archs.base import EncoderDecoder, end_of_answer, pretrained

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Seq2Seq(EncoderDecoder):
    hf_class = "AutoModelForSeq2SeqLM"

    def build(self, g: GeneratorConfig, tok: Any) -> PreTrainedModel:
        if g.model != "tiny":
            return pretrained(g, self.hf_class)
        from transformers import T5Config, T5ForConditionalGeneration  # lazy: transformers is heavy (~1 s)

        t, p = g.tiny, 0.1 if g.dropout is None else g.dropout
        cfg = T5Config(
            vocab_size=len(tok),
            d_model=t.d_model,
            d_kv=t.d_model // t.num_heads,
            d_ff=t.d_ff,
            num_layers=t.num_layers,
            num_decoder_layers=t.num_layers,
            num_heads=t.num_heads,
            dropout_rate=p,
            pad_token_id=tok.pad_token_id,
            eos_token_id=end_of_answer(tok),
            decoder_start_token_id=tok.pad_token_id,
        )
        return T5ForConditionalGeneration(cfg)

    def mismatch(self, g: GeneratorConfig, hf_config: Any) -> str | None:
        # lazy: transformers is heavy (~1 s); this module imports without it
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

        return None if hf_config.model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES else "a seq2seq LM"
