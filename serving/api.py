"""The HTTP API (FastAPI) over one replica's Service: OpenAI-compatible completions and chat completions
(JSON or server-sent events), models, health, Prometheus metrics, and admin endpoints.

    POST /v1/completions, /v1/chat/completions    see serving/protocol.py for fields and defaults
    GET  /v1/models                              the served model
    GET  /health                                 200 {"status": "ok", draft_version, ...}; 503 when the
                                                 engine cannot decode
    GET  /metrics                                Prometheus text, merged over every replica
    GET  /v1/admin/draft                         this replica's draft version, the registry champion
    POST /v1/admin/reload                        load the champion now (other replicas: within seconds)
    POST /v1/admin/rollback {"to": v?, "kind"?}  move the champion alias back (`draftsmith rollback [--kind medusa|eagle]`)

Keys. The inference key (`api_key`) guards /v1/models and the completion routes: with one configured they
need `Authorization: Bearer <key>` (401 otherwise). The admin routes /v1/admin/* never accept the
inference key: with an admin key (`admin_api_key`, `--admin-key`, DRAFTSMITH_ADMIN_KEY) they need
`Bearer <admin key>` from any address (401 without a valid one, 403 for the inference key); without one
they answer loopback callers only (127.0.0.0/8, ::1) and refuse every other address with 403. The
caller's address is the ASGI scope's `client`: behind Ray Serve that is the client of the proxy's HTTP
server, which the proxy forwards to the replica with the scope; uvicorn replaces it by X-Forwarded-For
only for peers in FORWARDED_ALLOW_IPS (default 127.0.0.1, so a reverse proxy on the same host should
set that header, or the deployment should set an admin key). /health and /metrics stay open for probes
and scrapers; /health shows failure details (exception text) only to callers the admin routes accept.

Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`: 400 bad field /
malformed JSON / request over the KV budget, 401, 403, 404 unknown model or route, 405, 408 timeout,
413 body over `max_body_bytes`, 429 queue full (Retry-After), 500 internal fault, 503 no draft yet for
a draft mode / engine unhealthy. Messages say what was wrong with the request; an internal fault's body
names only a reference (`err-...`) that the replica's log has next to the traceback, never the
exception's text. A failure after a stream started is sent as `data: {"error": ...}` followed by
`data: [DONE]`.

The routes use only Service's public methods; the service raises domain errors (serving/service.py,
`ServiceError`) and `service_error` below is the one place that maps them to status codes and bodies.
"""
from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import threading
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving import protocol as P
from serving.service import Busy, Conflict, InvalidRequest, Service, ServiceError, TimedOut, UnknownModel

log = logging.getLogger(__name__)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 without reading it all."""

    def __init__(self, app, limit: int = 1 << 20) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    too_big = int(v) > self.limit
                except ValueError:
                    too_big = False
                if too_big:
                    return await self._reject(send)
        state = {"seen": 0, "over": False, "replaced": False}

        async def limited():
            msg = await receive()
            if msg["type"] == "http.request":
                state["seen"] += len(msg.get("body", b""))
                if state["seen"] > self.limit:
                    state["over"] = True
                    raise _TooLarge()
            return msg

        async def guarded_send(msg):
            # the app may turn the read error into its own error response: answer 413 instead
            if state["over"]:
                if not state["replaced"]:
                    state["replaced"] = True
                    await self._reject(send)
                return
            await send(msg)

        try:
            await self.app(scope, limited, guarded_send)
        except _TooLarge:
            if not state["replaced"]:
                await self._reject(send)

    async def _reject(self, send):
        body = json.dumps(P.error_body(f"the request body is larger than {self.limit} bytes",
                                       code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def is_loopback(host: str | None) -> bool:
    """Whether `host` (an address as the ASGI scope gives it) is 127.0.0.0/8 or ::1 (also IPv4-mapped).
    Anything else, None and names included, is not."""
    if not host:
        return False
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and hmac.compare_digest(a.encode(), b.encode())


def internal_error(where: str, exc: BaseException | None = None) -> dict:
    """Log an unexpected fault with a fresh reference and return the error body the client gets: what
    happened and the reference, never the exception's text (it may carry paths, shapes, internals)."""
    ref = "err-" + uuid.uuid4().hex[:12]
    log.error("internal error %s in %s", ref, where, exc_info=exc if exc is not None else True)
    return P.error_body(f"internal server error while {where}; the server log has the details under reference "
                        f"{ref}", "server_error", None, "internal_error")


