"""The OpenAI surface of the sim engine, checked with the official `openai` client: every
check either gets a well-formed answer in vLLM's response shapes or the refusal vLLM
itself gives (its message, type "BadRequestError", status 400), or, where vLLM would
honour a field the sim cannot produce (structured output, generated tool calls), an
explicit 400 naming the field — never a silent ignore.

vLLM facts used (vLLM's OpenAI server, read for its behaviour): chat logprobs are
`{"content": [{token, logprob, bytes, top_logprobs: [k × {token, logprob, bytes}]}]}`,
completions logprobs `{text_offset, token_logprobs, tokens, top_logprobs: [dict]}` with
max(k, 1) entries per dict (the sampled token is among the top); `--max-logprobs`
defaults to 20; completions `echo` puts the prompt before the text (streamed: with the
first token) and, with logprobs, the prompt's tokens first, the first one without a
log-probability (None); chat `echo` prepends the last message when it is the
assistant's; `tools` without `tool_choice` mean "auto", which a server started without
`--enable-auto-tool-choice` refuses.

Synthetic logprob values (`engine.synthetic.top_logprobs`): the sampled token's
probability p0 = 0.5 + 0.04 · (key mod 10), rank r has (1 − p0) · 0.5^r; the first
output token " the" has key crc32(b" the") + 0, and crc32(b" the") mod 10 = 0, so its
logprob is ln 0.5 and its runner-up's ln 0.25 (hand-computed from the rule).
"""

from __future__ import annotations

import math
import zlib

import pytest

from rps_astro_cli.engine.synthetic import WORDS, synthetic_text
from test_sim_engine_server import MODEL, make_profile, serve

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(60)

MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def client():
    with serve(make_profile(max_model_len=256), time_scale=0.01) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=10)


def refused(fn, message: str, param: str | None, vllm_type: bool = True) -> None:
    """`fn` raises a 400 with this message (vLLM's own when `vllm_type`) naming `param`."""
    with pytest.raises(openai.BadRequestError) as e:
        fn()
    body = e.value.body
    assert e.value.status_code == 400 and body["param"] == param, body
    assert message in body["message"], body
    if vllm_type:
        assert body["type"] == "BadRequestError", body


def chat(c, **kw):
    return c.chat.completions.create(model=MODEL, messages=kw.pop("messages", MSG),
                                     max_tokens=kw.pop("max_tokens", 4), **kw)


def cmpl(c, **kw):
    return c.completions.create(model=MODEL, prompt=kw.pop("prompt", "hi"), max_tokens=kw.pop("max_tokens", 4),
                                **kw)


def well_formed_top(entries: list[tuple[str, float]], sampled: str, k: int) -> None:
    """The sampled token first, k (or 1) distinct tokens, logprobs ≤ 0 falling, Σp < 1."""
    assert len(entries) == k and len({t for t, _ in entries}) == k
    if k:
        assert entries[0][0] == sampled
    lps = [lp for _, lp in entries]
    assert all(lp <= 0 for lp in lps) and lps == sorted(lps, reverse=True)
    assert sum(math.exp(lp) for lp in lps) < 1.0


# -- the checks ------------------------------------------------------------------------
def check_models_list(c):
    assert [m.id for m in c.models.list().data] == [MODEL]


def check_models_retrieve(c):
    assert c.models.retrieve(MODEL).id == MODEL


def check_models_unknown(c):
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")


