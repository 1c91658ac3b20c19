"""Raw documents -> passages: read (txt/md/html/jsonl/parquet), clean, chunk, and the generated docs_synthetic folder.

The reading, cleaning and chunking modules are pure Python (no Ray, no MLflow) and work one file / one document at
a time, so a Ray Data pipeline can map them; import the submodules directly (nothing is imported eagerly here).
`prepare.py` runs them on Ray Data into the passage store, `encode.py` encodes a store into vector files, and
`stream.py` does both as one Ray Data stream (read -> clean -> chunk -> encode -> write) for a run's zero-shot index.
"""
