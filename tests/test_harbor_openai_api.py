"""The embedded engine's OpenAI-compatible chat API (SGLang 0.5.23's shapes), which Harbor's
Terminus-2 reaches through LiteLLM: same tokens and logprobs as /generate on the same prompt, the
prompt agentrl's own agent would build, SGLang's stop trimming, errors and model cards."""

from __future__ import annotations

import httpx
import pytest
import torch

from agentrl.agent.chat import ChatTokens

SYSTEM, USER = "You are a shell agent.", "Write hello to /app/a.txt"


@pytest.fixture(scope="module")
def tokenizer():
    from agentrl.models.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture
async def engine(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.rollout.embedded.server import EmbeddedEngineServer

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=None, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    server = EmbeddedEngineServer(model, tokenizer, model_path="tiny-chat")
    url = await server.start()
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        yield client
    await server.stop()


def chat(**kw) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], **kw}


async def test_chat_completion_is_generate_on_agentrls_own_prompt(engine, tokenizer):
    r = await engine.post("/v1/chat/completions", json=chat(model="m", temperature=0, max_tokens=12, logprobs=True,
                                                          return_token_ids=True, ignore_eos=True))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "m" and body["metadata"]["weight_version"] == "0"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
    prompt = ChatTokens(tokenizer, SYSTEM).prompt_ids(USER)
    assert choice["prompt_token_ids"] == prompt  # exactly what agentrl's agent sends to /generate
    ids = choice["response_token_ids"]
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12, "total_tokens": len(prompt) + 12,
                             "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}
    native = (await engine.post("/generate", json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})).json()
    assert native["output_ids"] == ids
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert lps == pytest.approx([x[0] for x in native["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert choice["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)


async def test_stop_strings_and_end_of_turn_are_trimmed_as_sglang_does(engine, tokenizer):
    first = (await engine.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=12, ignore_eos=True,
                                                                 return_token_ids=True))).json()["choices"][0]
    text = first["message"]["content"]
    stop = text[3:5]
    assert stop and stop not in text[:3]
    cut = (await engine.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=12, ignore_eos=True,
                                                               stop=[stop]))).json()["choices"][0]
    assert (cut["finish_reason"], cut["matched_stop"]) == ("stop", stop)
    assert cut["message"]["content"] == text[: text.find(stop)]
    kept = (await engine.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=12, ignore_eos=True,
                                                                stop=[stop], no_stop_trim=True))).json()["choices"][0]
    assert kept["message"]["content"].endswith(stop)
    tok = first["response_token_ids"][2]
    by_id = (await engine.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=12, ignore_eos=True,
                                                                 stop_token_ids=[tok],
                                                                 return_token_ids=True))).json()["choices"][0]
    assert by_id["matched_stop"] == tok and by_id["response_token_ids"][-1] == tok
    assert by_id["message"]["content"] == tokenizer.decode(by_id["response_token_ids"][:-1], skip_special_tokens=True)


async def test_models_and_errors_have_sglangs_shapes(engine):
    cards = (await engine.get("/v1/models")).json()
    assert cards["object"] == "list" and [c["id"] for c in cards["data"]] == ["tiny-chat"]
    assert cards["data"][0]["max_model_len"] == 512
    assert (await engine.get("/v1/models/tiny-chat")).json()["id"] == "tiny-chat"
    assert (await engine.get("/v1/models/other")).status_code == 404
    for body, says in [
        ({"messages": []}, "Messages cannot be empty."),
        (chat(stream=True), "stream=true"),
        (chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
        (chat(frequency_penalty=0.5), "frequency_penalty"),
        (chat(temperature="hot"), "temperature"),
        (chat(best_of=2), "best_of"),
        (chat(max_tokens=500), "Requested token count exceeds the model's maximum context length of 512"),
        ({"messages": [{"role": "user", "content": "word " * 600}]}, "is longer than the model's context length"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0]"),
    ]:
        r = await engine.post("/v1/chat/completions", json=body)
        err = r.json()
        assert r.status_code == 400 and err["object"] == "error" and err["code"] == 400, (body, r.text)
        assert says in err["message"], (says, err["message"])


@pytest.mark.slow  # importing LiteLLM alone takes ~5-9 s here
async def test_an_openai_client_gets_its_answer_through_litellm(engine, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-list download at import
    litellm = pytest.importorskip("litellm", reason="LiteLLM comes with the optional harbor extra")
    resp = await litellm.acompletion(model="openai/tiny-chat", api_base=f"{engine.base_url}/v1", api_key="none",
                                     messages=chat()["messages"], max_tokens=8, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert isinstance(resp.choices[0].message.content, str) and resp.usage.completion_tokens <= 8
