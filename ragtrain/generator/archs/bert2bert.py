"""`bert2bert`: transformers' EncoderDecoderModel with both sides from one BERT checkpoint (Rothe et al. 2020)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ragtrain.config.generator import GeneratorConfig
from ragtrain.generator.archs.base import EncoderDecoder, resolve_path, set_dropout

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Bert2Bert(EncoderDecoder):
    hf_class = "EncoderDecoderModel"
    warm_start = "BERT2BERT encoder-decoder"

    def build(self, g: GeneratorConfig, tok: Any) -> PreTrainedModel:
        # lazy: transformers is heavy (~1 s); this module imports without it
        from transformers import BertConfig, BertLMHeadModel, BertModel, EncoderDecoderModel

        path = resolve_path(g.model)
        enc_cfg = BertConfig.from_pretrained(path)
        if enc_cfg.model_type != "bert":
            raise ValueError(f"generator.arch=bert2bert needs a BERT checkpoint, {path} is {enc_cfg.model_type!r}")
        if g.bert2bert("encoder_layers"):
            enc_cfg.num_hidden_layers = min(g.bert2bert("encoder_layers"), enc_cfg.num_hidden_layers)
        set_dropout(enc_cfg, g.dropout)
        encoder = BertModel.from_pretrained(path, config=enc_cfg, add_pooling_layer=False)  # no pooler: DDP-unused
        dec_cfg = BertConfig.from_pretrained(path, is_decoder=True, add_cross_attention=True)
        # A shallow decoder: answers are a few tokens copied from the source, so depth buys little and costs time.
        dec_cfg.num_hidden_layers = min(g.bert2bert("decoder_layers"), dec_cfg.num_hidden_layers)
        set_dropout(dec_cfg, g.dropout)
        decoder = BertLMHeadModel.from_pretrained(path, config=dec_cfg)  # cross-attention: new, seeded init
        # pretrained Q/K/V/output instead of noise: the new block starts useful
        if g.bert2bert("cross_attention_init") == "self":
            for layer in decoder.bert.encoder.layer:
                layer.crossattention.load_state_dict(layer.attention.state_dict())
        # one 30k x d matrix for encoder input, decoder input and output: fewer params to sync
        if g.bert2bert("tie_embeddings"):
            decoder.bert.embeddings.word_embeddings = encoder.embeddings.word_embeddings
            decoder.cls.predictions.decoder.weight = encoder.embeddings.word_embeddings.weight
        model = EncoderDecoderModel(encoder=encoder, decoder=decoder)
        model.config.decoder_start_token_id = tok.cls_token_id
        model.config.pad_token_id = tok.pad_token_id
        model.config.eos_token_id = tok.sep_token_id
        return model

    def load(self, folder: str) -> PreTrainedModel:
        """As `build` made it: a BERT encoder without a pooler, which the decoder never reads (it cross-attends to
        the hidden states) and the saved weights lack. Plain EncoderDecoderModel builds one and reports its weights
        as missing and newly initialised, a load report a user can do nothing about."""
        # lazy: transformers is heavy (~1 s); this module imports without it
        from transformers import BertModel, EncoderDecoderModel

        class PoolerFreeBert2Bert(EncoderDecoderModel):
            def __init__(self, config, encoder=None, decoder=None):
                encoder = encoder if encoder is not None else BertModel(config.encoder, add_pooling_layer=False)
                super().__init__(config, encoder=encoder, decoder=decoder)

        return PoolerFreeBert2Bert.from_pretrained(folder)

    def mismatch(self, g: GeneratorConfig, hf_config: Any) -> str | None:
        return None if hf_config.model_type == "bert" else "a BERT checkpoint"
