"""Joint retriever-generator training: the losses that train the retriever from the generator's answer likelihoods
(losses.py) and those likelihoods for each (question, retrieved passage) pair (likelihood.py)."""

# Where the joint stage leaves both models in a run folder (stage.py), read by export and ask: kept here, import-light
JOINT_DIR = "joint"  # <output_dir>/joint
ENCODER_FILE = "encoder.safetensors"  # the jointly trained encoder, in JOINT_DIR
GENERATOR_FOLDER = "generator"  # the jointly trained generator as an HF model folder, in JOINT_DIR
