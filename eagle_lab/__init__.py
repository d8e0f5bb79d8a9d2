"""eagle_lab: EAGLE-style speculative decoding (train draft heads, generate losslessly)."""

from eagle_lab.errors import EagleLabError

__all__ = ["EagleLabError"]
__version__ = "0.1.0"
