"""The HTTP API over real HTTP (uvicorn) with tiny models: OpenAI client and raw HTTP, streaming, stop
strings, every kind of bad input, overload, timeouts, disconnects, API keys, metrics, the replay buffer
(real Redis), and a Redis restart under load."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import tiny_models
from tests.api_helpers import REDIS_URL, LiveServer, sse_events, tiny_service
from serving.config import SamplingParams, SpecParams


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_models.save_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def server(pair):
    srv = LiveServer(tiny_service(*pair)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def complete(client, **body):
    body.setdefault("prompt", "the quick brown fox")
    return client.post("/v1/completions", json=body)


def assert_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ----------------------------------------------------------------------------- happy paths
def test_greedy_http_output_equals_the_engine_and_speculative_is_lossless(client, server):
    eng = server.service.engine
    prompt = eng.tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    ref = eng.generate_all(prompt, SamplingParams(temperature=0, max_tokens=24), SpecParams(mode="target"))
    for mode in ("target", "speculative"):
        # a fixed gamma: the response's draft metrics must have drafts to count (an adaptive request on the
        # tiny models may rightly draft nothing once the replica has measured their costs)
        r = complete(client, max_tokens=24, temperature=0, speculative={"mode": mode, "gamma": 3, "adaptive": False})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == eng.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
        assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(ref.token_ids),
                                 "total_tokens": len(prompt) + len(ref.token_ids)}
        m = body["metrics"]["speculative_decoding"]
        assert m["mode"] == mode and m["draft_version"] == ("local" if mode != "target" else "none")
        if mode == "speculative":
            assert m["draft_tokens"] > 0 and 0 <= m["accepted_tokens"] <= m["draft_tokens"]
            assert m["acceptance_rate"] == pytest.approx(m["accepted_tokens"] / m["draft_tokens"])
            assert sum(m["accepted_per_position"]) == m["accepted_tokens"]
            assert m["energy_j"] is None and "CPU" in m["energy_reason"]


def test_openai_client_chat_stream_and_models(server):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in oc.models.list().data] == ["tiny"]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    full = oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                      extra_body={"speculative": {"mode": "mjsd", "gamma": 3, "beams": 4, "tau": 0.2}})
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens >= 1
    block = full.model_extra["metrics"]["speculative_decoding"]
    assert block["mode"] == "mjsd" and block["gamma"] == 3
    chunks = list(oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"speculative": {"mode": "speculative"}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    greedy = oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                        extra_body={"speculative": {"mode": "target"}})
    assert text == greedy.choices[0].message.content     # lossless + greedy: same text, streamed or not


def test_raw_sse_stream_has_chunks_usage_and_done(client):
    r = complete(client, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True},
                 speculative={"mode": "speculative", "adaptive": False})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16
    assert usage["metrics"]["speculative_decoding"]["draft_tokens"] > 0
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    plain = complete(client, max_tokens=16, temperature=0, speculative={"mode": "target"}).json()
    assert text == plain["choices"][0]["text"]
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_stop_strings_cut_the_output_streamed_and_not(client):
    base = complete(client, max_tokens=30, temperature=0, speculative={"mode": "target"}).json()["choices"][0]["text"]
    stop = base[10:13]
    expect = base[: base.index(stop)]
    r = complete(client, max_tokens=30, temperature=0, stop=[stop, "\u2603never"], speculative={"mode": "target"})
    assert r.json()["choices"][0]["text"] == expect and r.json()["choices"][0]["finish_reason"] == "stop"
    events = sse_events(complete(client, max_tokens=30, temperature=0, stop=stop, stream=True,
                                 speculative={"mode": "speculative"}))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expect
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible_over_http(client):
    """The same seed on the same backend configuration (OpenAI's `system_fingerprint`: model, draft
    version, the seeded request's cost profile) gives the same text."""
    a, b = (complete(client, max_tokens=20, temperature=1.0, seed=7).json() for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["system_fingerprint"].startswith("fp_") and a["system_fingerprint"] == b["system_fingerprint"]
    profile = a["metrics"]["speculative_decoding"]["cost_profile"]
    assert profile and profile == b["metrics"]["speculative_decoding"]["cost_profile"]
    greedy = complete(client, max_tokens=4, temperature=0, seed=7).json()
    assert greedy["metrics"]["speculative_decoding"]["cost_profile"] is None   # plans with the live costs
    assert greedy["system_fingerprint"] != a["system_fingerprint"]


def test_every_mode_answers(client):
    for mode in ("mjsd", "speculative", "target", "typical", "mentored", "spectr", "bild", "ngram", "staged", "tree"):
        r = complete(client, max_tokens=8, temperature=0.7, seed=1, speculative={"mode": mode})
        assert r.status_code == 200, (mode, r.text)
        assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.fixture
def seen(server, monkeypatch):
    """The (SamplingParams, SpecParams) each HTTP request reaches the service with."""
    calls, real = [], server.service.stream

    def spy(prompt_ids, sampling, spec, **kw):
        calls.append((sampling, spec))
        return real(prompt_ids, sampling, spec, **kw)

    monkeypatch.setattr(server.service, "stream", spy)
    return calls


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_absent_top_k_top_p_mean_openai_defaults_over_http(client, seen, route):
    """No top_k / top_p in the request: no top-k (0) and top_p 1.0, as OpenAI means them, not the MJSD
    paper's warp (serving/config.py DEFAULT_TOP_K / DEFAULT_TOP_P)."""
    body = {"max_tokens": 2, "seed": 1}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"})
    assert client.post(route, json=body).status_code == 200
    (sampling, _), = seen
    assert (sampling.top_k, sampling.top_p, sampling.temperature) == (0, 1.0, 1.0)


@pytest.mark.parametrize("given,expect", [
    ({"top_k": 20, "top_p": 0.9}, (20, 0.9)),        # the paper's warp, asked for explicitly
    ({"top_k": 5}, (5, 1.0)),
    ({"top_p": 0.5}, (0, 0.5)),
    ({"top_k": -1, "top_p": 1.0}, (0, 1.0)),        # -1 = off
    ({"top_k": 0}, (0, 1.0)),                        # 0 = off
    ({"top_k": 1}, (1, 1.0)),
])
def test_explicit_top_k_top_p_are_kept_over_http(client, seen, given, expect):
    assert complete(client, max_tokens=2, seed=1, **given).status_code == 200
    (sampling, _), = seen
    assert (sampling.top_k, sampling.top_p) == expect


def test_sampling_params_defaults_unit():
    from serving.protocol import CompletionRequest, sampling_params

    sp = sampling_params(CompletionRequest(prompt="x"), 8)
    assert (sp.top_k, sp.top_p, sp.temperature, sp.max_tokens) == (0, 1.0, 1.0, 8)
    sp = sampling_params(CompletionRequest(prompt="x", top_k=20, top_p=0.9, temperature=0.5), 8)
    assert (sp.top_k, sp.top_p, sp.temperature) == (20, 0.9, 0.5)


@pytest.mark.parametrize("adaptive", [None, True, False])
def test_speculative_adaptive_reaches_spec_params(client, seen, adaptive):
    """`speculative.adaptive` is passed to SpecParams only when given (default: SpecParams' own)."""
    opts = {"mode": "speculative", "gamma": 3}
    if adaptive is not None:
        opts["adaptive"] = adaptive
    r = complete(client, max_tokens=4, temperature=0, speculative=opts)
    assert r.status_code == 200, r.text
    (_, spec), = seen
    assert spec.mode == "speculative" and spec.gamma == 3
    if hasattr(spec, "adaptive"):            # the adaptive controller's SpecParams field
        assert spec.adaptive is (SpecParams().adaptive if adaptive is None else adaptive)


# ----------------------------------------------------------------------------- bad input
BAD = [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", None),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ({"prompt": "x", "max_tokens": 10**9}, "max_tokens", None),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens", None),
    ({"prompt": "x", "max_tokens": 4.5}, "max_tokens", None),
    ({"prompt": "x", "temperature": -0.1}, "temperature", None),
    ({"prompt": "x", "temperature": "hot"}, "temperature", None),
    ({"prompt": "x", "top_p": 0}, "top_p", None),
    ({"prompt": "x", "top_p": 1.5}, "top_p", None),
    ({"prompt": "x", "top_k": -5}, "top_k", None),
    ({"prompt": ""}, "prompt", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": ["a", "b"]}, "prompt", None),
    ({"prompt": [1, 2, 99999]}, "prompt", None),
    ({"prompt": "x" * 3000}, "prompt", "context_length_exceeded"),
    ({"prompt": "x", "max_tokens": 512}, "max_tokens", "context_length_exceeded"),
    ({}, "prompt", "missing"),
    ({"prompt": 5}, "prompt", None),
    ({"prompt": "x", "n": 2}, "n", None),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    ({"prompt": "x", "stop": [""]}, "stop", None),
    ({"prompt": "x", "stream": "yes"}, "stream", None),
    ({"prompt": "x", "seed": -1}, "seed", None),
    ({"prompt": "x", "speculative": {"mode": "nope"}}, "speculative.mode", None),
    ({"prompt": "x", "speculative": {"gamma": 0}}, "speculative.gamma", None),
    ({"prompt": "x", "speculative": {"gamma": 99}}, "speculative.gamma", None),
    ({"prompt": "x", "speculative": {"beams": "8"}}, "speculative.beams", None),
    ({"prompt": "x", "speculative": {"tau": -1}}, "speculative.tau", None),
    ({"prompt": "x", "speculative": {"color": 1}}, "speculative.color", None),
    ({"prompt": "x", "speculative": {"mode": "mentored", "params": {"kl_budget": -1}}}, "speculative", None),
    ({"prompt": "x", "speculative": {"mode": "mjsd", "params": {"kl_budget": 1}}}, "speculative", None),
    ({"prompt": "x", "speculative": {"adaptive": "yes"}}, "speculative.adaptive", "bool_type"),
    ({"prompt": "x", "speculative": {"adaptive": 1}}, "speculative.adaptive", "bool_type"),
    ({"prompt": "x", "log_mode": "everything"}, "log_mode", None),
    ({"prompt": "x", "metadata": {"category": 5}}, "metadata.category", None),
    ({"prompt": "x", "metadata": {"category": "c" * 65}}, "metadata", None),
    ({"prompt": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", None),
    ({"prompt": "x", "metadata": ["sql"]}, "metadata", None),
]


@pytest.mark.parametrize("body,param,code", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_fields_get_a_400_naming_the_field(client, body, param, code):
    err = assert_error(client.post("/v1/completions", json=body), 400, param=param, code=code)
    assert err["type"] == "invalid_request_error"


def test_bad_chat_messages_and_unknown_model(client):
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400, param="messages")
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}), 400,
                 param="messages.0.role")
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user"}]}), 400,
                 param="messages.0.content")
    assert_error(complete(client, model="gpt-4"), 404, param="model", code="model_not_found")


