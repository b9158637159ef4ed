"""SGLang 0.5.23's OpenAI-compatible chat API on the embedded engine, for OpenAI clients (Harbor's
Terminus-2 through LiteLLM: `--ak api_base=http://127.0.0.1:PORT/v1`).

- `POST /v1/chat/completions`, non-streaming. The prompt is built as SGLang builds it: the
  tokenizer's chat template rendered with add_generation_prompt, then encoded without added
  special tokens; a last assistant message becomes a user message (SGLang's rule without
  continue_final_message); text parts of a content list are joined with " ". It is then the same
  scheduler request /generate makes, so sampling and logprobs are the engine's own.
- Request fields and defaults as SGLang's ChatCompletionRequest: max_completion_tokens (else
  max_tokens; neither: up to the context), temperature / top_p 1.0 and top_k -1 unless given, n,
  stop, stop_token_ids, ignore_eos, no_stop_trim, skip_special_tokens (default true),
  logprobs, return_token_ids / return_prompt_token_ids, chat_template_kwargs. The turn also
  stops at the tokenizer's end-of-turn ids (agentrl.models.tokenizer.stop_token_ids: what SGLang
  takes from the model's generation config), so a chat turn ends where agentrl's agent ends it.
- The answer has SGLang's shape: `id` (the request id), `object` "chat.completion", `created`,
  `model` (as requested, "default" when absent), `choices[]` {index, message {role, content,
  reasoning_content null}, logprobs {content [{token, bytes, logprob, top_logprobs []}]} | null,
  finish_reason stop | length | abort, matched_stop}, `usage` {prompt_tokens, completion_tokens,
  total_tokens, reasoning_tokens 0, ...}, `metadata` {weight_version, weight_versions}. Text is
  decoded as SGLang's detokenizer does: a matched stop token is dropped, a matched stop string cut
  (both kept with no_stop_trim).
- Errors: SGLang's {"object": "error", "message", "type", "param", "code"}; a prompt that does not
  fit the context gets SGLang's own message, which OpenAI clients read as a context-window error.
- `GET /v1/models` and `/v1/models/{model}`: one model card (id, root, max_model_len).
Refused with a 400 naming the field, rather than ignored as SGLang would: streaming, tools,
constrained decoding, penalties and other sampling fields away from their neutral value, seeds
and top_logprobs (the engine has one generator and returns the sampled token's logprob only).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from agentrl.rollout.embedded.http_util import BadRequest, json_body
from agentrl.rollout.embedded.request import GenOutput, GenRequest
from agentrl.rollout.embedded.sampling import RowParams
from agentrl.rollout.embedded.validation import MAX_N, MAX_STOP_STRINGS, is_int, is_number

DEFAULT_MODEL_NAME = "default"  # SGLang's ChatCompletionRequest.model default
ROLES = ("system", "developer", "user", "assistant", "tool")
HONOURED = {"messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
            "stop", "stop_token_ids", "ignore_eos", "no_stop_trim", "skip_special_tokens", "logprobs",
            "return_token_ids", "return_prompt_token_ids", "chat_template_kwargs", "stream"}
# Sampling fields accepted only at the value that leaves sampling unchanged.
NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
           "min_tokens": 0, "top_logprobs": 0, "continue_final_message": False}
# Accepted only when null or empty: they would change what is sampled, or how.
EMPTY_ONLY = {"tools", "logit_bias", "seed", "regex", "ebnf", "stop_regex", "response_format", "lora_path",
              "reasoning_effort", "stream_options"}
# Fields that do not change what is generated.
IGNORED = {"user", "session_id", "session_params", "rid", "tool_choice", "parallel_tool_calls",
           "separate_reasoning", "stream_reasoning"}


@dataclass
class ChatCall:
    requests: list[GenRequest]
    prompt_ids: list[int]
    model: str
    logprobs: bool
    return_token_ids: bool
    return_prompt_token_ids: bool
    skip_special_tokens: bool
    no_stop_trim: bool


def openai_error(status: int, message: str, kind: str = "BadRequest", param: str | None = None) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": kind, "param": param, "code": status},
                             status=status)


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of content parts")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text") or not isinstance(
                part.get("text"), str):
            raise BadRequest(f"{where}.content[{i}]: only text parts are supported by the embedded engine")
        parts.append(part["text"])
    return " ".join(parts)


def template_messages(messages: Any) -> list[dict[str, str]]:
    """The messages as the chat template takes them (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("Messages cannot be empty.")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}")
        if m.get("tool_calls"):
            raise BadRequest(f"{where}.tool_calls: tool calls are not supported by the embedded engine")
        out.append({"role": m["role"], "content": _text(m.get("content"), where)})
    if out[-1]["role"] == "assistant":
        out[-1]["role"] = "user"
    return out


