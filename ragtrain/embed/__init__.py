"""Texts -> vectors: the encoder model (`model.py`: BiEncoder, tokenisation with prefixes, `encode_texts`), the
classes every embedding goes through (`encoders.py`) and the floating-point precision a model runs in
(`precision.py`, which the index, the recipes and the generator resolve through too). Imports nothing above the
config and the runtime."""
