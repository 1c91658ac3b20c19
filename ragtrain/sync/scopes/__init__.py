"""Scopes: which ranks a reducer or a mixer spans; one class per file, named in ragtrain.config.sync's
REDUCER_SCOPES and MIXER_SCOPES (docs/adding-a-variant.md)."""
