"""Post-hoc repair of embedding spaces: not sync strategies (nothing here runs while replicas train).

- `align`: map one encoder's vectors into another's space (orthogonal Procrustes or least squares, fitted on
  anchor passages both encoded), e.g. the stale zero-shot index onto the trained encoder (index.align_anchors).
- `distill`: train one student encoder to reproduce reference vectors, e.g. the replicas' consensus vectors after
  sync=vector_avg (index.distill_steps), so one encoder can serve what every replica together produced.
"""
