"""ragtrain/runtime/errors.py: the narrowing helper the variants read their filled config keys through."""

from __future__ import annotations

import pytest

from ragtrain.config.sync import MixerConfig
from ragtrain.runtime.errors import filled


def test_filled_keeps_a_falsy_value_and_names_a_key_left_unset() -> None:
    assert filled(0, "sync.mixer.warmup_steps") == 0  # 0 / False are values, only None is unset
    assert filled(False, "sync.mixer.adaptive") is False
    with pytest.raises(ValueError, match=r"sync\.mixer\.period is unset"):
        filled(None, "sync.mixer.period")


def test_a_variants_keys_are_filled_with_its_registry_defaults() -> None:
    m = MixerConfig(kind="gossip")  # what filled() relies on: the typed config fills the keys the kind reads
    assert (filled(m.period, "p"), filled(m.topology, "t"), filled(m.mixing, "m")) == (1, "ring", 0.5)
