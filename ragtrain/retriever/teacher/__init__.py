"""Distillation terms of a cross-encoder teacher (`retriever.teacher.loss`): one class per file, named in
ragtrain.config.retriever.TEACHER_LOSSES (docs/adding-a-variant.md)."""
