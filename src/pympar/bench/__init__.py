"""``python -m pympar.bench``: nccl-tests-style collective microbenchmarks (see cli.py)."""
