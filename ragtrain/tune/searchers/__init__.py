"""Search algorithms: one class per file, named in ragtrain.config.tune.TUNE_SEARCHERS (docs/adding-a-variant.md)."""
