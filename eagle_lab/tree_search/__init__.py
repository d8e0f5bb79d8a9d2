"""Choosing what a round drafts: online.py is `tree=online` (each round the chain length, and the n-gram chain
tokens, expected to give the most tokens per ms, from a cost curve timed once per machine and this reply's
acceptance), costs.py what that timing runs on and depends on, tree_config.py the tree a user asks for
(TreeConfig), presets.py the named trees of conf/tree/ for code that needs several in one run. The batched
server's choice per batch size and temperature builds on this in eagle_lab/serving/batch_trees.py.
"""