def test_the_service_raises_domain_errors_that_only_the_api_maps_to_http(server):
    """Service (serving/service.py) checks every limit itself and raises its own errors, never HTTP ones;
    serving/api.py maps them (400 / 404 / 408 / 409 / 429)."""
    import ast
    from pathlib import Path

    from serving import api
    from serving.service import Busy, Conflict, InvalidRequest, ServiceError, TimedOut, UnknownModel

    svc = server.service
    with pytest.raises(UnknownModel) as e:
        svc.prepare(model="gpt-4", prompt="x")
    assert (e.value.param, e.value.code) == ("model", "model_not_found")
    with pytest.raises(InvalidRequest, match="outside"):
        svc.prepare(model=None, prompt=[1, 10 ** 9])
    with pytest.raises(InvalidRequest) as e:
        svc.prepare(model=None, prompt="x", max_tokens=svc.settings.max_tokens_limit + 1)
    assert e.value.param == "max_tokens"
    ids, max_tokens = svc.prepare(model=None, prompt="x")
    assert ids and max_tokens == 16
    with pytest.raises(Conflict) as e:
        svc.reload()                                       # an explicit draft folder: no registry
    assert e.value.code == "no_registry"
    statuses = {cls: api.service_error(cls("m")).status for cls in (InvalidRequest, UnknownModel, TimedOut,
                                                                     Conflict, Busy)}
    assert statuses == {InvalidRequest: 400, UnknownModel: 404, TimedOut: 408, Conflict: 409, Busy: 429}
    assert api.service_error(Busy("m")).headers == {"Retry-After": "1"}
    assert all(issubclass(c, ServiceError) for c in statuses)
    tree = ast.parse(Path(__import__("serving.service").service.__file__).read_text())
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m.split(".")[0] in ("fastapi", "starlette") or m == "serving.protocol"}


