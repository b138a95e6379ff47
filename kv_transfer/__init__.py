"""KV hand-off over NIXL: layout descriptors, prefill-side sender, decode-side receiver. Imports nothing from prefill_node."""
