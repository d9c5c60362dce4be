"""The HTTP front door: an ASGI app (Starlette) served by uvicorn on the tokenizer manager's own
event loop, so that HTTP and ZMQ clients share one request path (docs/HTTP.md)."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixserve.http_server.bounded_head import BoundedHeadProtocol
from radixserve.http_server.front import Front, HttpError, error_response
from radixserve.http_server.native_api import NativeApi
from radixserve.http_server.openai_api import OpenAIApi
from radixserve.tokenizer_manager import request_log
from radixserve.tokenizer_manager.manager import TokenizerManager

logger = logging.getLogger("radixserve.http_server")

Handler = Callable[[Request], Awaitable[Response]]


def build_app(manager: TokenizerManager) -> Starlette:
    front = Front(manager)
    native = NativeApi(front)
    name = manager.args.served_model_name or manager.args.model
    openai = OpenAIApi(front, name, manager.context_len)
    # A generate's failure in the HTTP front itself (a body that does not decode, a wrong
    # model) is a request's failure that --log-requests logs, as the manager logs its own.
    logged = manager.args.log_requests
    routes = [
        Route("/generate", _errors(native.generate, logged), methods=["POST"]),
        Route("/health", _errors(native.health), methods=["GET"]),
        Route("/health_generate", _errors(native.health_generate), methods=["GET"]),
        Route("/get_model_info", _errors(native.model_info), methods=["GET"]),
        Route("/get_server_info", _errors(native.server_info), methods=["GET"]),
        # It changes state: POST only, which a link or an <img> cannot send.
        Route("/flush_cache", _errors(native.flush_cache), methods=["POST"]),
        Route("/metrics", _errors(native.metrics), methods=["GET"]),
        Route("/v1/models", _errors(openai.models), methods=["GET"]),
        Route("/v1/models/{model:path}", _errors(openai.model), methods=["GET"]),
        Route("/v1/completions", _errors(openai.completions, logged), methods=["POST"]),
        Route("/v1/chat/completions", _errors(openai.chat_completions, logged), methods=["POST"]),
    ]
    handlers = {404: _no_route, 405: _no_route}
    return Starlette(routes=routes, exception_handlers=handlers)


async def _no_route(request: Request, error: Exception) -> Response:
    """An unknown path or a wrong method, in OpenAI's error shape (not Starlette's text)."""
    status = getattr(error, "status_code", 404)
    code = "method_not_allowed" if status == 405 else "not_found"
    what = "no such method for" if status == 405 else "no such endpoint"
    return error_response(HttpError(code, f"{what}: {request.method} {request.url.path}"))


def _errors(handler: Handler, log_failures: bool = False) -> Handler:
    async def handle(request: Request) -> Response:
        try:
            return await handler(request)
        except HttpError as e:
            if log_failures and not e.relayed:
                request_log.failed(None, e.code, e.message)
            return error_response(e)
        finally:
            Front.release_body(request)  # refused before its generates were submitted

    return handle


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the process reports ready: a port in use fails the
    start, with the reason, rather than a server without its HTTP front."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"--http-port {port}: cannot bind {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class HttpServer(uvicorn.Server):
    """uvicorn on the running loop, quiet (no access log), logging through ours."""

    def __init__(self, manager: TokenizerManager, sock: socket.socket):
        config = uvicorn.Config(
            build_app(manager),
            http=BoundedHeadProtocol,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        super().__init__(config)
        self.sock = sock
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)

    async def run_on_loop(self) -> None:
        host, port = self.sock.getsockname()[:2]
        logger.info("HTTP server (OpenAI-compatible) on http://%s:%d", host, port)
        await self.serve(sockets=[self.sock])

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The process's own SIGTERM handler drains the server; uvicorn must not take it over.
        yield
