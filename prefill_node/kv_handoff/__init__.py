"""Per-stage KV hand-off to decode: its settings and the one object each stage owns over
its NIXL sender (stage_handoff.py)."""
