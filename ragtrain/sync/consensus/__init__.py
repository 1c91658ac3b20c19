"""End-of-training consensus rules (`sync.consensus`): one class per file, named in ragtrain.config.sync.CONSENSUS
(docs/adding-a-variant.md)."""
