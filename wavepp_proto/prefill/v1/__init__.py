"""Version 1 of the prefill API, the KV hand-off contracts and the KV-event stream."""
