"""Training a draft head (`python train.py`): the recipe in trainer.py (setup -> capture -> train -> export),
the conversations it reads (data.py, optionally rewritten by the target in regenerate.py), the target
features it captures (features.py, or the shared corpus of corpus.py), the loss and held-out metrics
(losses.py, with ttt.py's unrolled drafting for EAGLE-3), atomic checkpoints (checkpoint.py) and the head
card each export writes (drafters/card.py).
"""
