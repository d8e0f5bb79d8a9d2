"""The decoding core: the target's KV cache, scoring a round's tokens in one forward (eager or
compiled), and the round itself (draft -> score -> verify -> commit)."""
