"""vLLM's request rules for the fields the sim engine cannot simply ignore (stream
options, log-probabilities, tools, structured output), with vLLM's own messages
(`_vllm_error`), then the sim engine's explicit refusals of what it does not simulate:
`refuse_unsimulated` (called by the sim engine before `protocol/openai.py` parses the
body). The sampling fields' type/range checks are `protocol.openai.check_sampling_fields`.
"""

from __future__ import annotations

from typing import Any

from rps_astro_cli.protocol.openai_types import _vllm_error, bad

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: the most log-probabilities per token a request may ask for


def _check_logprobs(body: dict[str, Any], endpoint: str) -> None:
    """vLLM's log-probability rules (its request validators and `--max-logprobs` 20):
    chat `top_logprobs` ≥ 0 (or -1) and only with `logprobs: true`; completions
    `logprobs` ≥ 0 (or -1); at most `MAX_LOGPROBS` per token (-1, the whole vocabulary,
    is more than that)."""
    fields = ("top_logprobs",) if endpoint == "chat" else ("logprobs",)
    for key in fields:
        v = body.get(key)
        if v is None or isinstance(v, bool):
            continue
        if not isinstance(v, (int, float)):
            raise _vllm_error(f"`{key}` must be an integer.", key)
        if v < 0 and v != -1:
            raise _vllm_error(f"`{key}` must be a positive value or -1.", key)
    if endpoint == "chat":
        top = body.get("top_logprobs")
        if isinstance(top, (int, float)) and not isinstance(top, bool) and (top == -1 or top > 0) \
                and not body.get("logprobs"):
            raise _vllm_error("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        n = top if body.get("logprobs") is True and isinstance(top, (int, float)) and not isinstance(top, bool) \
            else None
    else:
        lp = body.get("logprobs")
        n = lp if isinstance(lp, (int, float)) and not isinstance(lp, bool) else None
    if n is not None and (n == -1 or n > MAX_LOGPROBS):
        asked = "the whole vocabulary (-1)" if n == -1 else f"{int(n)}"
        raise _vllm_error(f"Requested sample logprobs of {asked}, which is greater than max allowed: "
                          f"{MAX_LOGPROBS}", "logprobs")


def _check_tools(body: dict[str, Any]) -> str | None:
    """vLLM's `tools` / `tool_choice` rules (`check_tool_usage`): an empty list refused;
    tools without tool_choice mean "auto"; a tool_choice needs tools, must be "none",
    "auto", "required" or a named function among them. Returns the effective
    tool_choice (None: no tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools == []:
        raise _vllm_error("`tools` must not be an empty array. Either provide at least one tool or omit the "
                          "field entirely.", "tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)):
        raise bad('must be a list of {"type": "function", "function": {"name", "parameters"}} objects', "tools")
    if "tool_choice" not in body and tools:
        choice = "auto"
    if choice is None or choice == "none":
        return "none" if tools else None
    if not tools:
        raise _vllm_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise _vllm_error(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or "
                          "\"required\" are supported.", "tool_choice")
    if isinstance(choice, dict):
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        fn = choice.get("function")
        if not isinstance(fn, dict):
            raise _vllm_error(f"Invalid value for `function`: `{fn}` in `tool_choice`! {usage}",
                              "tool_choice.function")
        if "name" not in fn:
            raise _vllm_error(f"Expected field `name` in `function` in `tool_choice`! {usage}",
                              "tool_choice.function.name")
        if not any(t["function"]["name"] == fn["name"] for t in tools):
            raise _vllm_error("The tool specified in `tool_choice` does not match any of the specified `tools`",
                              "tool_choice")
        return "named"
    return str(choice)


def refuse_unsimulated(body: dict[str, Any], endpoint: str) -> None:
    """vLLM's request rules for the fields below, with its messages (`_vllm_error`), then
    the sim engine's explicit refusals of what it cannot produce — never a silent ignore:

    - `stream_options` without `stream: true`: refused as vLLM refuses it.
    - log-probabilities: vLLM's rules (`_check_logprobs`); honoured (synthetic values:
      `engine.synthetic.top_logprobs`).
    - `tools` / `tool_choice` (chat): vLLM's rules (`_check_tools`). "none" is honoured
      as vLLM does (the tools are not used; plain text). "auto" (the default when tools
      are given) is refused with the message of a vLLM started without
      `--enable-auto-tool-choice`, which the sim engine is; "required" or a named
      function (vLLM generates the call with structured outputs) is refused: the sim
      engine does not generate tool calls.
    - `response_format` (both endpoints): "text" honoured; "json_schema" without its
      schema refused as vLLM does; "json_object" / "json_schema" / "structural_tag"
      refused: the sim engine does not do structured output.
    - `echo` is honoured (completions: the prompt before the text, with its logprobs;
      chat: vLLM's meaning, the last message's content before the reply when that
      message is the assistant's).

    Raises:
        ApiError: 400 naming the field.
    """
    so = body.get("stream_options")
    if so and not body.get("stream"):
        raise _vllm_error("Stream options can only be defined when `stream=True`.", "stream_options")
    _check_logprobs(body, endpoint)
    how = "the sim engine does not simulate it (a vLLM engine does: astro serve --backend vllm)"
    rf = body.get("response_format")
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_schema" and rf.get("json_schema") is None:
            raise _vllm_error("When response_format type is 'json_schema', the 'json_schema' field must be "
                              "provided.", "response_format")
        if kind not in (None, "text"):
            raise bad(f"structured output ({kind!r}) is not supported: {how}", "response_format")
    if endpoint == "chat":
        choice = _check_tools(body)
        if choice == "auto":
            raise _vllm_error('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                              "be set", None)
        if choice in ("required", "named"):
            raise bad(f"tool calls are not generated (tool_choice {body.get('tool_choice')!r}): {how}",
                      "tool_choice")
    elif body.get("tools") is not None:
        raise bad("is a chat-completions field; /v1/completions has no tools", "tools")
