"""Parameter mixers: one class per file, named in ragtrain.config.sync.MIXERS (docs/adding-a-variant.md)."""
