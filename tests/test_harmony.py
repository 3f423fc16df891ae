"""The harmony response format (gpt-oss): channels split out of the streamed text the same way
however it is cut, and `serve`'s chat objects carrying them as reasoning_content and content."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moeshard.coordinator.harmony import HarmonyChannels, split
from moeshard.coordinator.serve.replies import ChatReply

ANSWER = (
    "<|channel|>analysis<|message|>The user says hi. Answer <|briefly|>.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! 2 < 3 and a<|b.<|return|>"
)


def test_a_whole_answer_splits_into_reasoning_and_content():
    assert split(ANSWER) == ("The user says hi. Answer <|briefly|>.", "Hello! 2 < 3 and a<|b.")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 64])
def test_any_streaming_cut_gives_the_same_channels(size):
    channels = HarmonyChannels()
    reasoning, content = [], []
    for i in range(0, len(ANSWER), size):
        r, c = channels.feed(ANSWER[i : i + size])
        reasoning.append(r)
        content.append(c)
    r, c = channels.flush()
    assert ("".join(reasoning) + r, "".join(content) + c) == split(ANSWER)


def test_tool_call_preambles_are_content_and_a_cut_answer_is_kept():
    text = (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city":'
    )
    assert split(text) == ("Need the weather.", '{"city":')
    assert split("no harmony at all") == ("", "no harmony at all")
    assert split("<|channel|>analysis<|message|>thinking, cut off") == ("thinking, cut off", "")


def test_serve_chat_objects_carry_the_channels():
    state = SimpleNamespace(model_type="gpt_oss", model_name="gpt-oss", tokenizer=None)
    whole = ChatReply(state).final(ANSWER, "stop", {}, None)["choices"][0]["message"]
    assert whole["reasoning_content"] == "The user says hi. Answer <|briefly|>."
    assert whole["content"] == "Hello! 2 < 3 and a<|b."
    reply = ChatReply(state)
    cut = [ANSWER[:20], ANSWER[20:70], ANSWER[70:]]
    deltas = [
        reply.chunk(part, "stop" if i == 2 else None, None)["choices"][0]["delta"]
        for i, part in enumerate(cut)
    ]
    assert "".join(d["content"] for d in deltas) == whole["content"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
    other = SimpleNamespace(model_type="qwen3_moe", model_name="q", tokenizer=None)
    plain = ChatReply(other).final(ANSWER, "stop", {}, None)["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": ANSWER}
