"""A tiny Llama causal LM with a byte-level BPE tokenizer and a ChatML chat template (SmolLM2's layout), built from
a config and saved as an HF folder: the mechanics of generator=smollm2 without its 98 MB package."""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou answer questions.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = [
    "which team won super bowl 50? the denver broncos won super bowl 50.",
    "where is warsaw? warsaw is the capital of poland.",
    "question: answer: passage: you answer questions. system user assistant",
]


def tokenizer():
    """Byte-level BPE (GPT-2 / SmolLM style: no [CLS] / [SEP]), <|im_end|> as EOS and padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    t.train_from_iterator(TEXTS * 4, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=t, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    tok.chat_template = CHATML
    return tok


def save_tiny_llama(folder: Path, seed: int = 0, chat: bool = True) -> Path:
    """A 2-layer Llama (hidden 32) + its tokenizer in `folder` (loads with AutoModelForCausalLM/AutoTokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    if not chat:
        tok.chat_template = None
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder
