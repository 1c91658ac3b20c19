"""Joint retriever-generator training: the losses that train the retriever from the generator's answer likelihoods
(losses.py) and those likelihoods for each (question, retrieved passage) pair (likelihood.py)."""
