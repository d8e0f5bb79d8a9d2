"""A standalone draft LM sharing the target's tokenizer: its drafter and its compact storage."""
