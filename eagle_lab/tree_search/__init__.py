"""Choosing draft tree shapes: auto.py is `tree=auto` (time this device and head, pick the fastest
shape), per_batch.py a tree per batch size for the batched server (`server.tree_per_batch`), and
presets.py reads the named trees of conf/tree/ for code that needs several in one run.
"""
