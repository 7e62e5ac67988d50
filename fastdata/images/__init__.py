"""One image file's bytes → uint8 pixels, the room every host-side decode goes through.

- ``photo``: open and check a file with Pillow (every failure a ``DecodeError`` naming it), its EXIF
  orientation, the whole-scan check, and ``load_photo``/``crop_photo``: the recipe's box decoded the
  cheapest exact way;
- ``region``: the box's window decoded alone (nvImageCodec's libjpeg-turbo), what ``crop_photo`` uses
  for upright 8-bit JPEGs when it is installed;
- ``whole``: photos decoded whole and shrunk to a side (PIL, or nvImageCodec in batches, nvJPEG on a
  GPU): what the memory backend's photo cache holds;
- ``on_error``: what a file that does not decode does to its batch (``OnError``: raise or skip), the
  one policy every decoder above and DALI's feed apply.

Every decoder of the package is here; DALI's own (nvJPEG inside its pipeline) is configured by
``decode.dali_options``. ``decode`` is the layer above the sources that turns sample ids into batches
through these decoders (or feeds DALI), skipping what ``OnError`` skips.

Why a room of its own below ``datasets``, not inside ``decode``: a source decodes a photo itself
(``ImageFolder.__getitem__``, a Dataset's PIL image through ``to_rgb``), while ``decode`` (sample ids →
batches, the DALI feed) reads sources; one folder cannot sit both below and above ``datasets``.
"""