def test_malformed_json_oversized_body_and_unknown_routes(client):
    for raw in (b"{bad json", b"", b"[1, 2", b"\xff\xfe", b"null", b"[]", b'{"prompt": "x", "temperature": NaN}',
                b'{"prompt": "x", "top_p": Infinity}'):
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400)
    assert_error(client.post("/v1/completions", content=b"{" + b" " * (2 << 20) + b"}",
                             headers={"content-type": "application/json"}), 413, code="request_too_large")
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=20), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                                                   max_size=3),
                    max_leaves=6)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream",
          "stream_options", "n", "speculative", "log_mode", "metadata"]


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6))
def test_fuzzed_request_bodies_never_get_a_5xx(client, route, body):
    """A fuzzing pass over the request schema: random JSON in every field -> 2xx or a well-formed 4xx."""
    if isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(max(body["max_tokens"], -3), 4)   # keep accepted requests short
    r = client.post(route, json=body)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# ----------------------------------------------------------------------------- overload, time, disconnects
def never_stopping(svc, step_s: float = 0.01):
    """Long-request tests need a request that runs to max_tokens (the tiny model may emit EOS early) and
    takes a known minimum time (the tiny model alone can do 1,000+ tokens/s): every target forward is
    slowed by `step_s`, so 450 tokens take at least 4.5 s however fast the machine is."""
    svc.engine.eos_token_ids = set()
    model = svc.engine.target.model
    real = model.forward

    def slow_forward(*a, **k):
        time.sleep(step_s)
        return real(*a, **k)

    model.forward = slow_forward
    return svc


