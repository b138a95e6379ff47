"""OpenAI request validation and tokenisation before anything is allocated, and the OpenAI
error JSON it maps to (vLLM's shapes and status codes)."""

from __future__ import annotations

import pytest

from prefill_node.model.tokenizer import Tokenizer
from prefill_node.openai_api.errors import BadRequest, ModelNotFound
from tests.tiny_models import WORDS, save_word_tokenizer
from wavepp_gateway.openai_request import Route, parse_body, parse_request


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("words")
    save_word_tokenizer(root, 64)
    return Tokenizer.from_dir(root)


def parse(tokenizer, body, route=Route.COMPLETIONS, max_model_len=32):
    return parse_request(route, body, served_model="tiny", max_model_len=max_model_len,
                         default_max_tokens=16, tokenizer=tokenizer)  # fmt: skip


def ids(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


def test_text_and_token_prompts_tokenise_once(tokenizer):
    req = parse(tokenizer, {"model": "tiny", "prompt": "what is the capital", "max_tokens": 4})
    assert req.prompt_ids == tuple(ids("what", "is", "the", "capital"))
    assert (req.stream, req.max_tokens, req.cache_salt) == (False, 4, None)
    same = parse(tokenizer, {"model": "tiny", "prompt": [[6, 7, 8, 9]], "stream": True})
    assert same.prompt_ids == req.prompt_ids and same.stream and same.max_tokens == 16


def test_chat_renders_the_template_like_the_decode_side(tokenizer):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "what is"},
                                             {"type": "text", "text": "france ?"}]}]  # fmt: skip
    req = parse(tokenizer, {"model": "tiny", "messages": messages, "cache_salt": "t1"},
                Route.CHAT)  # fmt: skip
    rendered = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "what is\nfrance ?"}]  # fmt: skip
    expected = tokenizer.encode_chat(rendered)
    assert req.prompt_ids == tuple(expected) and req.cache_salt == "t1"
    assert req.prompt_ids[0] == WORDS.index("<|system|>")
    assert req.prompt_ids[-1] == WORDS.index("<|assistant|>")
    assert req.max_tokens == 32 - len(expected)  # no limit: the rest of the context


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny", "prompt": ""}, "prompt"),
        ({"model": "tiny", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "tiny", "prompt": [1, -2]}, "prompt"),
        ({"model": "tiny", "prompt": "what", "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "prompt": "what", "max_tokens": 1.5}, "max_tokens"),
        ({"model": "tiny", "prompt": "what", "temperature": -0.1}, "temperature"),
        ({"model": "tiny", "prompt": "what", "top_p": 0}, "top_p"),
        ({"model": "tiny", "prompt": "what", "top_p": True}, "top_p"),
        ({"model": "tiny", "prompt": "what", "top_k": -2}, "top_k"),
        ({"model": "tiny", "prompt": "what", "presence_penalty": 3}, "presence_penalty"),
        ({"model": "tiny", "prompt": "what", "n": 2}, "n"),
        ({"model": "tiny", "prompt": "what", "stop": [1]}, "stop"),
        ({"model": "tiny", "prompt": "what", "stream": "yes"}, "stream"),
        ({"model": "tiny", "prompt": "what", "cache_salt": ""}, "cache_salt"),
        ({"model": "tiny", "prompt": "what " * 20, "max_tokens": 13}, "prompt"),
    ],
)
def test_bad_completion_requests_are_400_naming_the_parameter(tokenizer, body, param):
    with pytest.raises(BadRequest) as err:
        parse(tokenizer, body)
    assert err.value.param == param
    error = err.value.body()["error"]
    assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, param)


def test_the_context_limit_counts_prompt_and_completion(tokenizer):
    assert parse(tokenizer, {"model": "tiny", "prompt": "what " * 20, "max_tokens": 12})
    with pytest.raises(BadRequest, match="maximum context length is 32 tokens"):
        parse(tokenizer, {"model": "tiny", "prompt": "what " * 32})


@pytest.mark.parametrize(
    "messages",
    [None, [], ["hello"], [{"content": "x"}], [{"role": "user", "content": {"a": 1}}],
     [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]],
)  # fmt: skip
def test_bad_chat_messages_are_400(tokenizer, messages):
    with pytest.raises(BadRequest) as err:
        parse(tokenizer, {"model": "tiny", "messages": messages}, Route.CHAT)
    assert err.value.param == "messages"


def test_an_unknown_model_is_404_as_vllm_answers_it(tokenizer):
    with pytest.raises(ModelNotFound) as err:
        parse(tokenizer, {"model": "gpt-4", "prompt": "what"})
    assert err.value.body() == {"error": {
        "message": "The model `gpt-4` does not exist. Valid aliases: tiny.",
        "type": "NotFoundError", "param": "model", "code": 404}}  # fmt: skip


@pytest.mark.parametrize("raw", [b"{bad", b"[1, 2]", b"\xff\xfe", b""])
def test_a_body_that_is_not_a_json_object_is_400(raw):
    with pytest.raises(BadRequest):
        parse_body(raw)
