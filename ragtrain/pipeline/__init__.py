"""One run of `python -m ragtrain experiment=NAME`: the stage runner (`stages.py`: data, the configured stages in
order, the run folder's status, resume), the run's view of its index (`retrieval.py`: build, search, evaluate, mine,
live refresh, from the root config) and the hand-over of its models (`export.py`). Above every stage's package, below
the commands that read a finished run."""
