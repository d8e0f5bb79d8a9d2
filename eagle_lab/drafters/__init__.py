"""Drafters: each proposes a token tree after the committed sequence for the one verifier.

  eagle/        EAGLE-2 / EAGLE-3 heads, their drafter and compiled step, published layouts
  medusa/       Medusa heads, their drafter and the Medusa project's layout
  draft_model/  a standalone draft LM and its storage without what it shares with the target
  ngram.py      prompt lookup (alone, or merged into EAGLE trees)
  growth.py     tree shapes and EAGLE-2's dynamic growth, shared by the tree drafters
  card.py       a trained head's card
"""
