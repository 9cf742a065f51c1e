"""The OpenAI-compatible wire format: request schemas, their translation into engine parameters,
OpenAI-style errors, response/chunk builders and stop-string handling. No I/O, no torch.

Requests (pydantic v2; the FastAPI app publishes them in its OpenAPI document):
    POST /v1/completions       CompletionRequest   prompt: str | [str] (one) | [int] (token ids)
    POST /v1/chat/completions  ChatRequest         messages: [{role, content}] through the chat template
Common fields: model, max_tokens, temperature (0..2, 0 = greedy), top_p (0, 1], top_k (0 or -1 = off),
stop (str or up to 4 str), seed, stream, stream_options.include_usage, n (1 only), and two extensions:
    speculative: {mode, gamma, beams, tau, adaptive, params: {mode knobs}}   (serving/config.py MODES /
                 MODE_KNOBS; adaptive, default true: gamma is an upper bound the adaptive speculation
                 controller may stay under; false keeps a fixed gamma)
    log_mode: "full" | "ids_only" | "none"   what the replay buffer may keep of this request
and OpenAI's `metadata` ({str: str}, at most 16 pairs, keys <= 64 and values <= 512 characters), whose
`category` labels the request's traffic in the replay buffer (a SequenceRecord's `source`): the promotion
gate tests each labelled category for regression and keeps enough of each in its held-out sample.
Defaults where a field is absent follow OpenAI: temperature 1, no top-k (0), top_p 1.0 (no nucleus cut),
so an OpenAI client that sets neither gets the plain softmax at its temperature. The MJSD paper's warp
(top_k 20, top_p 0.9: serving/config.py DEFAULT_TOP_K / DEFAULT_TOP_P, what the paper-table benchmarks
pass explicitly) applies only when a request asks for it. Decoding: mode mjsd with gamma 4, 8 beams,
tau 0.1.

Errors are `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status (APIError).
"""
from __future__ import annotations

import hashlib

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from serving.config import DEFAULT_MODE, MODES, SamplingParams, SpecParams, served_knobs

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 128
MAX_MESSAGES = 256
MAX_PROMPT_CHARS = 200_000   # checked before tokenizing; the token limit is the model's context
MAX_METADATA = 16            # OpenAI's request metadata limits
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_CATEGORY = 64            # the traffic label kept in the replay buffer


# ----------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error the client caused or must wait out; rendered as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(errors: list[dict]) -> APIError:
    """A pydantic/FastAPI validation error list -> one 400 naming the first bad field."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    param = ".".join(loc) or None
    kind = first.get("type", "invalid")
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg', '')}".rstrip(": "),
                        code="invalid_json")
    msg = first.get("msg", "invalid value")
    where = f"'{param}'" if param else "the request body"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return APIError(400, f"{where}: {msg}{more}", param=param, code=kind)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "constrained-str", "constrained-int"}


def _is_type_tag(part) -> bool:
    """pydantic puts the tried union member into `loc` ('str', 'list[int]', 'function-after[...]')."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


