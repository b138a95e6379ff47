"""The engine boundary: what a caller exchanges with any prefill engine, and the Engine protocol."""
