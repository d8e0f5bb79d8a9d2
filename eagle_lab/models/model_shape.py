"""The sizes of a target that a head is built from, read from its transformers config."""

from __future__ import annotations


class ModelShape:
    """Sizes read from a transformers config (`self.config`): all a head needs to be built."""

    config: object

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def model_type(self) -> str:
        return self.config.model_type
