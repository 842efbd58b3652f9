"""Request parsing/validation of the OpenAI-compatible API (pure functions, no server)."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest

from rps_astro_cli.protocol.media import check_media_url, vision_charge
from rps_astro_cli.protocol.openai import (
    chat_prompt_tokens,
    decode_json_body,
    parse_chat_request,
    parse_completion_request,
    resolve_max_tokens,
)
from rps_astro_cli.protocol.openai_types import ApiError, ApiLimits, ParsedRequest
from rps_astro_cli.sim.profile import VisionCosts


def tiny_png() -> bytes:
    """A valid 1×1 grey PNG built with the standard library."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00\x80")) + chunk(b"IEND", b""))


PNG_URL = "data:image/png;base64," + base64.b64encode(tiny_png()).decode()
MP4_URL = "data:video/mp4;base64," + base64.b64encode(b"\x00\x00\x00\x18ftypmp42" + bytes(16)).decode()
VISION = VisionCosts(tokens_per_image=100, tokens_per_frame=10, preprocess_s_per_image=0.2,
                     preprocess_s_per_frame=0.05, encoder_s_per_image=0.3, encoder_s_per_frame=0.02)


def err(fn, *a, **k) -> ApiError:
    with pytest.raises(ApiError) as ei:
        fn(*a, **k)
    return ei.value


def test_chat_token_count_by_hand():
    # fallback: word = ceil(len/4) tokens, symbol = 1.  "You are terse." = 1+1+2+1 = 5;
    # "system" = 2, "user" = 1, "hello world" = 2+2 = 4.
    # total = primer 3 + (3 + 2 + 5) + (3 + 1 + 4) = 21
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello world"}]
    assert chat_prompt_tokens(msgs) == (21, 0, 0)
    # text parts count the same as a string; an image part adds no text tokens
    msgs2 = [{"role": "user", "content": [{"type": "text", "text": "hello world"},
                                          {"type": "image_url", "image_url": {"url": PNG_URL}}]}]
    assert chat_prompt_tokens(msgs2) == (3 + 3 + 1 + 4, 1, 0)


def test_video_frames_default_and_explicit():
    msgs = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": MP4_URL}},
        {"type": "video_url", "video_url": {"url": MP4_URL, "num_frames": 8}}]}]
    req = parse_chat_request({"messages": msgs})
    assert (req.num_images, req.num_frames, req.modality) == (0, 32 + 8, "video")
    ch = vision_charge(req, VISION)
    assert ch.vision_tokens == 400
    assert ch.preprocess_s == pytest.approx(40 * 0.05)
    assert ch.encoder_s == pytest.approx(40 * 0.02)


def test_image_charge_and_text_only_profile():
    req = parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": PNG_URL}},
        {"type": "image_url", "image_url": PNG_URL}]}]})
    ch = vision_charge(req, VISION)
    assert (ch.vision_tokens, ch.preprocess_s, ch.encoder_s) == (200, pytest.approx(0.4), pytest.approx(0.6))
    e = err(vision_charge, req, None)
    assert e.status_code == 400 and e.param == "messages" and "text-only" in e.message


def test_completion_prompt_forms():
    assert parse_completion_request({"prompt": "hello world"}).text_tokens == 4
    assert parse_completion_request({"prompt": [1, 2, 3]}).text_tokens == 3
    assert parse_completion_request({"prompt": ["abcd abcd"]}).text_tokens == 2
    assert err(parse_completion_request, {"prompt": ["a", "b"]}).param == "prompt"
    assert err(parse_completion_request, {"prompt": ""}).param == "prompt"
    assert err(parse_completion_request, {}).param == "prompt"
    assert err(parse_completion_request, {"prompt": 5}).param == "prompt"


