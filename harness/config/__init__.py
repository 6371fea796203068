"""Configs: the Config type, the size presets and nanoGPT's recipes, and the one front door that reads them."""
