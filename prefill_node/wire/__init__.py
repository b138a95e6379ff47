"""What crosses a process boundary: proto <-> engine conversion (``convert``,
``kv_convert``), the KV hand-off's engine <-> kv_transfer types (``kv_handoff``), and the
one two-way status table (``status``) that the server, the clients and the router all use."""