def test_request_timeout_answers_408_and_frees_the_slot(pair):
    srv = LiveServer(never_stopping(tiny_service(*pair, max_running=1, request_timeout_s=0.5))).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            t0 = time.monotonic()
            r = c.post("/v1/completions", json=LONG)
            assert_error(r, 408, code="request_timeout")
            assert time.monotonic() - t0 < 5
            events = sse_events(c.post("/v1/completions", json={**LONG, "stream": True}))
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
            deadline = time.monotonic() + 10           # the timed-out requests leave the batch at its next round
            while (srv.service.running or srv.service.waiting) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert srv.service.running == 0 and srv.service.waiting == 0     # the slot came back
            # the same 0.5-s limit applies to this request: on a loaded host a 2-token answer can outlive it, so
            # a 408 here says the host is slow, not that the slot leaked; the service must answer 200 soon
            codes = []
            for _ in range(5):
                codes.append(c.post("/v1/completions", json={"prompt": "b", "max_tokens": 2}).status_code)
                if codes[-1] == 200:
                    break
            assert codes[-1] == 200 and set(codes) <= {200, 408}, codes
    finally:
        srv.stop()


LONG = {"prompt": "a", "max_tokens": 450, "temperature": 0, "speculative": {"mode": "target"}}


def test_full_queue_answers_429_with_retry_after(pair):
    srv = LiveServer(never_stopping(tiny_service(*pair, max_running=1, max_waiting=0))).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            holder = threading.Thread(target=lambda: c.post("/v1/completions", json={**LONG, "max_tokens": 500}))
            holder.start()
            deadline = time.time() + 10
            while srv.service.running == 0 and time.time() < deadline:
                time.sleep(0.01)
            with httpx.Client(base_url=srv.url, timeout=30) as c2:
                busy = c2.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
                assert_error(busy, 429, code="queue_full")
                assert busy.headers["retry-after"] == "1"
                busy = c2.post("/v1/completions", json={"prompt": "b", "max_tokens": 2, "stream": True})
                assert_error(busy, 429, code="queue_full")
            holder.join()
            assert c.post("/v1/completions", json={"prompt": "b", "max_tokens": 2}).status_code == 200
    finally:
        srv.stop()


