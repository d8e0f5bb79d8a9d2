"""EAGLE-2 and EAGLE-3 heads: the models, the drafter that grows trees with them, their compiled step, layouts."""
