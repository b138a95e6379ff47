"""WavePP prefill node: one pipeline of stage processes with paged KV and prefix reuse."""

__version__ = "0.1.0"
