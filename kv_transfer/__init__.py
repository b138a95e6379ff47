"""KV hand-off over NIXL: layouts, prefill-side sender, decode-side receiver (no prefill_node)."""
