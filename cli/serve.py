"""`nano serve MODEL`: the engine behind an OpenAI-compatible HTTP API (the app is server.py)."""
from __future__ import annotations

import os
import socket
import sys
from typing import Annotated

import typer

from nano.disagg import SplitLLM

from .console import UsageError, err, user_errors
from .options import EngineOptions, Model, engine_flags

API_KEY_ENV = "NANO_API_KEY"


@engine_flags()
def serve(
    model: Model,
    host: Annotated[str, typer.Option(metavar="ADDRESS", help="Address to listen on. The default is loopback only; "
                                                              "0.0.0.0 listens on every interface.")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="N", min=0, max=65535, help="TCP port (0: any free port).")] = 8000,
    api_key: Annotated[str | None, typer.Option(
        metavar="KEY", help=f"Require 'Authorization: Bearer KEY' on /v1/ routes (default: ${API_KEY_ENV}, if set)."
    )] = None,
    max_queue: Annotated[int, typer.Option(
        metavar="N", min=0, help="Requests that may wait beyond --max-running before new ones get 503.")] = 1024,
    *,
    engine: EngineOptions,
) -> None:
    """Serve the model over HTTP: /v1/completions and /v1/chat/completions (streamed or not), /v1/models, /health
    and /metrics. Requests from every client are batched together. See docs/serve.md."""
    import uvicorn

    from .server import Server

    with user_errors():
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        if api_key is not None and not api_key.strip():
            raise UsageError("--api-key is empty")
        check_port(host, port)
        engine.check()
        front = engine.build(model, progress=sys.stderr.isatty())
    try:
        server = Server(front, model, api_key, max_queue, engine.config.max_running)
        config = uvicorn.Config(server.app, host=host, port=port, log_level="warning", access_log=False)
        listener = uvicorn.Server(config)
        err.print(f"{front.label} · serving '{model}' on http://{host}:{port}/v1"
                  + (" · API key required" if api_key else ""), style="bold", markup=False)
        listener.run()
    finally:
        if isinstance(front, SplitLLM) or getattr(front, "group", None) is not None:
            front.close()


def check_port(host: str, port: int) -> None:
    """Fail before the model loads when the address cannot be bound (taken, or not this host's)."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as error:
        raise UsageError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
