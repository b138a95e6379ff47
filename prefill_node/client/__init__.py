"""Clients of a running prefill server: gRPC clients, the remote Engine, their CLI flags."""
