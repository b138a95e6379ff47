"""The reference decode worker: receives a prompt's KV over NIXL and continues greedily."""
