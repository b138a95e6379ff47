"""The HTTP servers' listening socket: every accepted connection has Nagle off (TCP_NODELAY),
so a kept-alive request is not held for the client's delayed ACK (40 ms on Linux)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from prefill_node.openai_api.listener import tcp_listener


async def _accepted_nodelay(sock: socket.socket) -> int:
    """TCP_NODELAY of the connection asyncio accepts on ``sock`` (as uvicorn serves it)."""
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def on_connect(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=sock)
    host, port = sock.getsockname()[:2]
    _, writer = await asyncio.open_connection(host, port)
    try:
        return await asyncio.wait_for(accepted, 10)
    finally:
        writer.close()
        server.close()


def test_connections_accepted_on_the_listener_have_nagle_off():
    sock = tcp_listener("127.0.0.1", 0)
    sock.listen()
    assert asyncio.run(_accepted_nodelay(sock)) != 0


def test_a_protocol_0_socket_is_what_left_nagle_on():
    """Guard that the test above can fail: the socket the servers used before."""
    sock = socket.create_server(("127.0.0.1", 0))
    assert sock.proto == 0
    assert asyncio.run(_accepted_nodelay(sock)) == 0


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_listener_binds_ipv4_and_ipv6_any_port(host):
    try:
        sock = tcp_listener(host, 0)
    except OSError:
        pytest.skip(f"{host} is not configured here")
    with sock:
        assert sock.getsockname()[1] > 0 and sock.proto == socket.IPPROTO_TCP
