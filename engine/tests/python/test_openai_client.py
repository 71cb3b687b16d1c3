"""The official OpenAI Python client against `slipway-engine serve`, or against
`slipway-router` in front of two engines (both started by run-openai-client): chat and
completions, streaming and not, usage present (also on streams with
stream_options.include_usage), stop strings honoured.

Nothing here skips: a missing server URL is a failure.
"""

import os

import openai
import pytest

BASE_URL = os.environ.get("SLIPWAY_BASE_URL")
MODEL = os.environ.get("SLIPWAY_MODEL_NAME", "smollm2")


@pytest.fixture(scope="module")
def client():
    assert BASE_URL, "SLIPWAY_BASE_URL is not set: run engine/tests/python/run-openai-client"
    return openai.OpenAI(base_url=BASE_URL, api_key="test-key", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_with_usage_equals_non_streaming(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}],
        max_tokens=10,
        temperature=0,
    )
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == whole.usage.completion_tokens


def test_completions_streaming_and_not(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion"
    assert whole.usage.completion_tokens > 0
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert any(c.usage is not None and c.usage.completion_tokens == whole.usage.completion_tokens for c in chunks)


def test_stop_strings_are_honoured(client):
    kw = dict(model=MODEL, prompt="Count: one, two, three, four, five,", max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[len(words) // 2]
    want = full[: full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(stream=True, stop=[stop], **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
        else:
            r = client.completions.create(stop=stop, **kw)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert text == want, (stream, stop, text, full)
        assert stop not in text
        assert reason == "stop"


def test_errors_surface_as_openai_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
