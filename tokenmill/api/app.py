"""The OpenAI-compatible HTTP app: its middleware, error mapping, lifespan and routes (api/endpoints/, one module
an endpoint).

Handlers never touch tensors; the engine's loop runs the model on its own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from tokenmill.api.endpoints import chat, completions, embeddings, lora, models, responses, status, usage
from tokenmill.api.errors import install_error_handlers
from tokenmill.api.guards import OPEN_ROUTES, RequestGuard, ServingState
from tokenmill.api.response_store import ResponseStore, open_store
from tokenmill.api.serving import Hosting
from tokenmill.api.ui import ui_routes
from tokenmill.config import ServerConfig
from tokenmill.engine.engine import Engine
from tokenmill.hosting.pool import ModelPool
from tokenmill.tenants.tenancy import Tenancy
from tokenmill.tenants.usage import UsageLedger

log = logging.getLogger(__name__)


def open_tenancy(config: ServerConfig, store: ResponseStore | None) -> Tenancy:
    """The tenants of --api-keys and --api-key, their usage kept in the Responses store's file (in memory without
    one); ConfigError naming the line of a mistake in the keys file."""
    path = Path(config.api_keys) if config.api_keys else None
    return Tenancy(path, config.api_key, UsageLedger(store.path if store is not None else None))


async def _tend(tenancy: Tenancy) -> None:
    """Twice a second: re-read the keys file if it changed; once a second: write the usage out."""
    ticks = 0
    while True:
        await asyncio.sleep(0.5)
        ticks += 1
        try:
            tenancy.reload_if_changed()
            if ticks % 2 == 0:
                await asyncio.to_thread(tenancy.ledger.flush)
        except Exception:  # never the end of the task: the next tick tries again
            log.exception("tending the keys and usage failed")


def create_app(hosted: Engine | ModelPool, model_id: str | None = None, aliases: set[str] | None = None,
               config: ServerConfig | None = None, state: ServingState | None = None,
               store: ResponseStore | None = None, tenancy: Tenancy | None = None) -> FastAPI:
    """hosted: the models, or one engine served as model_id (and its aliases); `state` is shared with the
    server, which sets it draining on SIGTERM; `store`: the Responses store the CLI opened before the model loaded
    (None: the one the config names, opened here); `tenancy`: the tenants the CLI read (None: the config's)."""
    config = config or ServerConfig()
    config.check()
    pool = hosted if isinstance(hosted, ModelPool) else ModelPool.of_engine(hosted, model_id or "", aliases or set())
    state = state or ServingState()
    store = store if store is not None else open_store(config)
    tenancy = tenancy or open_tenancy(config, store)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        tending = asyncio.create_task(_tend(tenancy))
        yield
        tending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tending
        await pool.stop()
        tenancy.ledger.close()
        if store is not None:
            store.close()

    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.state.hosting = Hosting(pool, config, state, store, tenancy)
    pages, page_paths = ui_routes() if config.ui else (None, set())
    app.add_middleware(RequestGuard, state=state, tenancy=tenancy, max_body_bytes=config.max_request_bytes,
                       max_json_depth=config.max_json_depth, open_routes=frozenset(OPEN_ROUTES | page_paths))
    if config.allowed_origins:  # outermost, so preflight requests are answered before the API key is asked
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    install_error_handlers(app)
    for endpoint in (status, models, chat, completions, responses, embeddings, lora, usage):
        app.include_router(endpoint.router)
    if pages is not None:
        app.include_router(pages)
    return app
