"""gRPC front of a pipeline: servicer and server, proto conversion, metrics, KV-event hub."""