def _number(body: dict, key: str, default: float, ok, rng: str) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not is_number(v) or not ok(v):
        raise BadRequest(f"{key}={v!r}: must be a finite number {rng}")
    return float(v)


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{key}={v!r}: must be true or false")
    return v


def _check_fields(body: dict) -> None:
    unknown = sorted(set(body) - HONOURED - set(NEUTRAL) - EMPTY_ONLY - IGNORED)
    if unknown:
        raise BadRequest(f"field(s) {unknown} are not supported by the embedded engine's chat API")
    for key, neutral in NEUTRAL.items():
        v = body.get(key)
        if v is not None and v != neutral:
            raise BadRequest(f"{key}={v!r} is not supported by the embedded engine (only {neutral!r})")
    for key in EMPTY_ONLY:
        if body.get(key) not in (None, [], {}) and not (key == "response_format" and body[key] == {"type": "text"}):
            raise BadRequest(f"{key} is not supported by the embedded engine; leave it out")
    if _flag(body, "stream", False):
        raise BadRequest("stream=true is not supported by the embedded engine; use stream=false")


def parse_chat(body: dict, *, tokenizer, vocab: int, context_len: int, end_of_turn: frozenset[int],
               rid: str) -> ChatCall:
    """The scheduler requests of one chat completion body; BadRequest names the field."""
    _check_fields(body)
    messages = template_messages(body.get("messages"))
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or "chat_template" in kwargs:
        raise BadRequest("chat_template_kwargs must be an object without chat_template")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    prompt = list(tokenizer.encode(rendered, add_special_tokens=False))
    if len(prompt) >= context_len:
        raise BadRequest(f"The input ({len(prompt)} tokens) is longer than the model's context length "
                         f"({context_len} tokens).")
    max_new = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_new is None:
        max_new = context_len - len(prompt)
    elif not is_int(max_new) or max_new < 0:
        raise BadRequest(f"max_completion_tokens / max_tokens = {max_new!r}: must be an int >= 0")
    elif max_new + len(prompt) > context_len:
        raise BadRequest(f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
                         f"You requested a total of {max_new + len(prompt)} tokens: {len(prompt)} tokens from the "
                         f"input messages and {max_new} tokens for the completion. Please reduce the number of "
                         "tokens in the input messages or the completion to fit within the limit.")
    temperature = _number(body, "temperature", 1.0, lambda v: v >= 0, ">= 0")
    top_p = _number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]")
    top_k = body.get("top_k", -1) if body.get("top_k") is not None else -1
    if not is_int(top_k) or top_k == 0 or top_k < -1:
        raise BadRequest(f"top_k={top_k!r}: must be -1 (the whole vocabulary) or an int >= 1")
    n = body.get("n", 1) if body.get("n") is not None else 1
    if not is_int(n) or not 1 <= n <= MAX_N:
        raise BadRequest(f"n={n!r}: must be an int in [1, {MAX_N}]")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(is_int(t) and 0 <= t < vocab for t in stop_ids):
        raise BadRequest(f"stop_token_ids must be a list of ints in [0, {vocab})")
    model = body.get("model", DEFAULT_MODEL_NAME)
    if not isinstance(model, str):
        raise BadRequest(f"model={model!r}: must be a string")
    params = RowParams(temperature, top_p, top_k)
    reqs = [GenRequest(rid=rid if n == 1 else f"{rid}-{i}", input_ids=list(prompt), max_new_tokens=max_new,
                       params=params, on_done=None, stop_token_ids=frozenset(stop_ids) | end_of_turn,
                       stop_strings=tuple(stop), ignore_eos=_flag(body, "ignore_eos", False))
            for i in range(n)]
    return ChatCall(reqs, prompt, model, _flag(body, "logprobs", False), _flag(body, "return_token_ids", False),
                    _flag(body, "return_prompt_token_ids", False), _flag(body, "skip_special_tokens", True),
                    _flag(body, "no_stop_trim", False))


