"""Generator stage: retrieval-augmented fine-tuning of a seq2seq / causal LM under DDP, scored by EM / F1.

Modules: config (typed config), prompt (template + question-safe truncation), model (architectures),
packaged (pip-packaged GGUF models, dequantised once into a cache), retrieval (Ray actor retrieval service /
per-worker copy), steps (the question data, each step's passages, prompts, EM / F1 evaluation: shared by the generator
and joint recipes), saved (the model folder: save / load), train (the TorchTrainer recipe), stage
(`run_generator_stage`, the pipeline's entry point); EM / F1 themselves are ragtrain/eval/qa_metrics.py.
Kept import-light: ragtrain.config imports ragtrain.config.generator.
"""
