"""TokenmillServer's shutdown signals (api/server.py) without a model: the first drains, the second aborts, and a
third stops the server without waiting for the connections that are still open."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time

import uvicorn
from starlette.types import Receive, Send

from tokenmill.api.guards import RequestGuard, ServingState
from tokenmill.api.server import TokenmillServer, listen
from tokenmill.tenants.tenancy import Tenancy


class IdleEngine:
    """An engine with nothing in flight, as the server's drain, abort and watchdog read it."""

    alive = True
    num_unfinished = 0

    def close(self) -> None:
        pass

    def abort_all(self) -> None:
        pass


def test_a_third_signal_stops_the_server_while_a_request_still_hangs() -> None:
    """A request let in that never ends (a handler stuck, say) holds the drain after the first signal and the abort
    after the second (it waits for in-flight requests to end); the third stops the server at once, without waiting
    for it or for its connection (the server runs without uvicorn's graceful timeout)."""
    arrived, release = threading.Event(), threading.Event()

    async def hang(scope: dict, receive: Receive, send: Send) -> None:
        arrived.set()
        while not release.is_set():
            await asyncio.sleep(0.02)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    state = ServingState()
    app = RequestGuard(hang, state, Tenancy(None), max_body_bytes=1024, max_json_depth=8)  # counts it in flight
    sockets = listen("127.0.0.1", 0)
    server = TokenmillServer(uvicorn.Config(app, lifespan="off", log_level="warning"), IdleEngine(), state,
                             shutdown_timeout=600, tenancy=Tenancy(None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    client = None
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        client = socket.create_connection(sockets[0].getsockname()[:2])
        client.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert arrived.wait(10)
        server.handle_exit(signal.SIGTERM, None)
        server.handle_exit(signal.SIGTERM, None)
        thread.join(0.5)
        assert thread.is_alive() and state.in_flight == 1  # two signals wait for the hanging request
        started = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)
        thread.join(5)
        assert not thread.is_alive() and time.monotonic() - started < 2
    finally:
        release.set()
        if client is not None:
            client.close()
        thread.join(10)