def test_scalar_fields():
    r = parse_completion_request({"prompt": "x", "max_completion_tokens": 7, "ignore_eos": True,
                                  "stream": True, "stream_options": {"include_usage": True},
                                  "vllm_xargs": {"astro_output_tokens": 9,
                                                 "astro_predicted_output_tokens": 11,
                                                 "astro_class": "rocks"}})
    assert (r.max_tokens, r.ignore_eos, r.stream, r.include_usage) == (7, True, True, True)
    assert (r.output_tokens, r.predicted_output_tokens, r.req_class) == (9, 11, "rocks")
    for body, param in (
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "n": 2, "temperature": 0.0}, "n"), ({"prompt": "x", "n": 16385}, "n"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "vllm_xargs": {"astro_class": "gravel"}}, "vllm_xargs.astro_class"),
        ({"prompt": "x", "vllm_xargs": {"astro_output_tokens": 0}}, "vllm_xargs.astro_output_tokens"),
    ):
        e = err(parse_completion_request, body)
        assert (e.status_code, e.param) == (400, param), body


def test_body_decoding():
    assert decode_json_body(b'{"a": 1}') == {"a": 1}
    assert err(decode_json_body, b"{nope").param == "body"
    assert err(decode_json_body, b"[1, 2]").param == "body"
    assert err(decode_json_body, b'{"a": "' + b"x" * 100 + b'"}', 50).status_code == 413


def test_media_urls():
    check_media_url(PNG_URL, "image", "p")
    check_media_url(MP4_URL, "video", "p")
    for url, why in (
        ("data:image/png;base64,@@@@", "does not decode"),
        ("data:image/png;base64," + base64.b64encode(b"hello world").decode(), "not a supported"),
        # a PNG header with a truncated body: magic bytes right, the image unreadable
        ("data:image/png;base64," + base64.b64encode(tiny_png()[:30]).decode(), "not a supported"),
        ("data:image/png,rawtext", "expected data"),
        ("file:///etc/passwd", "refused"),
        ("/etc/passwd", "refused"),
        ("http://example.com/cat.png", "disabled"),
    ):
        e = err(check_media_url, url, "image", "messages[0].content[1].image_url.url")
        assert e.status_code == 400 and why in e.message, url
        assert e.param == "messages[0].content[1].image_url.url"
    on = ApiLimits(allow_remote_media=True)
    for url in ("http://127.0.0.1/a.png", "http://10.1.2.3/a.png", "http://169.254.169.254/latest",
                "http://[::1]/a.png", "https://localhost/a.png"):
        assert "non-public" in err(check_media_url, url, "image", "u", on).message, url
    check_media_url("https://93.184.216.34/a.png", "image", "u", on)  # public literal: accepted


def test_media_item_and_frame_bounds():
    lim = ApiLimits(max_media_items=2, max_num_frames=16)
    parts = [{"type": "image_url", "image_url": {"url": PNG_URL}}] * 3
    assert err(chat_prompt_tokens, [{"role": "user", "content": parts}], limits=lim).param == \
        "messages[0].content[2]"
    v = [{"type": "video_url", "video_url": {"url": MP4_URL, "num_frames": 17}}]
    assert err(chat_prompt_tokens, [{"role": "user", "content": v}], limits=lim).param == \
        "messages[0].content[0].video_url.num_frames"
    assert err(chat_prompt_tokens, [{"role": "user", "content": [{"type": "input_audio"}]}]).param == \
        "messages[0].content[0].type"
    assert err(chat_prompt_tokens, [{"role": "robot", "content": "x"}]).param == "messages[0].role"
    assert err(chat_prompt_tokens, []).param == "messages"


def test_context_limit_like_vllm():
    r = ParsedRequest(endpoint="completions", model=None, text_tokens=100)
    assert resolve_max_tokens(r, 100, 4096) == 3996  # default: the rest of the context
    r2 = ParsedRequest(endpoint="chat", model=None, text_tokens=100, max_tokens=50)
    assert resolve_max_tokens(r2, 100, 150) == 50  # exactly at the limit is fine
    assert err(resolve_max_tokens, r2, 100, 149).param == "max_tokens"
    assert err(resolve_max_tokens, r2, 150, 150).param == "messages"
    assert err(resolve_max_tokens, r, 5000, 4096).param == "prompt"
