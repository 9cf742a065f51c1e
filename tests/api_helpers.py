"""A real HTTP server (uvicorn in a thread) over the FastAPI app with tiny models, for the API tests."""
from __future__ import annotations

import os

import socket
import threading
import time
import uuid

import httpx

from serving.metrics import MetricsHub
from serving.service import Service, ServiceSettings

REDIS_URL = os.environ["DRAFTSMITH_TEST_REDIS_URL"]     # resolved once per run by conftest.py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving build_app(Service(...)) on 127.0.0.1:<free port> until stop()."""

    def __init__(self, service: Service) -> None:
        import uvicorn

        from serving.api import build_app

        self.service = service
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(service), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "LiveServer":
        self.thread.start()
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code in (200, 503):
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("test server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.service.close()


def tiny_service(target, draft=None, *, engine=None, registry=None, buffer_prefix: str | None = None,
                 **settings) -> Service:
    """A Service over the tiny models (fp32) with the buffer on the real Redis under a unique prefix."""
    import torch

    from serving.engine import Engine

    prefix = buffer_prefix or f"test:api:{uuid.uuid4().hex[:10]}"
    s = ServiceSettings(target=str(target), draft=None if draft is None else str(draft), redis_url=REDIS_URL,
                        buffer_prefix=prefix, served_model_name="tiny", **settings)
    sink = None
    if s.buffer:
        from buffer.redis_store import BufferConfig, ReplayBufferWriter

        sink = ReplayBufferWriter(REDIS_URL, BufferConfig(prefix=prefix, flush_interval_s=0.002))
    if engine is None:
        engine = Engine.from_paths(str(target), str(draft) if draft else None, dtype=torch.float32,
                                   draft_version="local" if draft else "none", sink=sink)
    return Service(s, engine=engine, registry=registry, sink=sink, hub=MetricsHub(live_stats=False))


def sse_events(resp: httpx.Response) -> list:
    """Parse a server-sent-events body into JSON objects (and the string '[DONE]')."""
    import json

    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
