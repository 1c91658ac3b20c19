"""Data sources (`data.source`): one loader class per file, named in ragtrain.config.data.DATA_SOURCES
(docs/adding-a-variant.md)."""
