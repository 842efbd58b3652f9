"""Media for multimodal bench requests: real files sent as `data:` URLs, or stand-ins.

A `MediaItem` names an image or a video. It is turned into an OpenAI chat content part
only when the request is sent (`content_part`), so a workload of thousands of requests
does not hold thousands of encoded images in memory; encodings are cached per file.

Stand-ins (used when the media folder or a file is absent — announced loudly by the
loader, never silently dropped, unlike `vllm bench serve`'s LLaVA loader):

- images: the real sample JPEGs found in the data folder's `llava/` (cycled), else a
  generated 640×480 JPEG (the typical COCO train2017 size LLaVA-Instruct images come from);
- videos: a Motion-JPEG AVI built here (pure Python, RIFF container per the OpenDML/AVI 1.0
  layout: `hdrl` + `movi` + `idx1`) holding `num_frames` 336×336 frames, which any video
  decoder (FFmpeg/PyAV/OpenCV) reads; its nominal duration is the middle of the record's
  LLaVA-Video duration bucket (`0_30_s` → 15 s, `30_60_s` → 45 s, `1_2_m` → 90 s,
  `2_3_m` → 150 s).
"""

from __future__ import annotations

import base64
import functools
import io
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STANDIN_IMAGE_SIZE = (640, 480)
STANDIN_FRAME_SIZE = (336, 336)
DURATION_BUCKETS_S = {"0_30_s": 15.0, "30_60_s": 45.0, "1_2_m": 90.0, "2_3_m": 150.0}
_MIME = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".webp": "image/webp",
         ".gif": "image/gif", ".mp4": "video/mp4", ".mkv": "video/x-matroska", ".webm": "video/webm",
         ".avi": "video/x-msvideo"}


@dataclass(frozen=True)
class MediaItem:
    """One image or video of a request.

    kind: "image" or "video".
    path: the real file, or None for a generated stand-in.
    stand_in: True when this is not the dataset's own media (the file was absent).
    num_frames: frames the request asks the model to sample (videos; 0 for images).
    duration_s: nominal video duration (s; 0 for images).
    seed: varies generated stand-ins between requests.
    width_px / height_px: the image's size (0 = unknown: the profile's fixed
        `tokens_per_image`); the virtual target turns it into vision tokens by the
        profile's rule (`sim.profile.VisionCosts.image_tokens`).
    """

    kind: str
    path: Path | None = None
    stand_in: bool = False
    num_frames: int = 0
    duration_s: float = 0.0
    seed: int = 0
    width_px: int = 0
    height_px: int = 0

    def content_part(self) -> dict[str, Any]:
        """The OpenAI chat content part carrying this item as a `data:` URL."""
        if self.kind == "image":
            url = _file_data_url(self.path) if self.path else _standin_image_url(self.seed % 8)
            return {"type": "image_url", "image_url": {"url": url}}
        url = _file_data_url(self.path) if self.path else _standin_video_url(self.num_frames, self.duration_s)
        return {"type": "video_url", "video_url": {"url": url, "num_frames": self.num_frames}}

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path) if self.path else None, "stand_in": self.stand_in,
                "num_frames": self.num_frames, "duration_s": self.duration_s,
                **({"width_px": self.width_px, "height_px": self.height_px} if self.width_px else {})}


def duration_bucket_s(text: str) -> float:
    """Nominal duration (s) of a LLaVA-Video `data_source`/path naming a bucket such as
    `0_30_s` or `1_2_m`; 15 s (the shortest bucket's middle) when none is named."""
    for key, mid in DURATION_BUCKETS_S.items():
        if re.search(rf"(^|[^0-9]){key}", text or ""):
            return mid
    return DURATION_BUCKETS_S["0_30_s"]


@functools.lru_cache(maxsize=256)
def _file_data_url(path: Path) -> str:
    mime = _MIME.get(path.suffix.lower(), "application/octet-stream")
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def _jpeg(size: tuple[int, int], seed: int, quality: int = 80) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    # Smooth gradients plus mild noise: compresses like a photo, not like white noise.
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)),
                     ((xx + yy) * 127 // max(w + h - 2, 1))], axis=-1).astype(np.int16)
    noise = rng.integers(-12, 13, size=base.shape, dtype=np.int16)
    arr = np.clip(base + noise + int(rng.integers(0, 60)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


_SAMPLE_JPEGS: list[Path] = []


def set_sample_images(paths: list[Path]) -> None:
    """Real JPEGs to use (cycled) as stand-in images, e.g. `data/llava/*.jpg`."""
    _SAMPLE_JPEGS[:] = sorted(paths)
    _standin_image_url.cache_clear()


@functools.lru_cache(maxsize=16)
def _standin_image_url(slot: int) -> str:
    if _SAMPLE_JPEGS:
        return _file_data_url(_SAMPLE_JPEGS[slot % len(_SAMPLE_JPEGS)])
    return "data:image/jpeg;base64," + base64.b64encode(_jpeg(STANDIN_IMAGE_SIZE, slot)).decode()


@functools.lru_cache(maxsize=16)
def _standin_video_url(num_frames: int, duration_s: float) -> str:
    frames = [_jpeg(STANDIN_FRAME_SIZE, 1000 + i, quality=60) for i in range(max(1, num_frames))]
    fps = max(1, round(len(frames) / duration_s)) if duration_s > 0 else 1
    data = mjpeg_avi(frames, STANDIN_FRAME_SIZE, fps)
    return "data:video/x-msvideo;base64," + base64.b64encode(data).decode()


def mjpeg_avi(frames: list[bytes], size: tuple[int, int], fps: int) -> bytes:
    """A Motion-JPEG AVI holding `frames` (JPEG bytes) of `size` (w, h) at `fps`."""
    w, h = size
    n = len(frames)

    def chunk(fourcc: bytes, data: bytes) -> bytes:
        pad = b"\0" if len(data) % 2 else b""
        return fourcc + struct.pack("<I", len(data)) + data + pad

    def lst(kind: bytes, data: bytes) -> bytes:
        return b"LIST" + struct.pack("<I", len(data) + 4) + kind + data

    max_frame = max(len(f) for f in frames)
    avih = struct.pack("<IIIIIIIIII4I", 1_000_000 // fps, max_frame * fps, 0, 0x10, n, 0, 1,
                       max_frame, w, h, 0, 0, 0, 0)
    strh = struct.pack("<4s4sIHHIIIIIIIIhhhh", b"vids", b"MJPG", 0, 0, 0, 0, 1, fps, 0, n,
                       max_frame, 0xFFFFFFFF, 0, 0, 0, w, h)
    strf = struct.pack("<IiiHH4sIiiII", 40, w, h, 1, 24, b"MJPG", w * h * 3, 0, 0, 0, 0)
    hdrl = lst(b"hdrl", chunk(b"avih", avih) + lst(b"strl", chunk(b"strh", strh) + chunk(b"strf", strf)))
    movi_body = b""
    index = b""
    for f in frames:
        index += b"00dc" + struct.pack("<III", 0x10, len(movi_body) + 4, len(f))
        movi_body += chunk(b"00dc", f)
    body = b"AVI " + hdrl + lst(b"movi", movi_body) + chunk(b"idx1", index)
    return b"RIFF" + struct.pack("<I", len(body)) + body
