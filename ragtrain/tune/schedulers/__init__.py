"""Trial schedulers: one class per file, named in ragtrain.config.tune.TUNE_SCHEDULERS (docs/adding-a-variant.md)."""
