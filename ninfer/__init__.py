"""ninfer: inference engine and server for Qwen3.5/3.6/3.8 hybrid models loaded from GGUF."""

__version__ = "0.1.0"
