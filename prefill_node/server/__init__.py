"""gRPC front of a pipeline: PrefillService servicer and server, clients, metrics, CLI glue."""