def check_chat(c):
    r = chat(c, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == synthetic_text(4) and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4 and r.choices[0].logprobs is None


def check_chat_stream_usage(c):
    chunks = list(chat(c, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == synthetic_text(4)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def check_completion(c):
    r = cmpl(c, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].text == synthetic_text(4) and r.usage.completion_tokens == 4


def check_completion_stream_usage(c):
    chunks = list(cmpl(c, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == synthetic_text(4)
    assert chunks[-1].usage.completion_tokens == 4


def check_max_completion_tokens(c):
    r = c.chat.completions.create(model=MODEL, messages=MSG, max_completion_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def check_stop(c):
    r = chat(c, max_tokens=10, stop=[" and"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (" the of", "stop")


def check_n(c):
    r = chat(c, n=3, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 12


def check_n_greedy_refused(c):
    refused(lambda: chat(c, n=2, temperature=0), "n must be 1 when using greedy sampling", "n", vllm_type=False)


def check_seed(c):
    a, b = (chat(c, max_tokens=20, seed=5).choices[0].message.content for _ in range(2))
    assert a == b


def check_chat_logprobs_no_top(c):
    r = chat(c, logprobs=True, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == list(WORDS[:4]) and all(e.top_logprobs == [] for e in content)
    assert content[0].logprob == pytest.approx(math.log(0.5)) and content[0].bytes == list(b" the")


def check_chat_top_logprobs(c):
    r = chat(c, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        top = [(t.token, t.logprob) for t in e.top_logprobs]
        well_formed_top(top, e.token, 3)
        assert top[0][1] == e.logprob and all(t.bytes == list(t.token.encode()) for t in e.top_logprobs)
    assert zlib.crc32(b" the") % 10 == 0  # the hand computation's premise
    assert [lp for _, lp in [(t.token, t.logprob) for t in content[0].top_logprobs]][:2] == \
        pytest.approx([math.log(0.5), math.log(0.25)])


def check_chat_logprobs_stream(c):
    whole = chat(c, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}).choices[0].logprobs.content
    got = []
    for ch in chat(c, logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True}):
        d = ch.choices[0]
        if d.delta.role:
            assert d.logprobs is None  # the role chunk carries no token
            continue
        assert len(d.logprobs.content) == 1 and d.logprobs.content[0].token == d.delta.content
        got.append(d.logprobs.content[0])
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in got] == \
        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in whole]


def check_completion_logprobs(c):
    r = cmpl(c, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == list(WORDS[:4]) and lp.text_offset == [0, 4, 7, 11]  # " the", " of", " and", " to"
    for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        well_formed_top(list(top.items()), t, 2)
        assert top[t] == v


def check_completion_logprobs_zero(c):
    lp = cmpl(c, logprobs=0, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert all(list(top) == [t] for t, top in zip(lp.tokens, lp.top_logprobs))


def check_completion_logprobs_stream(c):
    offsets, tokens = [], []
    for ch in cmpl(c, logprobs=1, stream=True, extra_body={"ignore_eos": True}):
        lp = ch.choices[0].logprobs
        assert lp.tokens == [ch.choices[0].text]
        offsets += lp.text_offset
        tokens += lp.tokens
    assert tokens == list(WORDS[:4]) and offsets == [0, 4, 7, 11]


def check_echo(c):
    r = cmpl(c, prompt="abcd efgh", echo=True, extra_body={"ignore_eos": True})
    assert r.choices[0].text == "abcd efgh" + synthetic_text(4) and r.usage.completion_tokens == 4
    assert r.usage.prompt_tokens == 2


def check_echo_logprobs(c):
    lp = cmpl(c, prompt="abcd efgh", echo=True, logprobs=1, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert lp.tokens == ["abcd", "efgh", *WORDS[:4]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [0, 4, 8, 12, 15, 19]


def check_echo_stream(c):
    chunks = [ch.choices[0] for ch in cmpl(c, prompt="abcd efgh", echo=True, logprobs=0, stream=True,
                                           extra_body={"ignore_eos": True})]
    assert chunks[0].text == "abcd efgh the" and chunks[0].logprobs.tokens == ["abcd", "efgh", " the"]
    assert chunks[0].logprobs.text_offset == [0, 4, 8]
    assert chunks[1].logprobs.text_offset == [len("abcd efgh the")]  # vLLM: the streamed text's length so far
    assert "".join(ch.text for ch in chunks) == "abcd efgh" + synthetic_text(4)


def check_chat_echo(c):
    msgs = [*MSG, {"role": "assistant", "content": "Sure:"}]
    r = chat(c, messages=msgs, extra_body={"echo": True, "ignore_eos": True})  # vLLM's extension field
    assert r.choices[0].message.content == "Sure:" + synthetic_text(4)
    plain = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, extra_body={"echo": True,
                                                                                          "ignore_eos": True})
    assert plain.choices[0].message.content == synthetic_text(4)  # last message not the assistant's: nothing
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=4, stream=True, extra_body={"echo": True, "ignore_eos": True})]
    assert parts[:2] == ["", "Sure:"] and "".join(parts) == "Sure:" + synthetic_text(4)


def check_top_logprobs_needs_logprobs(c):
    refused(lambda: chat(c, top_logprobs=2), "when using `top_logprobs`, `logprobs` must be set to true.",
            "top_logprobs")


def check_max_logprobs(c):
    msg = "Requested sample logprobs of 21, which is greater than max allowed: 20"
    refused(lambda: chat(c, logprobs=True, top_logprobs=21), msg, "logprobs")
    refused(lambda: cmpl(c, logprobs=21), msg, "logprobs")


def check_negative_logprobs(c):
    refused(lambda: cmpl(c, logprobs=-2), "`logprobs` must be a positive value or -1.", "logprobs")


def check_stream_options_without_stream(c):
    refused(lambda: chat(c, stream_options={"include_usage": True}),
            "Stream options can only be defined when `stream=True`.", "stream_options")


def check_tools_auto(c):
    refused(lambda: chat(c, tools=[TOOL]),
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', None)


def check_tool_choice_none(c):
    r = chat(c, tools=[TOOL], tool_choice="none", extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == synthetic_text(4) and not r.choices[0].message.tool_calls


def check_tool_choice_required_refused(c):
    refused(lambda: chat(c, tools=[TOOL], tool_choice="required"), "tool calls are not generated", "tool_choice",
            vllm_type=False)


def check_tool_choice_unknown_function(c):
    refused(lambda: chat(c, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "other"}}),
            "The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")


def check_tool_choice_without_tools(c):
    refused(lambda: chat(c, tool_choice="required"), "When using `tool_choice`, `tools` must be set.", "tool_choice")


def check_empty_tools(c):
    refused(lambda: chat(c, tools=[]), "`tools` must not be an empty array.", "tools")


def check_response_format_text(c):
    assert chat(c, response_format={"type": "text"}).choices[0].message.content


def check_response_format_json_refused(c):
    refused(lambda: chat(c, response_format={"type": "json_object"}), "structured output ('json_object')",
            "response_format", vllm_type=False)
    refused(lambda: cmpl(c, extra_body={"response_format": {"type": "json_object"}}), "structured output",
            "response_format", vllm_type=False)


def check_json_schema_without_schema(c):
    refused(lambda: chat(c, response_format={"type": "json_schema"}),
            "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
            "response_format")


CHECKS = {name[len("check_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("check_")}


def test_the_suite_covers_the_surface():
    assert len(CHECKS) >= 31, sorted(CHECKS)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_openai_client_check(client, name):
    CHECKS[name](client)
