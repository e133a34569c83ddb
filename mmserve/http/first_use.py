"""What a fresh server's first requests would otherwise do once each, done at start-up instead (before /health says
ready): imports that libraries make on first use, on the event loop or in the request threads, and the compile of
the chat template. Each is milliseconds to tens of milliseconds on an idle host and more on a loaded one, paid by
the first requests and, for the imports on the event loop, by every request in flight beside them."""

from __future__ import annotations

import importlib

from fastapi import FastAPI
from PIL import Image


def warm_first_use(app: FastAPI) -> None:
    """`app`: build_app's. Call it before the server listens."""
    # Starlette runs every streaming response in an anyio task group; anyio imports its asyncio backend (and its
    # streams and sockets modules) on the first one, on the event loop.
    importlib.import_module("anyio._backends._asyncio")
    # The first image's header read (prep.multimodal.image_io.open_header) imports PIL's common format plugins.
    Image.preinit()
    # transformers compiles a chat template on its first render and keeps it (by its text) for the next ones.
    app.state.openai_serving.warm_chat_template()
