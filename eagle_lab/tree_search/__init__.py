"""Choosing draft tree shapes: auto.py is `tree=auto` (time this device and head, pick the fastest
shape) from costs.py (measuring costs), replay.py (recording a run and replaying shapes on it),
validate.py (timing candidates in the decoding loop) and space.py (what is searched); presets.py
reads the named trees of conf/tree/ for code that needs several in one run. The batched server's
tree per batch size and temperature builds on this in eagle_lab/serving/batch_trees.py.
"""
