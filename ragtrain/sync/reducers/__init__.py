"""Gradient reducers: one class per file, named in ragtrain.config.sync.REDUCERS (docs/adding-a-variant.md)."""
