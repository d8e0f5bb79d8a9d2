"""Medusa heads: K heads on the top feature guessing tokens 1..K ahead, their drafter and layout."""
