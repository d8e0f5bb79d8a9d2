"""Choosing draft tree shapes: auto.py is `tree=auto` (time this device and head, pick the fastest
shape) from costs.py (measuring costs), replay.py (recording a run and replaying shapes on it) and
validate.py (timing candidates in the decoding loop), per_batch.py a tree per batch size for the
batched server (`server.tree_per_batch`), and presets.py reads the named trees of conf/tree/ for
code that needs several in one run.
"""
