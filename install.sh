#!/usr/bin/env bash
# Sets fastdata up on a fresh machine: a virtual environment (.venv) with torch and
# torchvision pinned by constraints.txt, NVIDIA DALI, the test tools, the trainers fastdata is tested
# inside (Lightning, accelerate, Ray Train, timm, TensorBoard), and Pillow-SIMD in place of Pillow.
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")"

# Always .venv beside this script, also when another environment is active: the README's commands
# run .venv/bin/python. PYTHON picks the interpreter the environment is made from (>= 3.10).
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
PY=.venv/bin/python
PIP=("$PY" -m pip --disable-pip-version-check)

# The constraints keep pip on torch 2.14.1 / torchvision 0.29.1: unpinned it fetches newer releases
# and several GB of CUDA packages.
"${PIP[@]}" install -q -c constraints.txt -e ".[dali,dev,integrations,shards]"

# Pillow-SIMD replaces Pillow under the same `import PIL` (measured here: a 1024²→224² resize takes
# 5.2 ms with Pillow, 0.8 ms with Pillow-SIMD, 0.5 ms with its AVX2 build). pip cannot express
# "this instead of that", and torchvision and matplotlib depend on "pillow", so any later install can
# bring Pillow back over it: check the result, not what was asked for.
is_simd() { "$PY" -c "import PIL, sys; sys.exit(0 if '.post' in PIL.__version__ else 1)" 2>/dev/null; }
build_simd() {  # extra pip options as arguments
  "${PIP[@]}" uninstall -q -y pillow pillow-simd >/dev/null 2>&1 || true
  cc_flags=""
  if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then cc_flags="-mavx2"; fi
  if ! CC="${CC:-cc} $cc_flags" "${PIP[@]}" install -q --no-deps --force-reinstall --no-binary pillow-simd \
        "$@" -c constraints.txt pillow-simd; then
    echo "install.sh: building Pillow-SIMD failed (needs a C compiler and the libjpeg/zlib headers:" \
         "apt-get install build-essential libjpeg-dev zlib1g-dev); keeping Pillow" >&2
    "${PIP[@]}" install -q -c constraints.txt pillow
  fi
}
if ! is_simd; then build_simd; fi
# A source build links only the image libraries whose headers it finds (a Pillow wheel bundles them):
# without libwebp's it reads no WebP, without libtiff's no compressed TIFF. Built (or taken from pip's
# wheel cache) without one whose headers are here now, it is built again, past the cache.
lacks() { "$PY" -c "from PIL import features; import sys; sys.exit(1 if features.check('$1') else 0)" 2>/dev/null; }
finds() { echo "#include <$1>" | ${CC:-cc} -E - >/dev/null 2>&1; }
if is_simd; then
  for pair in webp:webp/decode.h libtiff:tiffio.h littlecms2:lcms2.h; do
    if lacks "${pair%%:*}" && finds "${pair#*:}"; then build_simd --no-cache-dir; break; fi
  done
fi
lost=$("$PY" -c "from fastdata.doctor import pil_cannot_read; print(', '.join(pil_cannot_read()))")
if is_simd && [ -n "$lost" ]; then
  echo "install.sh: note: Pillow-SIMD was built without $lost, so such files are refused by name; install" \
       "those packages and run ./install.sh again to add them" >&2
fi
"$PY" -c "import PIL, torch, torchvision, fastdata; print(f'fastdata {fastdata.__version__}: torch {torch.__version__}, torchvision {torchvision.__version__}, PIL {PIL.__version__}, backends {fastdata.available_backends()}')"
