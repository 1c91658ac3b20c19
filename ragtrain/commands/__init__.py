"""What a user runs: `python -m ragtrain COMMAND ARGS...` for COMMAND in search.py, ask.py, paired.py and
compare.py (each module's `main(ARGS)`), and variants.py, which `python -m ragtrain experiment=NAME` runs for a set of
variants (compare.strategies / compare.variants) and compares as paired.py does. Above the pipeline: they read
finished runs (their folders, their MLflow records), or start runs through ragtrain/pipeline/."""