def test_client_disconnect_stops_decoding(pair):
    srv = LiveServer(never_stopping(tiny_service(*pair))).start()
    try:
        before = srv.service.telemetry.snapshot()["counters"].get("generation_tokens_total", 0)
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 480, "temperature": 0,
                                                           "stream": True, "speculative": {"mode": "target"}}) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(3)]
                assert any(g.startswith("data: ") for g in got)
        deadline = time.time() + 10
        while srv.service.running and time.time() < deadline:
            time.sleep(0.02)
        assert srv.service.running == 0
        time.sleep(0.3)
        after = srv.service.telemetry.snapshot()["counters"].get("generation_tokens_total", 0)
        assert after == before          # the abandoned request was not counted as served
        assert srv.service.engine.healthy()[0]
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- auth, metrics, buffer
def test_api_key_guards_inference_routes_but_not_admin_or_probes(pair):
    """The inference key guards /v1/models and the completion routes; it neither opens nor closes the
    admin routes, which (no admin key here) answer loopback callers only: this test's client is on
    127.0.0.1; a remote caller is simulated through X-Forwarded-For, which uvicorn honours from 127.0.0.1
    only (tests/deploy/test_safe_defaults.py calls from a real non-loopback address)."""
    srv = LiveServer(tiny_service(*pair, api_key="s3cret")).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 401, code="invalid_api_key")
            assert_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                headers={"Authorization": "Bearer wrong"}), 401)
            assert_error(c.get("/v1/models"), 401)
            auth = {"Authorization": "Bearer s3cret"}
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth).status_code == 200
            # admin from loopback: no key needed, and the inference key changes nothing
            for headers in ({}, auth):
                assert_error(c.post("/v1/admin/reload", headers=headers), 409, code="no_registry")  # explicit draft
                assert c.get("/v1/admin/draft", headers=headers).status_code == 200
            remote = {**auth, "X-Forwarded-For": "203.0.113.7"}
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=remote).status_code == 200
            for r in (c.post("/v1/admin/reload", headers=remote), c.post("/v1/admin/rollback", json={}, headers=remote),
                      c.get("/v1/admin/draft", headers=remote)):
                err = assert_error(r, 403, code="admin_loopback_only")
                assert err["type"] == "permission_error" and "--admin-key" in err["message"]
            assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    finally:
        srv.stop()


def test_admin_key_is_separate_from_the_inference_key(pair):
    srv = LiveServer(tiny_service(*pair, api_key="inference-k", admin_api_key="admin-k")).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            inf, adm = {"Authorization": "Bearer inference-k"}, {"Authorization": "Bearer admin-k"}
            # an admin key set: required from loopback too
            assert_error(c.post("/v1/admin/reload"), 401, code="invalid_admin_key")
            assert_error(c.get("/v1/admin/draft", headers={"Authorization": "Bearer nope"}), 401,
                         code="invalid_admin_key")
            err = assert_error(c.post("/v1/admin/rollback", json={}, headers=inf), 403, code="admin_key_required")
            assert "inference API key does not open admin endpoints" in err["message"]
            assert_error(c.post("/v1/admin/reload", headers=adm), 409, code="no_registry")
            assert c.get("/v1/admin/draft", headers={**adm, "X-Forwarded-For": "203.0.113.7"}).status_code == 200
            # and the admin key is not an inference key
            assert_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=adm), 401)
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=inf).status_code == 200
    finally:
        srv.stop()


def test_a_request_over_the_kv_budget_is_a_400_that_says_so(pair):
    import torch

    from serving.engine import Engine

    engine = Engine.from_paths(str(pair[0]), str(pair[1]), dtype=torch.float32, draft_version="local",
                               max_batch_tokens=64)
    srv = LiveServer(tiny_service(*pair, engine=engine, buffer=False)).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            body = {"prompt": "the quick brown fox", "max_tokens": 40, "temperature": 0.8,
                    "speculative": {"mode": "mjsd", "beams": 4}}
            err = assert_error(c.post("/v1/completions", json=body), 400, param="max_tokens", code="kv_budget_exceeded")
            assert "budget of 64" in err["message"] and "lower max_tokens" in err["message"]
            ok = c.post("/v1/completions", json={**body, "max_tokens": 4, "speculative": {"mode": "target"}})
            assert ok.status_code == 200, ok.text
    finally:
        srv.stop()


