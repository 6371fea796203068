"""nanogpt-parity: train the same character-level nanoGPT in several frameworks and compare them."""

__version__ = "0.1.0"
