"""The thinking toggle: thinking is off by default (the prompt closes an empty think block and replies carry no
think tags); chat_template_kwargs.enable_thinking or /invocations' "thinking" turn it on.
"""

from __future__ import annotations

import pytest
from server_harness import http_json

from server.reasoning import ReasoningSplitter

MESSAGES = [{"role": "user", "content": "Think about rivers."}]
EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def rendered(server, tokenizer, body: dict) -> str:
    code, _, data = http_json("POST", server.url + "/tokenize", body)
    assert code == 200 and data["count"] == len(data["tokens"])
    return tokenizer.decode(data["tokens"])


def test_rendered_prompt_has_the_empty_think_block_only_when_thinking_is_off(server, tokenizer):
    off = rendered(server, tokenizer, {"messages": MESSAGES})
    assert off.endswith(EMPTY_THINK)
    explicit_off = rendered(server, tokenizer, {"messages": MESSAGES,
                                                "chat_template_kwargs": {"enable_thinking": False}})
    assert explicit_off == off
    on = rendered(server, tokenizer, {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}})
    assert on.endswith("<|im_start|>assistant\n<think>\n") and "</think>" not in on


@pytest.mark.parametrize("thinking", [False, True])
def test_reply_content_never_carries_think_tags(server, tokenizer, thinking):
    body = {"messages": MESSAGES, "max_tokens": 20, "temperature": 1.0, "seed": 3, "ignore_eos": True, "n": 4,
            "chat_template_kwargs": {"enable_thinking": thinking}}
    code, _, data = http_json("POST", server.url + "/v1/chat/completions", body)
    assert code == 200
    expected = len(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, enable_thinking=thinking,
                                                 return_dict=True)["input_ids"])
    assert data["usage"]["prompt_tokens"] == expected
    for choice in data["choices"]:
        message = choice["message"]
        assert "<think>" not in message["content"] and "</think>" not in message["content"]
        assert ("reasoning_content" in message) == thinking
        if thinking:
            assert "<think>" not in message["reasoning_content"] and "</think>" not in message["reasoning_content"]


def test_splitter_separates_reasoning_from_content_across_pieces():
    split = ReasoningSplitter(thinking=True)
    pieces = [split.feed(t) for t in ("Let me ", "think.</th", "ink>\n\nThe answer", " is <thi", "nk>42")]
    pieces.append(split.flush())
    assert "".join(r for r, _ in pieces) == "Let me think."
    assert "".join(c for _, c in pieces) == "The answer is 42"


def test_splitter_with_thinking_off_keeps_all_text_as_content_without_tags():
    split = ReasoningSplitter(thinking=False)
    pieces = [split.feed(t) for t in ("<think>", "a</think>b ", "c <")]
    pieces.append(split.flush())
    assert "".join(r for r, _ in pieces) == ""
    assert "".join(c for _, c in pieces) == "ab c <"
