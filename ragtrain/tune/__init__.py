"""Ray Tune sweeps over ragtrain configs (`python -m ragtrain experiment=NAME tune=NAME`): see sweep.py."""
