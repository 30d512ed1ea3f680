"""uvicorn, with the shutdown a server needs: SIGTERM drains, and a dead engine ends the process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Coroutine
from types import FrameType
from typing import Any

import uvicorn

from tokenmill.api.app import create_app
from tokenmill.api.guards import ServingState
from tokenmill.api.response_store import ResponseStore
from tokenmill.config import ServerConfig
from tokenmill.engine.engine import Engine
from tokenmill.errors import ConfigError
from tokenmill.hosting.pool import ModelPool
from tokenmill.tenants.tenancy import Tenancy

log = logging.getLogger(__name__)


def listen(host: str, port: int, backlog: int = 2048) -> list[socket.socket]:
    """Sockets listening on host:port, for uvicorn's `sockets`: bound before the model loads, so that a busy port or
    a host that is not this machine's is said at once, in one line. One socket per address the host resolves to
    ("localhost" may be ::1 and 127.0.0.1; "" all interfaces), IPv6 ones IPv6-only, as asyncio binds a host itself.
    They listen at once: a port is only taken once a socket listens on it (SO_REUSEADDR lets two merely bind it);
    a client that connects while the model loads waits in the backlog."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: {exc.strerror}") from exc
    sockets: list[socket.socket] = []
    for family, kind, proto, _, address in dict.fromkeys(infos):
        sock = socket.socket(family, kind, proto)
        sockets.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(address)
            sock.listen(backlog)
        except OSError as exc:
            for opened in sockets:
                opened.close()
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sockets


class TokenmillServer(uvicorn.Server):
    """On SIGTERM or SIGINT: new requests get 503 (`state.draining`), in-flight ones may finish for
    `shutdown_timeout` seconds, the rest end with finish_reason "abort", then the server stops and run() returns;
    `exit_code` is 0. A second signal aborts them at once (their streams still end properly), a third stops without
    waiting for that. If the engine thread dies, the server stops with exit_code 1 rather than answer 503 forever."""

    def __init__(self, config: uvicorn.Config, pool: ModelPool, state: ServingState, shutdown_timeout: float,
                 tenancy: Tenancy) -> None:
        super().__init__(config)
        self.pool = pool
        self.tenancy = tenancy
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self._signals = 0  # counted as they come, not as the tasks they start run
        self._aborting = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        self._spawn(self._watch_engine())
        with contextlib.suppress(ValueError, NotImplementedError, RuntimeError):  # not the main thread (tests)
            self._loop.add_signal_handler(signal.SIGHUP, self.tenancy.reload)  # SIGHUP: re-read the keys file

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded as uvicorn records it: it would re-raise the signal after the shutdown, and the process
        # would die of it instead of exiting 0.
        self._signals += 1
        if self._loop is None or self._signals > 2:  # before start-up, or a third signal: stop, not waiting
            self.force_exit = self.should_exit or self._signals > 2
            self.should_exit = True
        elif self._signals == 2:
            self._loop.call_soon_threadsafe(lambda: self._spawn(self._abort()))
        else:
            self.state.draining = True
            self._loop.call_soon_threadsafe(lambda: self._spawn(self._drain()))

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        log.info("shutting down: %d requests and %d sequences in flight get %.0fs to finish", self.state.in_flight,
                 self.pool.num_unfinished, self.shutdown_timeout)
        while self._in_flight() and time.monotonic() < deadline and not self._aborting:
            await asyncio.sleep(0.05)
        await self._abort()

    def _in_flight(self) -> bool:
        """Whether a request let in or a sequence of the engine's has not finished yet."""
        return bool(self.state.in_flight or self.pool.num_unfinished)

    async def _abort(self) -> None:
        """Abort what is still in flight (a request still arriving or rendering then gets 503 from the closed
        engine), let the last chunks go out, then stop."""
        if self._aborting:
            return
        self._aborting = True
        self.pool.close()
        if self.pool.num_unfinished:
            log.warning("aborting %d unfinished sequences", self.pool.num_unfinished)
            self.pool.abort_all()
        for _ in range(100):  # their last chunks (and the late requests' 503s) go out before the connections close
            if not self._in_flight():
                break
            await asyncio.sleep(0.05)
        self.should_exit = True

    async def _watch_engine(self) -> None:
        while not self.should_exit:
            if dead := self.pool.dead():
                log.error("the engine loop of %s has died; stopping the server", ", ".join(dead))
                self.state.draining = True
                self.exit_code = 1
                self.should_exit = True
                return
            await asyncio.sleep(0.2)


def build_server(models: Engine | ModelPool, config: ServerConfig, model_id: str | None = None,
                 aliases: set[str] | None = None, store: ResponseStore | None = None,
                 tenancy: Tenancy | None = None, graceful_timeout: int | None = None) -> TokenmillServer:
    """The one way a server is made, by `tokenmill serve`, `tokenmill chat` and the tests alike: the app over the
    models (api/app.py; one engine is served as model_id) in uvicorn, with tokenmill's shutdown. Run it with the
    sockets of listen(); store: the Responses store the caller opened (None: the one config names); tenancy: the
    tenants the caller read (None: the config's);
    graceful_timeout: uvicorn's own bound on closing connections once the requests are done."""
    state = ServingState()
    app = create_app(models, model_id, aliases, config, state, store, tenancy)
    hosting = app.state.hosting
    return TokenmillServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                          timeout_graceful_shutdown=graceful_timeout),
                           hosting.pool, state, config.shutdown_timeout, hosting.tenancy)
