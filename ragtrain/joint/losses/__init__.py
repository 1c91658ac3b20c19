"""Joint losses (`joint.loss`): one class per file, named in ragtrain.config.joint.JOINT_LOSSES
(docs/adding-a-variant.md)."""
