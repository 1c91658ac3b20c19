"""Gossip topologies (`sync.mixer.topology`): one class per file, named in ragtrain.config.sync.GOSSIP_TOPOLOGIES
(docs/adding-a-variant.md)."""
