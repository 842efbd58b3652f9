"""The three request classes of RPS-Serve and the naive (by-modality) mapping.

Kept free of other package imports so the policies, the classifier and the queue
metrics can all import it without cycles."""

from __future__ import annotations

CLASSES: tuple[str, str, str] = ("sand", "pebbles", "rocks")
"""Request classes, lightest first (index = class rank)."""

CLASS_RANK: dict[str, int] = {c: i for i, c in enumerate(CLASSES)}

NAIVE_CLASS: dict[str, str] = {"text": "sand", "image": "pebbles", "video": "rocks"}


def naive_class(modality: str) -> str:
    """The naive (by-modality) class: text → sand, image → pebbles, video → rocks;
    any other modality → pebbles (the middle class)."""
    return NAIVE_CLASS.get(modality, "pebbles")
