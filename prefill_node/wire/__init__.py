"""The gRPC wire: proto <-> engine conversion (``convert``, ``kv_convert``) and the one
two-way status table (``status``) that the server, the clients and the router all use."""
