"""Texts -> vectors: the encoder model (`model.py`: BiEncoder, tokenisation with prefixes, `encode_texts`) and the
classes every embedding goes through (`encoders.py`). Imports nothing above the config, the precision and the
console."""
