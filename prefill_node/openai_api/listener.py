"""The listening socket of an HTTP server (gateway, decode server): Nagle off on every
connection it accepts.

asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose protocol number is
IPPROTO_TCP, and a socket made with ``socket.socket(family)`` or ``socket.create_server``
has protocol 0, which accepted connections inherit. uvicorn then answers a kept-alive
request in two writes (head, body) and the second waits for the client's delayed ACK: 40 ms
more per request on Linux, for every client that keeps its connection (the openai SDK,
vllm bench serve). Naming the protocol here is what makes asyncio set TCP_NODELAY.
"""

from __future__ import annotations

import socket


def tcp_listener(host: str, port: int) -> socket.socket:
    """A bound TCP socket on ``host:port`` (0: any free port) for uvicorn's ``sockets=``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock
