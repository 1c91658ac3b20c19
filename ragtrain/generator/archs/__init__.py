"""Generator architectures (`generator.arch`): one class per file, named in
ragtrain.config.generator.GENERATOR_ARCHS (docs/adding-a-variant.md)."""