def completion_text(tokenizer, out: GenOutput, skip_special_tokens: bool, no_stop_trim: bool) -> str:
    """The choice's text as SGLang's detokenizer makes it (trim_matched_stop)."""
    ids, matched = out.output_ids, out.finish_reason.get("matched")
    if isinstance(matched, int) and not no_stop_trim and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            text = text[: pos + len(matched)] if no_stop_trim else text[:pos]
    return text


def render_chat(call: ChatCall, outs: list[GenOutput], tokenizer, created: int, spans: list[dict]) -> dict[str, Any]:
    """SGLang's ChatCompletionResponse of the finished requests; `spans` are the first choice's
    weight-version spans."""
    choices = []
    for i, o in enumerate(outs):
        choice: dict[str, Any] = {
            "index": i,
            "message": {"role": "assistant", "content": completion_text(tokenizer, o, call.skip_special_tokens,
                                                                        call.no_stop_trim),
                        "reasoning_content": None},
            "logprobs": None, "finish_reason": o.finish_reason.get("type"),
            "matched_stop": o.finish_reason.get("matched"),
        }
        if call.logprobs:
            tokens = [tokenizer.decode([t]) for t in o.output_ids]
            choice["logprobs"] = {"content": [{"token": s, "bytes": list(s.encode()), "logprob": lp, "top_logprobs": []}
                                              for s, lp in zip(tokens, o.logprobs)]}
        if call.return_prompt_token_ids or call.return_token_ids:
            choice["prompt_token_ids"] = call.prompt_ids
        if call.return_token_ids:
            choice["response_token_ids"] = o.output_ids
        choices.append(choice)
    completion = sum(len(o.output_ids) for o in outs)
    return {
        "id": outs[0].rid, "object": "chat.completion", "created": created, "model": call.model, "choices": choices,
        "usage": {"prompt_tokens": len(call.prompt_ids), "total_tokens": len(call.prompt_ids) + completion,
                  "completion_tokens": completion, "prompt_tokens_details": None, "reasoning_tokens": 0,
                  "completion_tokens_details": None},
        "metadata": {"weight_version": spans[-1]["version"], "weight_versions": spans},
    }


class OpenAIChatAPI:
    """The /v1 routes of one EmbeddedEngineServer (server.app() adds them). `version_spans` is the
    server's (weight-version runs over output tokens), passed in so this module does not import it."""

    def __init__(self, server, version_spans: Callable[[list[str], str], list[dict]]) -> None:
        self.server, self.version_spans = server, version_spans
        self.served_name = server.model_path or DEFAULT_MODEL_NAME
        self._end_of_turn: frozenset[int] | None = None

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/chat/completions", self.chat_completions)
        router.add_get("/v1/models", self.models)
        router.add_get("/v1/models/{model:.+}", self.model)

    def _card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
                "parent": None, "max_model_len": self.server.scheduler.context_len}

    async def models(self, _request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card(self.served_name)]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.served_name:
            return web.json_response({"error": {"message": f"The model '{name}' does not exist",
                                                "type": "invalid_request_error", "param": "model",
                                                "code": "model_not_found"}}, status=404)
        return web.json_response(self._card(name))

    async def chat_completions(self, request: web.Request) -> web.Response:
        from agentrl.models.tokenizer import stop_token_ids

        tok = self.server.tokenizer
        if tok is None or getattr(tok, "chat_template", None) is None:
            return openai_error(400, "chat completions need a tokenizer with a chat template; this engine has none")
        if not self.server.scheduler.alive:
            return openai_error(503, "the engine's scheduler thread is not running", "ServiceUnavailable")
        if self._end_of_turn is None:
            self._end_of_turn = frozenset(stop_token_ids(tok))
        created = int(time.time())
        try:
            body = await json_body(request)
            call = parse_chat(body, tokenizer=tok, vocab=self.server.vocab_size,
                              context_len=self.server.scheduler.context_len, end_of_turn=self._end_of_turn,
                              rid=uuid.uuid4().hex)
        except BadRequest as exc:
            return openai_error(400, str(exc))
        try:
            outs = await self.server._submit(call.requests)
        except RuntimeError as exc:  # the scheduler is shutting down
            return openai_error(503, str(exc), "ServiceUnavailable")
        errors = [o.error for o in outs if o.error]
        if errors:
            return openai_error(500, f"Internal server error: {errors[0]}", "InternalServerError")
        spans = self.version_spans(outs[0].weight_versions, outs[0].weight_version)
        return web.json_response(render_chat(call, outs, tok, created, spans))
