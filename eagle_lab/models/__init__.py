"""The models decoding runs: the target (any Hugging Face causal LM, the embedded SmolLM2, tiny random ones for
tests), its devices, its linear layers (the row-stable CPU kernel at every weight precision), its attention,
prompts, and llama.cpp's converter and tools."""
