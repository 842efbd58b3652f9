"""Media in OpenAI chat requests: the URL checks (`check_media_url`) and what a request's
media cost on a profile (`VisionCharge`, `vision_charge`).

Media URLs (ARCHITECTURE.md §7): `data:` URLs are decoded and checked (base64 + a known image /
video container; Pillow verifies images when installed); remote `http(s)` URLs are refused
unless `ApiLimits.allow_remote_media`, and even then never to loopback, private,
link-local or reserved addresses (the sim engine does not download them: it only needs
their token count); `file://` and bare paths are refused.

Media tokens (chat only): images × `vision.tokens_per_image` + frames ×
`vision.tokens_per_frame` from the profile (`VisionCosts`), with the preprocessing and
vision-encoder time the sim engine and the tagger charge (`vision_charge`).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from rps_astro_cli.protocol.openai_types import ApiLimits, ParsedRequest, bad
from rps_astro_cli.sim.profile import VisionCosts

_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM")


def _looks_like(kind: str, data: bytes) -> bool:
    if kind == "image":
        if data.startswith(_IMAGE_MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP"):
            return True
        return False
    return (data[4:8] == b"ftyp" or data.startswith(b"\x1a\x45\xdf\xa3")
            or (data[:4] == b"RIFF" and data[8:12] == b"AVI "))


def _verify_image(data: bytes) -> bool:
    try:
        from PIL import Image  # optional; ships with matplotlib
    except ImportError:  # pragma: no cover
        return True
    import io

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.verify()
        return True
    except Exception:
        return False


def check_media_url(url: str, kind: str, param: str, limits: ApiLimits = ApiLimits()) -> None:
    """Accept a media URL per ARCHITECTURE.md §7 or raise.

    kind: "image" or "video". param: the field path to name in errors.

    Raises:
        ApiError: 400 for undecodable data, refused schemes, disabled or non-public
            remote URLs.
    """
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head:
            raise bad(f"unreadable {kind}: expected data:<mime>;base64,<data>", param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad(f"unreadable {kind}: the base64 payload does not decode", param) from None
        if not data or not _looks_like(kind, data) or (kind == "image" and not _verify_image(data)):
            raise bad(f"unreadable {kind}: the data is not a supported {kind} format", param)
        return
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        if not limits.allow_remote_media:
            raise bad("remote media URLs are disabled; send a data: URL "
                      "(or start the engine with --allow-remote-media)", param)
        _check_public_host(parts.hostname, param)
        return
    raise bad(f"{scheme or 'bare path'} media URLs are refused; send a data: URL", param)


def _check_public_host(host: str | None, param: str) -> None:
    if not host:
        raise bad("URL has no host", param)
    try:
        addrs = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            raise bad(f"cannot resolve host {host!r}", param) from None
        addrs = [ipaddress.ip_address(i[4][0].split("%")[0]) for i in infos]
    for a in addrs:
        if not a.is_global or a.is_multicast:
            raise bad(f"host {host!r} resolves to a non-public address ({a}); refused", param)


@dataclass(frozen=True)
class VisionCharge:
    """What a request's media cost on a given profile.

    vision_tokens: tokens added to the prompt (tokens). preprocess_s: CPU preprocessing
    before the request joins the waiting queue (s). encoder_s: vision-encoder time charged
    to its first prefill step (s).
    """

    vision_tokens: int = 0
    preprocess_s: float = 0.0
    encoder_s: float = 0.0


def vision_charge(req: ParsedRequest, vision: VisionCosts | None) -> VisionCharge:
    """Price a request's media on a profile's `VisionCosts` (see `VisionCharge`).

    Raises:
        ApiError: 400 when the request has media and the profile is text-only.
    """
    if not (req.num_images or req.num_frames):
        return VisionCharge()
    if vision is None:
        raise bad("this model is text-only; remove image_url / video_url parts", "messages")
    return VisionCharge(
        vision_tokens=req.num_images * vision.tokens_per_image + req.num_frames * vision.tokens_per_frame,
        preprocess_s=req.num_images * vision.preprocess_s_per_image
        + req.num_frames * vision.preprocess_s_per_frame,
        encoder_s=req.num_images * vision.encoder_s_per_image + req.num_frames * vision.encoder_s_per_frame,
    )
