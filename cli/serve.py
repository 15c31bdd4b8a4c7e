"""`nano serve MODEL`: the engine behind an OpenAI-compatible HTTP API (the app is server.py)."""
from __future__ import annotations

import os
import resource
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from nano.errors import NanoError
from nano.settings import parse_bytes

from .console import UsageError, err, user_errors, warn
from .options import EngineOptions, Model, engine_flags

API_KEY_ENV = "NANO_API_KEY"
SPARE_DESCRIPTORS = 64   # what the process needs beside its connections: model files, pipes, the split's sockets


@engine_flags()
def serve(
    model: Model,
    host: Annotated[str, typer.Option(metavar="ADDRESS", help="Address to listen on. The default is loopback only; "
                                                              "0.0.0.0 listens on every interface.")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="N", min=0, max=65535, help="TCP port (0: any free port).")] = 8000,
    api_key: Annotated[str | None, typer.Option(
        metavar="KEY", help=f"Require 'Authorization: Bearer KEY' on /v1/ routes. A key typed here is readable by "
                            f"other local users (ps, /proc): prefer ${API_KEY_ENV} or --api-key-file.")] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Read the API key from FILE (its first line).")] = None,
    max_queue: Annotated[int, typer.Option(
        metavar="N", min=0, help="Requests that may wait beyond --max-running before new ones get 503.")] = 1024,
    header_timeout: Annotated[float, typer.Option(
        metavar="S", min=0.1, help="Seconds a client has to send a complete request head, from connecting or from "
                                   "its last response; then the connection is closed.")] = 10.0,
    body_timeout: Annotated[float, typer.Option(
        metavar="S", min=0.1, help="Seconds a client has to send a request body, after its head (else 408).")] = 30.0,
    max_body: Annotated[str, typer.Option(
        metavar="SIZE", help="Largest request body, e.g. 8MiB (else 413).")] = "8MiB",
    max_connections: Annotated[int, typer.Option(
        metavar="N", min=1, help="Open connections at most; one more is answered 503 and closed.")] = 512,
    shutdown_timeout: Annotated[float, typer.Option(
        metavar="S", min=0, help="On Ctrl-C, seconds to let requests in flight finish before they are cut.")] = 5.0,
    access_log: Annotated[bool, typer.Option(
        "--access-log/--no-access-log", help="One line per request on stderr: client, method and path, status, "
                                             "seconds, and a completion's tokens and finish reason.")] = True,
    *,
    engine: EngineOptions,
) -> None:
    """Serve the model over HTTP: /v1/completions and /v1/chat/completions (streamed or not), /v1/models, /health
    and /metrics. Requests from every client are batched together. See docs/serve.md."""
    with user_errors():
        api_key = resolve_api_key(api_key, api_key_file)
        try:
            body_bytes = parse_bytes(max_body)
        except NanoError as error:
            raise UsageError(f"--max-body: {error}") from None
        engine.check(model)
        sock = listen(host, port)
        raise_descriptor_limit(max_connections)
        import uvicorn   # the server and the engine (torch): once the command line is checked

        from nano.disagg import SplitLLM

        from .server import HttpLimits, Server
        limits = HttpLimits(header_timeout, body_timeout, body_bytes, max_connections, shutdown_timeout)
        front = engine.build(model, progress=sys.stderr.isatty())
    try:
        server = Server(front, model, api_key, max_queue, engine.config.max_running, limits, access_log)
        listener = uvicorn.Server(server.uvicorn_config())
        address = f"[{host}]" if ":" in host else host
        err.print(f"{front.label} · serving '{model}' on http://{address}:{sock.getsockname()[1]}/v1"
                  + (" · API key required" if api_key else ""), style="bold", markup=False)
        listener.run(sockets=[sock])
    finally:
        if isinstance(front, SplitLLM) or getattr(front, "group", None) is not None:
            front.close()


def resolve_api_key(typed: str | None, file: Path | None) -> str | None:
    """The key from --api-key (with a warning: argv is public), --api-key-file (its first line) or $NANO_API_KEY."""
    if typed is not None and file is not None:
        raise UsageError("--api-key and --api-key-file: give one")
    if file is not None:
        try:
            with file.open(encoding="utf-8") as lines:
                key = lines.readline(4096).strip()
        except (OSError, UnicodeDecodeError) as error:
            raise NanoError(f"cannot read the API key from {file}: {getattr(error, 'strerror', None) or error}"
                            ) from None
        if not key:
            raise NanoError(f"{file} holds no API key (its first line is empty)")
        return key
    if typed is not None:
        warn(f"--api-key on the command line is readable by other local users; use ${API_KEY_ENV} or --api-key-file")
    key = typed if typed is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and not key.strip():
        raise UsageError("--api-key is empty" if typed is not None else f"${API_KEY_ENV} is empty")
    return key


def raise_descriptor_limit(max_connections: int) -> None:
    """Each connection holds a descriptor: raise the soft limit to the hard one, and warn when even that leaves
    less than --max-connections needs (the OS would refuse clients first, with accept errors)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:   # (unlimited reads -1: an unlimited hard limit is left alone)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    if 0 <= soft < max_connections + SPARE_DESCRIPTORS:
        warn(f"--max-connections {max_connections} needs about {max_connections + SPARE_DESCRIPTORS} file "
             f"descriptors and this process may open {soft}: lower it, or raise the limit (ulimit -n)")


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads and held until the server ends: an address that
    cannot be bound (taken, or not this host's) fails at once, with exit code 1 (the machine's state, not the
    command line), and no other process can take the port while the model loads."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn: no wait for a closed one's TIME_WAIT
        sock.bind((host, port))
        sock.listen()   # (a bound socket that does not listen holds no port against another SO_REUSEADDR one)
    except OSError as error:
        sock.close()
        raise NanoError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock
