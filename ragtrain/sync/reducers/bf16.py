"""`bf16`: torch's bf16 compress hook: 2 bytes per entry like fp16, with fp32's exponent range."""

from __future__ import annotations

import torch

from ragtrain.sync.reducers.fp16 import Fp16


class Bf16(Fp16):
    dtype = torch.bfloat16
    torch_hook = "bf16_compress_hook"
