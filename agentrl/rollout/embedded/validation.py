"""Strict parsing of a /generate body into scheduler requests.

Everything is checked before anything reaches the scheduler, so one malformed request is a 400
naming its field and never an exception inside a running batch: JSON types (a bool is not an int,
`input_ids: [true, false]` is refused), finite numbers (Python's JSON reader accepts NaN and
Infinity), ranges as SGLang 0.5.23's SamplingParams.verify states them (temperature >= 0, top_p in
(0, 1], top_k -1 or >= 1, max_new_tokens >= 0), token ids inside the vocabulary, and no unknown
field (a field the engine would silently ignore could change what the caller thinks was sampled).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from agentrl.rollout.embedded.http_util import BadRequest
from agentrl.rollout.embedded.request import GenRequest
from agentrl.rollout.embedded.sampling import RowParams

# Sampling params that would change the distribution the logprobs describe: only their neutral value.
NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
BOOL_PARAMS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "n",
                 *BOOL_PARAMS, *NEUTRAL}
BODY_KEYS = {"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len", "rid", "stream",
             "return_text_in_logprobs", "log_metrics"}
MAX_N = 1024  # samples per prompt; more is a mistake, not a request
MAX_STOP_STRINGS = 64


@dataclass
class ParsedGenerate:
    requests: list[GenRequest]
    batched: bool  # answer with a list (several prompts or n > 1)
    return_logprob: bool


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _token_list(value: object, field: str, vocab: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{field} must be a non-empty list of token ids")
    for i, t in enumerate(value):
        if not is_int(t) or not 0 <= t < vocab:
            kind = "a bool" if isinstance(t, bool) else repr(t)
            raise BadRequest(f"{field}[{i}] is {kind}, not a token id: send ints in [0, {vocab})")
    return value


def _int(sp: dict, key: str, default: int, lo: int, hi: int | None = None) -> int:
    v = sp.get(key)
    if v is None:
        return default
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"sampling_params.{key}={v!r}: must be an int {rng}")
    return v


def _num(sp: dict, key: str, default: float, ok: Callable[[float], bool], rng: str) -> float:
    v = sp.get(key)
    if v is None:
        return default
    if not is_number(v) or not ok(v):
        raise BadRequest(f"sampling_params.{key}={v!r}: must be a finite number {rng}")
    return float(v)


def _bool(d: dict, key: str, where: str, default: bool = False) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{where}{key}={v!r}: must be true or false")
    return v


def _prompts(body: dict, vocab: int, encode: Callable[[str], list[int]] | None) -> tuple[list[list[int]], bool]:
    ids, text = body.get("input_ids"), body.get("text")
    if ids is not None and text is not None:
        raise BadRequest("send input_ids or text, not both")
    if ids is None and text is None:
        raise BadRequest("input_ids is required (a list of token ids, or a list of such lists)")
    if ids is None:
        if encode is None:
            raise BadRequest("text input needs a tokenizer; this engine has none: send input_ids")
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise BadRequest("text must be a non-empty string or a non-empty list of them")
        return [encode(t) for t in texts], isinstance(text, list)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return [_token_list(seq, f"input_ids[{j}]", vocab) for j, seq in enumerate(ids)], True
    return [_token_list(ids, "input_ids", vocab)], False


def _stops(sp: dict, vocab: int, has_tokenizer: bool) -> tuple[tuple[str, ...], frozenset[int]]:
    stop = sp.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"sampling_params.stop must be a string or a list of at most {MAX_STOP_STRINGS} "
                         "non-empty strings")
    if stop and not has_tokenizer:
        raise BadRequest("sampling_params.stop (strings) needs a tokenizer; use stop_token_ids")
    ids = sp.get("stop_token_ids")
    ids = [] if ids is None else ids
    if not isinstance(ids, list) or not all(is_int(t) and 0 <= t < vocab for t in ids):
        raise BadRequest(f"sampling_params.stop_token_ids must be a list of ints in [0, {vocab})")
    return tuple(stop), frozenset(ids)


def _rids(body: dict, count: int, busy: set[str]) -> list[str]:
    rid = body.get("rid")
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str) and rid:
        rids = [rid] if count == 1 else [f"{rid}-{i}" for i in range(count)]
    elif isinstance(rid, list) and all(isinstance(r, str) and r for r in rid):
        rids = rid
    else:
        raise BadRequest("rid must be a non-empty string or a list of non-empty strings")
    if len(rids) != count or len(set(rids)) != count:
        raise BadRequest(f"rid must be one string or a list of {count} distinct strings")
    running = busy.intersection(rids)
    if running:
        raise BadRequest(f"rid {min(running)!r} is already running")
    return rids


def parse_generate(body: dict, *, vocab: int, context_len: int, encode: Callable[[str], list[int]] | None,
                   busy_rids: set[str]) -> ParsedGenerate:
    """The scheduler requests of one /generate body (on_done left unset); BadRequest if any field is wrong."""
    unknown = sorted(set(body) - BODY_KEYS)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; the embedded engine accepts {sorted(BODY_KEYS)}")
    if _bool(body, "stream", ""):
        raise BadRequest("stream=true is not supported by the embedded engine; use stream=false")
    _bool(body, "return_text_in_logprobs", "")
    _bool(body, "log_metrics", "")
    prompts, batched = _prompts(body, vocab, encode)
    for j, seq in enumerate(prompts):
        if len(seq) >= context_len:
            raise BadRequest(f"prompt {j} of {len(seq)} tokens does not fit the context length {context_len}; "
                             "shorten it")
    sp = body.get("sampling_params")
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    unknown = sorted(set(sp) - SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"sampling_params {unknown} are not supported by the embedded engine")
    for key, neutral in NEUTRAL.items():
        v = sp.get(key)
        if v is not None and (not is_number(v) or v != neutral):
            raise BadRequest(f"sampling_params.{key}={v!r} is not supported (only {neutral})")
    for key in BOOL_PARAMS:
        _bool(sp, key, "sampling_params.")
    max_new = _int(sp, "max_new_tokens", 128, lo=0)
    temperature = _num(sp, "temperature", 1.0, lambda v: v >= 0, ">= 0")
    top_p = _num(sp, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]")
    top_k = _int(sp, "top_k", -1, lo=-1)
    if top_k == 0:
        raise BadRequest("sampling_params.top_k=0: use -1 (the whole vocabulary) or a value >= 1")
    n = _int(sp, "n", 1, lo=1, hi=MAX_N)
    stop, stop_ids = _stops(sp, vocab, encode is not None)
    want_lp = _bool(body, "return_logprob", "")
    start = body.get("logprob_start_len", -1)
    if not is_int(start) or start < -1:
        raise BadRequest(f"logprob_start_len={start!r}: must be an int >= -1")
    if not want_lp:
        start = -1
    rids = _rids(body, len(prompts) * n, busy_rids)
    params = RowParams(temperature, top_p, top_k)
    seqs = [s for s in prompts for _ in range(n)]
    reqs = [GenRequest(rid=rid, input_ids=list(seq), max_new_tokens=max_new, params=params, on_done=None,
                       stop_token_ids=stop_ids, stop_strings=stop, ignore_eos=bool(sp.get("ignore_eos")),
                       logprob_start_len=min(start, len(seq) - 1) if start >= 0 else -1)
            for rid, seq in zip(rids, seqs)]
    return ParsedGenerate(reqs, batched or n > 1, want_lp)
