"""``vt serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

    >>> import vt
    >>> from vt.frontends.server import Server
    >>> llm = vt.LLM(max_slots=8)
    >>> Server(llm, port=8000).run()   # until Ctrl-C; then llm.close()

See ``docs/server.md`` for the endpoints and the design.
"""

from __future__ import annotations

from .app import ApiError, Limits, ServerState, create_app
from .engine_loop import (
    Delivery,
    EngineLoop,
    EngineStats,
    Prompt,
    QueueFull,
    ShuttingDown,
    TooManyPrompts,
)
from .serve import Server, bind, default_model_name

__all__ = [
    "ApiError",
    "Delivery",
    "EngineLoop",
    "EngineStats",
    "Limits",
    "Prompt",
    "QueueFull",
    "Server",
    "ServerState",
    "ShuttingDown",
    "TooManyPrompts",
    "bind",
    "create_app",
    "default_model_name",
]
