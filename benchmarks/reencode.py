#!/usr/bin/env python
"""A copy of an image tree re-encoded as JPEG (PIL's encoder, libjpeg's tables at the quality asked, 4:2:0 chroma),
for the dose-response of the JPEG damage (benchmarks/proxies.py's jpeg-q75 and jpeg-q50 variants).

    python benchmarks/reencode.py SRC DST --quality 50 [--workers N]

Every image file under SRC becomes DST/<the same path>, with .jpg for another extension; the other files are left
out. The copy is written beside DST and renamed to it once whole: an existing DST is a finished copy, left as it
is. Prints one JSON line: images, seconds, and the PSNR of the copy against SRC's pixels (over every pixel).
"""
import argparse
import io
import json
import math
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sce import UserError  # noqa: E402
from sce.layouts import IMAGE_EXTENSIONS  # noqa: E402


def image_files(src):
    """The image files under src, as paths relative to it, sorted."""
    found = []
    for folder, dirs, files in os.walk(src):
        dirs.sort()
        found += [os.path.relpath(os.path.join(folder, f), src) for f in sorted(files)
                  if f.lower().endswith(IMAGE_EXTENSIONS)]
    return found


def encode(path, quality):
    """(JPEG bytes of the image at path at quality, 4:2:0; the squared error of their pixels against its, summed)."""
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.int64)
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, "JPEG", quality=quality, subsampling="4:2:0")
    decoded = np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"), dtype=np.int64)
    return buffer.getvalue(), int(((decoded - pixels) ** 2).sum()), pixels.size


def encode_many(src, dst, relpaths, quality):
    """Re-encode relpaths from src into dst; (squared error, values) summed."""
    error = values = 0
    for rel in relpaths:
        data, sq, n = encode(os.path.join(src, rel), quality)
        stem, ext = os.path.splitext(rel)
        out = os.path.join(dst, stem + (ext if ext.lower() in (".jpg", ".jpeg") else ".jpg"))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "wb") as f:
            f.write(data)
        error, values = error + sq, values + n
    return error, values


def reencode(src, dst, quality, workers=1):
    """Write dst from src (see the module's doc); returns {images, seconds, psnr_db} (psnr None when dst existed)."""
    if not 1 <= quality <= 95:
        raise UserError(f"--quality {quality} is outside PIL's 1-95: pick one in that range")
    if os.path.isdir(dst):
        return dict(images=len(image_files(dst)), seconds=0.0, psnr_db=None, existed=True)
    files = image_files(src) if os.path.isdir(src) else []
    if not files:
        raise UserError(f"no image files under {src}: pass the folder of an image tree (e.g. an ImageFolder)")
    start, partial = time.time(), dst.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # an earlier copy cut short
    if workers > 1:
        chunks = [files[i::workers * 8] for i in range(workers * 8)]
        with ProcessPoolExecutor(workers) as pool:
            sums = list(pool.map(encode_many, *zip(*[(src, partial, c, quality) for c in chunks if c])))
    else:
        sums = [encode_many(src, partial, files, quality)]
    os.replace(partial, dst)
    error, values = (sum(s[i] for s in sums) for i in (0, 1))
    psnr = 10 * math.log10(255 ** 2 / (error / values)) if error else math.inf
    return dict(images=len(files), seconds=round(time.time() - start, 2), psnr_db=round(psnr, 3), existed=False)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="the image tree (e.g. an ImageFolder with train/ and val/)")
    parser.add_argument("dst", help="its copy, written once")
    parser.add_argument("--quality", type=int, required=True, help="JPEG quality, 1-95")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="processes encoding (default: one a core)")
    args = parser.parse_args(argv)
    said = reencode(args.src, args.dst, args.quality, args.workers)
    print(json.dumps(dict(what="reencode", src=args.src, dst=args.dst, quality=args.quality, **said)), flush=True)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
