"""The old import path of region decoding, kept so that code importing from it still runs: the module
is ``fastdata.images.region``. New code imports from there (this one only re-exports its names:
patching a name here changes nothing there)."""
from .images.region import (
    INSTALL_HINT,
    JPEG_START,
    DecodedBox,
    choose,
    decode_box,
    decode_window,
    draft_cost,
    draft_scale,
    is_jpeg,
    jpeg_header,
    jpeg_orientation,
    plan_window,
    region_available,
    region_cost,
    region_decoder_status,
)

__all__ = [
    "INSTALL_HINT", "JPEG_START", "DecodedBox", "choose", "decode_box", "decode_window", "draft_cost", "draft_scale",
    "is_jpeg", "jpeg_header", "jpeg_orientation", "plan_window", "region_available", "region_cost",
    "region_decoder_status",
]
