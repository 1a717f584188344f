"""Image bytes to pixels: decoding with Pillow, under limits, every failure a 400 naming the part.

Owns: `decode_image` (PNG, JPEG, WebP, GIF's first frame -> an RGB `PIL.Image`, transparency composited
on white as transformers' processors do) and `data_url_bytes` (a base64 `data:` URL's payload).
Refuses: any other format (SVG, TIFF, ...), an image over the `ImageLimits` (checked from its header,
before its pixels are decoded), a truncated or corrupt file: each an `InvalidRequestError` whose
`param` is the request field that carried the image.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings

from PIL import Image, UnidentifiedImageError

from nanoserve.errors import InvalidRequestError
from nanoserve.multimodal.limits import ImageLimits

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


def decode_image(data: bytes, field: str, limits: ImageLimits | None = None) -> Image.Image:
    """`data` decoded to an RGB image; `field` names the request part it came in."""
    limits = limits or ImageLimits()
    if len(data) > limits.max_bytes:
        raise InvalidRequestError(f"the image is {len(data)} bytes; at most {limits.max_bytes} are allowed",
                                  param=field)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width * height > limits.max_pixels:
                raise InvalidRequestError(f"the image is {width} x {height} pixels; at most "
                                          f"{limits.max_pixels} pixels are allowed", param=field)
            image.seek(0)  # a GIF's first frame
            image.load()
    except InvalidRequestError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequestError(f"the image is not a {', '.join(FORMATS)} file nanoserve can read",
                                  param=field) from None
    except (OSError, ValueError, SyntaxError, EOFError) as error:
        raise InvalidRequestError(f"the image could not be decoded ({error})", param=field) from None
    if width < 1 or height < 1:
        raise InvalidRequestError("the image has no pixels", param=field)
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, any transparency composited onto white (transformers' `convert_to_rgb`)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def data_url_bytes(url: str, field: str) -> bytes:
    """The payload of a `data:image/...;base64,...` URL."""
    header, comma, payload = url.partition(",")
    if not comma or not header.startswith("data:") or not header.endswith(";base64"):
        raise InvalidRequestError("an image data URL must look like data:image/png;base64,<data>",
                                  param=field)
    return base64_bytes(payload, field)


def base64_bytes(payload: str, field: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("the image data is not valid base64", param=field) from None