def test_metrics_are_prometheus_and_match_the_responses(pair):
    from prometheus_client.parser import text_string_to_metric_families

    srv = LiveServer(tiny_service(*pair)).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            # fixed gamma: every step drafts (an adaptive seeded request plans from the replica's cost
            # profile, where the tiny models may not pay)
            bodies = [complete(c, max_tokens=12, temperature=0.8, seed=i,
                               speculative={"mode": "speculative", "adaptive": False}).json() for i in range(3)]
            blocks = [b["metrics"]["speculative_decoding"] for b in bodies]
            text = c.get("/metrics").text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        value = {s.name + json.dumps(s.labels, sort_keys=True): s.value for f in fams.values() for s in f.samples}

        def v(name, **labels):
            return value["draftsmith:" + name + json.dumps(labels, sort_keys=True)]

        assert v("spec_decode_num_draft_tokens_total") == sum(b["draft_tokens"] for b in blocks)
        assert v("spec_decode_num_accepted_tokens_total") == sum(b["accepted_tokens"] for b in blocks)
        assert v("spec_decode_num_drafts_total") == sum(b["steps"] for b in blocks)
        for pos in range(4):
            assert v("spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == \
                sum(b["accepted_per_position"][pos] for b in blocks)
        for reason in {b["choices"][0]["finish_reason"] for b in bodies}:
            assert v("request_success_total", finished_reason=reason) == \
                sum(b["choices"][0]["finish_reason"] == reason for b in bodies)
        assert v("e2e_request_latency_seconds_count") == 3
        assert v("time_to_first_token_seconds_count") == 3
        assert v("num_requests_waiting") == 0
        assert v("draft_version_info", replica=srv.service.s.replica_id, version="local") == 1
        assert "draftsmith:buffer_records_dropped_total" in value.__repr__()
    finally:
        srv.stop()


def test_each_verification_step_reaches_the_replay_buffer(pair):
    from buffer.redis_store import BufferConfig, ReplayBufferReader, connect

    svc = tiny_service(*pair)
    srv = LiveServer(svc).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            r = complete(c, max_tokens=10, temperature=0.5, seed=3, speculative={"mode": "mjsd"})
            m = r.json()["metrics"]["speculative_decoding"]
            r2 = complete(c, max_tokens=10, temperature=0.5, seed=3, log_mode="none")
            assert r2.status_code == 200
            r3 = complete(c, max_tokens=4, temperature=0.0, metadata={"category": "sql", "team": "a"}, log_mode="none")
            assert r3.status_code == 200
        assert svc.sink.flush(5)
        cfg = BufferConfig(prefix=svc.s.buffer_prefix)
        assert connect(REDIS_URL).xlen(cfg.steps_key) == m["steps"]      # the opted-out request left nothing
        entries = ReplayBufferReader(REDIS_URL, cfg).newest(100)
        assert len(entries) == m["steps"]
        # the adaptive controller may verify a step with nothing drafted or with an n-gram proposal:
        # those steps are recorded too, under no draft version
        assert {e.record.algorithm for e in entries} <= {"mjsd", "ngram", "target"}
        assert {e.record.draft_version for e in entries if e.record.algorithm == "mjsd"} <= {"local"}
        assert {e.record.draft_version for e in entries if e.record.algorithm != "mjsd"} <= {"none"}
        assert sum(len(e.record.draft_tokens) for e in entries) == m["draft_tokens"]
        assert sum(e.record.num_accepted for e in entries) == m["accepted_tokens"]
        # an unlabelled request's sequence has no traffic label; `metadata.category` labels one (the gate's
        # per-category test reads it)
        reader = ReplayBufferReader(REDIS_URL, cfg)
        assert reader.get_sequence(r.json()["id"]).source == ""
        # the sequence names the target whose opinions its steps hold: a job for that target reads it,
        # a job for another leaves it out
        from buffer.fingerprint import target_fingerprint
        mine = target_fingerprint(svc.engine.target.path)
        assert mine and reader.get_sequence(r.json()["id"]).target == mine
        assert ReplayBufferReader(REDIS_URL, cfg, target=mine).get_sequence(r.json()["id"]) is not None
        assert ReplayBufferReader(REDIS_URL, cfg, target="0" * 64).get_sequence(r.json()["id"]) is None
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            r4 = complete(c, max_tokens=4, temperature=0.0, metadata={"category": "sql"})
            assert r4.status_code == 200
        assert svc.sink.flush(5)
        assert reader.get_sequence(r4.json()["id"]).source == "sql"
    finally:
        srv.stop()
        client = connect(REDIS_URL)
        keys = list(client.scan_iter(match=f"{svc.s.buffer_prefix}:*"))
        if keys:
            client.delete(*keys)


def test_serving_survives_a_redis_restart_mid_load(pair, tmp_path):
    """Own redis-server, stopped and restarted while 2 clients keep sending: every request answers 200,
    the writer counts what it dropped, and writing resumes."""
    import torch  # noqa: F401

    from buffer.embedded import EmbeddedRedis
    from buffer.redis_store import BufferConfig, ReplayBufferWriter, connect
    from serving.engine import Engine

    own = EmbeddedRedis(tmp_path / "redis", transport="tcp", persist=False)
    url = own.start()
    cfg = BufferConfig(prefix="test:api:restart", flush_interval_s=0.002)
    sink = ReplayBufferWriter(url, cfg)
    engine = Engine.from_paths(str(pair[0]), str(pair[1]), dtype=torch.float32, draft_version="local", sink=sink)
    svc = tiny_service(*pair, engine=engine, buffer=False)
    svc.sink = sink
    srv = LiveServer(svc).start()
    statuses, stop = [], threading.Event()

    def load():
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            while not stop.is_set():
                statuses.append(complete(c, max_tokens=8, temperature=0.7, speculative={"mode": "speculative"})
                                .status_code)

    workers = [threading.Thread(target=load) for _ in range(2)]
    try:
        for w in workers:
            w.start()
        time.sleep(1.0)
        own.stop()
        time.sleep(1.5)
        own.start()
        deadline = time.time() + 15
        while connect(url).xlen(cfg.steps_key) < 5 and time.time() < deadline:
            time.sleep(0.1)
        assert connect(url).xlen(cfg.steps_key) >= 5          # writing resumed into the fresh server
    finally:
        stop.set()
        for w in workers:
            w.join()
        srv.stop()
        own.stop()
    assert statuses and set(statuses) == {200}, statuses
    assert sink.stats()["reconnects"] >= 1


def test_a_failing_engine_answers_500_bodies_then_health_503(pair, caplog):
    """Faults inside decoding (a device error, say) give OpenAI-style 500 bodies, never a dropped
    connection, and never the exception's text: the body names a reference that the log has next to the
    traceback. After 3 consecutive failed steps /health says 503 (Ray Serve then restarts the replica);
    its reason carries the cause for callers the admin routes accept (loopback here), not for others."""
    svc = tiny_service(*pair)
    srv = LiveServer(svc).start()
    secret = "CUDA error: device-side assert at /srv/private/path (simulated)"
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            real = svc.engine.target.model.forward

            def broken(*a, **k):
                raise RuntimeError(secret)

            svc.engine.target.model.forward = broken
            refs = []
            with caplog.at_level("ERROR", logger="serving.api"):
                for i in range(3):
                    r = complete(c, max_tokens=4, speculative={"mode": "target"})
                    err = assert_error(r, 500, code="internal_error")
                    assert err["type"] == "server_error" and "simulated" not in r.text and "RuntimeError" not in r.text
                    assert "internal server error while generating" in err["message"]
                    refs.append(err["message"].rsplit(" ", 1)[-1])
                r = complete(c, max_tokens=4, stream=True, speculative={"mode": "target"})
                events = sse_events(r)
                assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
                assert "simulated" not in r.text and "internal server error while streaming" in r.text
                refs.append(events[-2]["error"]["message"].rsplit(" ", 1)[-1])
            assert all(ref.startswith("err-") for ref in refs) and len(set(refs)) == 4
            logged = "\n".join(rec.getMessage() + "\n" + (rec.exc_text or "") for rec in caplog.records)
            for ref in refs:                                  # the operator finds the cause by the reference
                assert ref in logged
            assert "simulated" in caplog.text
            h = c.get("/health")
            assert h.status_code == 503 and "consecutive decoding steps failed" in h.json()["reason"]
            h = c.get("/health", headers={"X-Forwarded-For": "203.0.113.7"})    # a remote probe
            assert h.status_code == 503 and h.json()["status"] == "unhealthy" and "simulated" not in h.text
            svc.engine.target.model.forward = real
    finally:
        srv.stop()
