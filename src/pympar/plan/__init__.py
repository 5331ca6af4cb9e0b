"""The auto-parallel planner: which layout to run before spending machine time.

``cost`` is its cost model (the configuration layer: the trainer's ``--layout auto`` calls
``cost.choose``); ``cli`` is its command line, ``python -m pympar.plan``, which prints the
predictions and measures them.
"""
