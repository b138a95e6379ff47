"""Cluster router: global prefix index from KV events, pipeline scoring, gRPC proxy."""