# ----------------------------------------------------------------------------- schemas
class SpeculativeOptions(BaseModel):
    """Extension field: which decoding rule answers this request."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    mode: Literal[MODES] | None = Field(  # type: ignore[valid-type]
        None, description="the decoding rule; absent: the server's default mode (mjsd unless the deployment "
        "set another, e.g. medusa on a GPU; GET /health shows it)")
    gamma: StrictInt | None = Field(None, ge=1, le=16, description="draft tokens per verification step")
    beams: StrictInt | None = Field(None, ge=1, le=32, description="MJSD beam-sampling width")
    tau: float | None = Field(None, ge=0, le=1e6, description="MJSD joint-ratio threshold")
    adaptive: StrictBool | None = Field(None, description="adapt the draft length per step with gamma as its "
                                        "upper bound (default true); false keeps a fixed gamma")
    params: dict[str, Union[StrictInt, float, StrictStr]] = Field(
        default_factory=dict, description="the mode's other knobs (MODE_KNOBS; `rule` of tree / medusa / eagle is a string)")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = Field(None, max_length=256)
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1, le=100_000)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1)
    n: StrictInt = Field(1, ge=1, le=1, description="only n=1 is supported")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    speculative: SpeculativeOptions | None = None
    log_mode: Literal["full", "ids_only", "none"] = "full"
    metadata: dict[StrictStr, StrictStr] | None = Field(
        None, description="OpenAI request metadata; `category` (at most 64 characters) labels the request's traffic "
        "in the replay buffer, so the promotion gate tests each category for regression")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is None:
            return v
        if len(v) > MAX_METADATA:
            raise ValueError(f"at most {MAX_METADATA} metadata pairs")
        for k, x in v.items():
            if not k or len(k) > MAX_METADATA_KEY:
                raise ValueError(f"metadata keys must be 1 to {MAX_METADATA_KEY} characters")
            if len(x) > MAX_METADATA_VALUE:
                raise ValueError(f"metadata values must be at most {MAX_METADATA_VALUE} characters")
        if len(v.get("category", "")) > MAX_CATEGORY:
            raise ValueError(f"metadata.category (the traffic label) must be at most {MAX_CATEGORY} characters")
        return v

    @property
    def traffic_label(self) -> str:
        """The request's traffic category for the replay buffer ("" when unlabelled)."""
        return (self.metadata or {}).get("category", "").strip()

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if v is None:
            return []
        items = [v] if isinstance(v, str) else list(v)
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        for s in items:
            if not s:
                raise ValueError("stop strings must be non-empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        return items


class CompletionRequest(_Common):
    prompt: str | list[StrictInt] | list[str] = Field(..., description="text, [text] or token ids")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt is empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError("batched prompts are not supported: send one prompt per request")
                v = v[0]
        if isinstance(v, str):
            if not v:
                raise ValueError("the prompt is empty")
            if len(v) > MAX_PROMPT_CHARS:
                raise ValueError(f"the prompt is longer than {MAX_PROMPT_CHARS} characters")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[Message] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    @field_validator("messages")
    @classmethod
    def _chars(cls, v):
        if sum(len(m.text()) for m in v) > MAX_PROMPT_CHARS:
            raise ValueError(f"the messages are longer than {MAX_PROMPT_CHARS} characters in all")
        return v


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: str | StrictInt | None = Field(None, description="version to roll back to (default: the previous one)")
    reason: str = Field("", max_length=500)
    kind: Literal["draft", "medusa", "eagle"] = Field(
        "draft", description="which draft kind: the draft model, the Medusa heads or the EAGLE head")


# ----------------------------------------------------------------------------- translation
# OpenAI's meaning of an absent field: no top-k, no nucleus cut (not the MJSD paper's top-k 20 / top-p 0.9).
OPENAI_TOP_K = 0
OPENAI_TOP_P = 1.0


def sampling_params(req: _Common, max_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The request's sampling. Absent top_k / top_p mean OpenAI's defaults (off / 1.0); an explicit
    top_k of -1 or 0 turns top-k off."""
    top_k = OPENAI_TOP_K if req.top_k is None else max(0, req.top_k)
    return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature, top_k=top_k,
                          top_p=OPENAI_TOP_P if req.top_p is None else req.top_p, max_tokens=max_tokens,
                          seed=req.seed, stop_token_ids=stop_token_ids)


def spec_params(req: _Common, draft_loaded: bool, default_mode: str | None = None) -> SpecParams:
    """The request's decoding rule. A request that names no mode gets `default_mode` (the replica's
    `Service.default_mode`: the deployment's default where what it needs is loaded); without one, mjsd, or
    target-only decoding while no draft is loaded (first start, bootstrap still running). An explicit draft
    mode without a draft is an APIError(503)."""
    default_mode = default_mode or (DEFAULT_MODE if draft_loaded else "target")
    opts = req.speculative
    if opts is None:
        return SpecParams(mode=default_mode, extra=served_knobs(default_mode))
    kw: dict[str, Any] = {"mode": opts.mode or default_mode, "extra": dict(opts.params)}
    if opts.mode is None:                  # the default mode with its served knobs, the request's own on top
        kw["extra"] = {**served_knobs(default_mode), **kw["extra"]}
    for name in ("gamma", "beams", "tau", "adaptive"):   # only what was given: SpecParams keeps its defaults
        if getattr(opts, name) is not None:
            kw[name] = getattr(opts, name)
    try:
        spec = SpecParams(**kw)
    except ValueError as e:
        raise APIError(400, str(e), param="speculative") from None
    if spec.needs_draft and not draft_loaded:
        raise APIError(503, f"mode {spec.mode!r} needs a draft model and none is loaded yet (the first draft is "
                       "still being built or failed to load); use mode 'target' or 'ngram', or retry later",
                       type="service_unavailable", param="speculative.mode", code="draft_unavailable",
                       headers={"Retry-After": "30"})
    return spec


# ----------------------------------------------------------------------------- stop strings
class TextStream:
    """Incremental detokenisation with stop strings.

    `push(ids)` returns the text that is safe to send now: characters that cannot yet be the start of a
    stop string and do not end in an incomplete UTF-8 sequence are released; once a stop string appears
    the text before it is released and `stopped` is set (the stop string itself is not returned, as in
    OpenAI's API). `finish()` releases what was held back.

    Each push decodes a short window, not the whole output (as vLLM's detokenizer): the tokens from
    `prefix` on, against the same window without the new tokens; the difference is the new text. The
    window starts a few tokens back, so a tokenizer that renders a token differently at the start of a
    text (a leading space) is decoded in context. A window ending inside a multi-byte character is held
    until the character completes.
    """

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tok = tokenizer
        self.stops = list(stops or [])
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.prefix = 0          # window start
        self.read = 0            # tokens already turned into text
        self.sent = 0
        self.stopped = False
        self.text = ""           # every complete character decoded so far

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool = False) -> None:
        before = self._decode(self.ids[self.prefix: self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)

    def push(self, ids: list[int]) -> str:
        if self.stopped or not ids:
            return ""
        self.ids.extend(int(i) for i in ids)
        self._advance()
        text = self.text
        if self.stops:
            start = max(0, self.sent - self.hold)
            hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                cut = min(hits)
                self.stopped = True
                self.text = text[:cut]
                out = text[self.sent:cut]
                self.sent = max(self.sent, cut)
                return out
        safe = len(text) - self.hold
        if safe <= self.sent:
            return ""
        out = text[self.sent:safe]
        self.sent = safe
        return out

    def finish(self) -> str:
        if self.stopped:
            return ""
        if self.read < len(self.ids):
            self._advance(final=True)        # flush a trailing incomplete character as the tokenizer renders it
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out


# ----------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def spec_metrics(stats: dict) -> dict:
    """The response's `metrics.speculative_decoding` block from GenerationStats.to_dict()."""
    return {
        "mode": stats.get("mode"),
        "draft_version": stats.get("draft_version"),
        "draft_versions": stats.get("draft_versions"),   # per version that drafted: steps, draft / accepted tokens
        "gamma": stats.get("gamma"),
        "steps": stats.get("steps"),
        "draft_tokens": stats.get("draft_tokens"),
        "accepted_tokens": stats.get("accepted_tokens"),
        "accepted_per_position": stats.get("accepted_per_position"),
        "adaptive": stats.get("adaptive"),
        "drafted_per_step": stats.get("drafted_per_step"),
        "zero_draft_steps": stats.get("zero_draft_steps"),
        "ngram_steps": stats.get("ngram_steps"),
        "store_steps": stats.get("store_steps"),          # of ngram_steps: proposed by the suffix store
        "mean_acceptance_length": stats.get("mean_accepted_length"),
        "acceptance_rate": stats.get("acceptance_rate"),
        "draft_time_s": stats.get("draft_time_s"),
        "target_time_s": stats.get("target_time_s"),
        "wall_time_s": stats.get("wall_time_s"),
        "other_steps_s": stats.get("other_steps_s"),      # of wall time: waiting through other requests' passes
        "beside_jobs_s": stats.get("beside_jobs_s"),      # of wall time: on fewer threads, jobs held cores
        "shared_steps": stats.get("shared_steps"),        # steps taken in a pass with other requests' rows
        "shared_steps_s": stats.get("shared_steps_s"),    # and those passes' time
        "own_steps_s": stats.get("own_steps_s"),          # the time of every pass it stepped in
        "tokens_per_s": stats.get("tokens_per_s"),
        "energy_j": stats.get("energy_j"),
        "energy_reason": stats.get("energy_reason"),
        "cost_profile": stats.get("cost_profile") or None,   # seeded sampled requests (Engine.calibrate)
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(engine_reason: str | None, stopped_by_string: bool) -> str | None:
    if stopped_by_string:
        return "stop"
    if engine_reason in ("stop", "length"):
        return engine_reason
    return None if engine_reason is None else "stop"


def system_fingerprint(model: str, stats: dict) -> str:
    """OpenAI's `system_fingerprint`: the backend configuration that a `seed` reproduces its output on. Here:
    the served model, the draft version(s) that proposed, and the cost profile a seeded sampled request
    planned with (Engine.calibrate); a response with the same seed and fingerprint has the same text."""
    versions = ",".join(sorted(stats.get("draft_versions") or {})) or str(stats.get("draft_version", ""))
    key = f"{model}|{stats.get('mode', '')}|{versions}|{stats.get('cost_profile', '')}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:10]


def completion_body(rid: str, model: str, chat: bool, text: str, reason: str, usage_: dict, stats: dict) -> dict:
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": system_fingerprint(model, stats), "choices": [choice],
            "usage": usage_, "metrics": {"speculative_decoding": spec_metrics(stats)}}


def chunk_body(rid: str, model: str, chat: bool, text: str | None, reason: str | None, *, first: bool = False,
               created: int | None = None) -> dict:
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "model": model,
            "created": created or int(time.time()), "choices": [choice]}


def usage_chunk(rid: str, model: str, chat: bool, usage_: dict, stats: dict, created: int | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "model": model,
            "created": created or int(time.time()), "system_fingerprint": system_fingerprint(model, stats),
            "choices": [], "usage": usage_, "metrics": {"speculative_decoding": spec_metrics(stats)}}
