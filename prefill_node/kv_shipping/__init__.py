"""Per-stage KV hand-off to decode: the stage's shipper, wire conversion, its thread wrapper."""