def _err(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# a domain error's status and OpenAI error type
_STATUS: dict[type, tuple[int, str]] = {
    InvalidRequest: (400, "invalid_request_error"),
    UnknownModel: (404, "invalid_request_error"),
    TimedOut: (408, "timeout"),
    Conflict: (409, "invalid_request_error"),
    Busy: (429, "rate_limit_exceeded"),
}


def service_error(e: ServiceError) -> P.APIError:
    """The HTTP error for a Service domain error (500-class faults never come this way)."""
    status, kind = next((v for cls, v in _STATUS.items() if isinstance(e, cls)), (400, "invalid_request_error"))
    headers = {"Retry-After": str(e.retry_after_s)} if isinstance(e, Busy) else None
    return P.APIError(status, e.message, type=kind, param=e.param, code=e.code, headers=headers)


def build_app(service: Service) -> FastAPI:
    app = FastAPI(title="Draftsmith", version="0.1.0",
                  description="OpenAI-compatible LLM serving with speculative decoding and a continually "
                              "distilled draft.")
    svc = service
    key = svc.settings.api_key
    admin_key = svc.settings.admin_api_key

    # ---------------------------------------------------------------- errors
    @app.exception_handler(P.APIError)
    async def _api_error(_req, e: P.APIError):
        svc.count_error(e.status)
        return _err(e)

    @app.exception_handler(ServiceError)
    async def _service_error(_req, e: ServiceError):
        err = service_error(e)
        svc.count_error(err.status)
        return _err(err)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, e: RequestValidationError):
        svc.count_error(400)
        return _err(P.validation_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, e: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request_error")
        return JSONResponse(P.error_body(str(e.detail), kind, None, kind), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(req: Request, e: Exception):
        svc.count_error(500)
        return JSONResponse(internal_error(f"handling {req.method} {req.url.path}", e), status_code=500)

    def auth(request: Request) -> None:
        """The inference key, on /v1/models and the completion routes."""
        if not key:
            return
        if not _same(_bearer(request), key):
            raise P.APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                             type="authentication_error", code="invalid_api_key")

    def admin_allowed(request: Request) -> bool:
        if admin_key:
            return _same(_bearer(request), admin_key)
        return is_loopback(request.client.host if request.client else None)

    def admin_auth(request: Request) -> None:
        """/v1/admin/*: the admin key when one is set (from any address), else loopback callers only.
        The inference key never opens these routes."""
        if admin_key:
            token = _bearer(request)
            if _same(token, admin_key):
                return
            if _same(token, key):
                raise P.APIError(403, "the inference API key does not open admin endpoints; send the admin key "
                                 "('Authorization: Bearer <admin key>')", type="permission_error",
                                 code="admin_key_required")
            raise P.APIError(401, "admin endpoints need the admin key: send 'Authorization: Bearer <admin key>'",
                             type="authentication_error", code="invalid_admin_key")
        if not admin_allowed(request):
            raise P.APIError(403, "admin endpoints answer loopback callers only when no admin key is configured; "
                             "call from the server's host, or start the server with --admin-key (or "
                             "DRAFTSMITH_ADMIN_KEY) and send it as 'Authorization: Bearer <admin key>'",
                             type="permission_error", code="admin_loopback_only")

    # ---------------------------------------------------------------- probes
    @app.get("/health")
    async def health(request: Request):
        ok, info = svc.health()
        if not admin_allowed(request):
            # an open probe: say what state the replica is in, but not the exception text behind it
            if not ok:
                info["reason"] = "unhealthy; an admin caller sees the cause here and at /v1/admin/draft"
            if info.get("swap_error"):
                info["swap_error"] = "the last draft swap failed; an admin caller sees the cause at /v1/admin/draft"
        return JSONResponse(info, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(await svc.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        return {"object": "list", "data": [{"id": svc.model_name, "object": "model", "created": 0,
                                            "owned_by": "draftsmith", "draft_version": svc.draft_version}]}

    # ---------------------------------------------------------------- generation
    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(body: P.CompletionRequest, request: Request):
        return await _guarded(_generate(body, request, chat=False))

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(body: P.ChatRequest, request: Request):
        return await _guarded(_generate(body, request, chat=True))

    async def _guarded(coro):
        """Internal faults become a 500 error body here, so the connection stays usable (an exception
        reaching Starlette's outermost handler closes the keep-alive connection)."""
        try:
            return await coro
        except (P.APIError, ServiceError):
            raise
        except Exception as e:  # noqa: BLE001
            svc.count_error(500)
            return JSONResponse(internal_error("generating", e), status_code=500)

    async def _generate(body, request: Request, chat: bool):
        t0 = time.monotonic()
        requested = (body.max_completion_tokens if chat and body.max_completion_tokens else None) or body.max_tokens
        messages = ([{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                     for m in body.messages] if chat else None)
        prompt, max_tokens = svc.prepare(model=body.model, prompt=None if chat else body.prompt, messages=messages,
                                         max_tokens=requested)
        try:
            sampling = P.sampling_params(body, max_tokens)
        except ValueError as e:
            raise P.APIError(400, str(e)) from None
        mode, routing = svc.request_mode(body.speculative is not None, sampling, body.traffic_label)
        spec = P.spec_params(body, svc.has_draft, mode)
        svc.check_fits(len(prompt), sampling, spec)
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        deadline = t0 + svc.settings.request_timeout_s
        ts = P.TextStream(svc.tokenizer, body.stop)
        cancel = threading.Event()
        agen = svc.stream(prompt, sampling, spec, request_id=rid, log_mode=body.log_mode, deadline=deadline,
                          cancel=cancel, source=body.traffic_label)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(agen, ts, rid, chat, len(prompt), include_usage, t0, cancel, routing),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        text, n, stats, reason, ttft = [], 0, None, None, None
        async with contextlib.aclosing(agen):
            async for out in agen:
                if ttft is None and out.token_ids:
                    ttft = time.monotonic() - t0
                n += len(out.token_ids)
                text.append(ts.push(out.token_ids))
                stats = out.stats
                if ts.stopped:
                    reason = "stop"
                    break
                if out.finish_reason is not None:
                    reason = P.finish_reason(out.finish_reason, False)
                    text.append(ts.finish())
                    break
                if await request.is_disconnected():
                    cancel.set()
                    svc.count_error(499)
                    return JSONResponse(P.error_body("client disconnected", code="client_closed"), status_code=499)
        st = stats.to_dict() if stats is not None else {}
        reason = reason or "length"
        svc.record(st, len(prompt), reason, time.monotonic() - t0, ttft, routing)
        return P.completion_body(rid, svc.model_name, chat, "".join(text), reason, P.usage(len(prompt), n), st)

    async def _sse(agen, ts: P.TextStream, rid: str, chat: bool, n_prompt: int, include_usage: bool, t0: float,
                   cancel: threading.Event, routing: dict | None):
        created = int(time.time())
        first, n, stats, reason, ttft = True, 0, None, None, None

        def event(obj) -> str:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        try:
            async with contextlib.aclosing(agen):
                async for out in agen:
                    if ttft is None and out.token_ids:
                        ttft = time.monotonic() - t0
                    n += len(out.token_ids)
                    stats = out.stats
                    delta = ts.push(out.token_ids)
                    if out.finish_reason is not None and not ts.stopped:
                        delta += ts.finish()
                    if delta or first:
                        yield event(P.chunk_body(rid, svc.model_name, chat, delta, None, first=first, created=created))
                        first = False
                    if ts.stopped:
                        reason = "stop"
                        break
                    if out.finish_reason is not None:
                        reason = P.finish_reason(out.finish_reason, False)
                        break
            reason = reason or "length"
            yield event(P.chunk_body(rid, svc.model_name, chat, None if chat else "", reason, created=created))
            st = stats.to_dict() if stats is not None else {}
            if include_usage:
                yield event(P.usage_chunk(rid, svc.model_name, chat, P.usage(n_prompt, n), st, created=created))
            svc.record(st, n_prompt, reason, time.monotonic() - t0, ttft, routing)
        except (P.APIError, ServiceError) as e:
            err = service_error(e) if isinstance(e, ServiceError) else e
            svc.count_error(err.status)
            yield event(err.body())
        except Exception as e:  # noqa: BLE001 - a stream ends with an error event, never a dropped socket
            svc.count_error(500)
            yield event(internal_error(f"streaming {rid}", e))
        finally:
            cancel.set()
        yield "data: [DONE]\n\n"

    # ---------------------------------------------------------------- admin
    @app.get("/v1/admin/draft", dependencies=[Depends(admin_auth)])
    async def admin_draft():
        return await run_in_threadpool(svc.draft_status)

    @app.post("/v1/admin/reload", dependencies=[Depends(admin_auth)])
    async def admin_reload():
        return await run_in_threadpool(svc.reload)

    @app.post("/v1/admin/rollback", dependencies=[Depends(admin_auth)])
    async def admin_rollback(body: P.RollbackRequest):
        return await run_in_threadpool(lambda: svc.rollback(body.to, reason=body.reason, kind=body.kind))

    app.add_middleware(BodyLimit, limit=svc.settings.max_body_bytes)
    return app
