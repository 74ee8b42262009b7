"""OpenAI message content (a string, a list of parts, or null) as template text, family-neutral:
families that render media give their own placeholders (Qwen3.5: ``<|vision_start|>...``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polar_env.errors import RequestError

NO_MEDIA: Mapping[str, str] = {"image": "", "video": ""}


def content_text(content: Any, media: Mapping[str, str] = NO_MEDIA) -> str:
    """Flatten ``content`` to text; ``media`` gives the text an image or video part becomes."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out: list[str] = []
        for part in content:
            if not isinstance(part, Mapping):
                raise RequestError("Unexpected item type in content.")
            if "image" in part or "image_url" in part or part.get("type") == "image":
                out.append(media["image"])
            elif "video" in part or part.get("type") == "video":
                out.append(media["video"])
            elif "text" in part:
                out.append(str(part["text"]))
            else:
                raise RequestError("Unexpected item type in content.")
        return "".join(out)
    raise RequestError("Unexpected content type.")
