"""The old import path of the recipe on the host and of photo decoding, kept so that code importing
from it still runs: the recipe's parameters and their application on arrays are ``fastdata.augment``,
a photo's bytes → pixels ``fastdata.images.photo``. New code imports from those modules (this one
only re-exports their names: patching a name here changes nothing there)."""
from .augment import (
    NUMPY_PAD_MODE,
    RRC_DRAWS,
    RRC_TRIES,
    Params,
    apply_params,
    augment_array,
    augment_batch,
    center_boxes,
    center_params,
    draw_params,
    output_size,
    recipe,
    require_fixed_size,
    require_padding_fits,
    resize_box,
    rrc_boxes,
    rrc_params,
    sample_box,
    translate_offsets,
)
from .images.photo import (
    JPEG_FORMATS,
    check_pixels,
    crop_photo,
    decode_upright,
    exif_orientation,
    load_photo,
    load_pixels,
    open_image,
    region_decode_enabled,
    to_rgb,
)

__all__ = [
    "JPEG_FORMATS", "NUMPY_PAD_MODE", "RRC_DRAWS", "RRC_TRIES", "Params", "apply_params", "augment_array",
    "augment_batch", "center_boxes", "center_params", "check_pixels", "crop_photo", "decode_upright", "draw_params",
    "exif_orientation", "load_photo", "load_pixels", "open_image", "output_size", "recipe", "region_decode_enabled",
    "require_fixed_size", "require_padding_fits", "resize_box", "rrc_boxes", "rrc_params", "sample_box", "to_rgb",
    "translate_offsets",
]
