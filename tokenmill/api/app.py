"""The OpenAI-compatible HTTP app: its middleware, error mapping, lifespan and routes (api/endpoints/, one module
an endpoint).

Handlers never touch tensors; the engine's loop runs the model on its own thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from tokenmill.api.endpoints import chat, completions, embeddings, lora, models, responses, status
from tokenmill.api.errors import install_error_handlers
from tokenmill.api.guards import OPEN_ROUTES, RequestGuard, ServingState
from tokenmill.api.response_store import ResponseStore, open_store
from tokenmill.api.serving import Hosting
from tokenmill.api.ui import ui_routes
from tokenmill.config import ServerConfig
from tokenmill.engine.engine import Engine
from tokenmill.hosting.pool import ModelPool


def create_app(hosted: Engine | ModelPool, model_id: str | None = None, aliases: set[str] | None = None,
               config: ServerConfig | None = None, state: ServingState | None = None,
               store: ResponseStore | None = None) -> FastAPI:
    """hosted: the models, or one engine served as model_id (and its aliases); `state` is shared with the
    server, which sets it draining on SIGTERM; `store`: the Responses store the CLI opened before the model loaded
    (None: the one the config names, opened here)."""
    config = config or ServerConfig()
    config.check()
    pool = hosted if isinstance(hosted, ModelPool) else ModelPool.of_engine(hosted, model_id or "", aliases or set())
    state = state or ServingState()
    store = store if store is not None else open_store(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        yield
        await pool.stop()
        if store is not None:
            store.close()

    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.state.hosting = Hosting(pool, config, state, store)
    pages, page_paths = ui_routes() if config.ui else (None, set())
    app.add_middleware(RequestGuard, state=state, api_keys=config.api_key, max_body_bytes=config.max_request_bytes,
                       max_json_depth=config.max_json_depth, open_routes=frozenset(OPEN_ROUTES | page_paths))
    if config.allowed_origins:  # outermost, so preflight requests are answered before the API key is asked
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    install_error_handlers(app)
    for endpoint in (status, models, chat, completions, responses, embeddings, lora):
        app.include_router(endpoint.router)
    if pages is not None:
        app.include_router(pages)
    return app
