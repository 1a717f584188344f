"""A request's images, from the parts that carry them to decoded images: `data:` URLs, and
http(s) URLs fetched only from the hosts `serve --allowed-media-domains` names, within a size
and a time limit.

Owns: `MediaPolicy` and `load_image`. Every failure is a 400 naming the
part that carried the image (`messages[0].content[1].image_url`).
Refuses: any other URL scheme, a host not allowed (none is, by default: data: URLs only), a redirect, a
fetch over the image size limit or slower than its deadline, and whatever `multimodal.images`
refuses to decode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from PIL import Image

from nanoserve.errors import InvalidRequestError
from nanoserve.multimodal.images import data_url_bytes, decode_image
from nanoserve.multimodal.limits import ImageLimits

MEDIA_FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    allowed_domains: frozenset[str] = frozenset()  # hosts http(s) image URLs may name; none: data: URLs only
    fetch_timeout_s: float = MEDIA_FETCH_TIMEOUT_S  # the whole fetch, connect to last byte


def load_image(url: str, param: str, policy: MediaPolicy, limits: ImageLimits) -> Image.Image:
    """The image a part's URL carries, decoded under `limits`."""
    if url.startswith("data:"):
        return decode_image(data_url_bytes(url, param), param, limits)
    return decode_image(fetch(url, f"{param}.url", policy, limits.max_bytes), param, limits)


def fetch(url: str, param: str, policy: MediaPolicy, max_bytes: int) -> bytes:
    """The body at an http(s) URL on an allowed host: at most `max_bytes`, within the deadline."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequestError("an image URL must be a data: URL or an http(s) URL", param=param)
    if parts.hostname not in policy.allowed_domains:
        allowed = ", ".join(sorted(policy.allowed_domains)) or "none (serve --allowed-media-domains)"
        raise InvalidRequestError(f"image URLs from {parts.hostname!r} are not allowed; allowed hosts: "
                                  f"{allowed}", param=param)
    deadline_s = time.monotonic() + policy.fetch_timeout_s
    body = bytearray()
    try:
        with httpx.Client(timeout=policy.fetch_timeout_s, follow_redirects=False) as client, \
                client.stream("GET", url) as response:
            if response.status_code != 200:
                raise InvalidRequestError(f"fetching the image answered HTTP {response.status_code}",
                                          param=param)
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise InvalidRequestError(f"the image is over {max_bytes} bytes", param=param)
                if time.monotonic() > deadline_s:
                    raise InvalidRequestError(f"fetching the image took over {policy.fetch_timeout_s} s",
                                              param=param)
    except httpx.HTTPError as error:
        raise InvalidRequestError(f"the image could not be fetched ({type(error).__name__})",
                                  param=param) from None
    return bytes(body)
