#!/usr/bin/env python
"""A copy of an image tree re-encoded as JPEG (PIL's encoder, libjpeg's tables at the quality asked, 4:2:0 chroma),
for the dose-response of the JPEG damage (benchmarks/fidelity/proxies.py's jpeg-q75 and jpeg-q50 variants).

    python benchmarks/fidelity/reencode.py SRC DST --quality 50 [--workers N]

Every image file under SRC becomes DST/<the same path>, with .jpg for another extension; the other files are left
out, every folder is kept (an empty val/ too). Linked folders are followed, a link that loops is refused; so are two
images that would become one file (0.png and 0.jpg). The copy is written in DST.partial and renamed to DST once
whole, with DST/.reencode.json (its source, quality and figures): a DST holding one of the same source and quality
is a finished copy, left as it is; any other DST that is not empty is refused. A failure, a stop (SIGTERM, Ctrl-C)
removes DST.partial and ends the workers; one left by a kill -9 is finished by the next run. Prints one JSON line:
images, seconds, and the PSNR of the copy against SRC's pixels (over every pixel).
"""
import argparse
import functools
import io
import json
import math
import multiprocessing
import os
import shutil
import signal
import sys
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
from sce import UserError, write_file  # noqa: E402
from sce.layouts import IMAGE_EXTENSIONS, walk  # noqa: E402

MARKER = ".reencode.json"  # in a copy: what it was made from; a DST without it is no copy of ours
STOPPED_EXIT_CODE = 75  # as the scripts' (sce.PREEMPTED_EXIT_CODE): run the same command again


def tree(src):
    """(every folder, every image file) under src, as paths relative to it, sorted; linked folders followed, a
    folder loop refused (sce.layouts.walk)."""
    folders, found = [], []
    for folder, dirs, files in walk(src, src):
        dirs.sort()
        folders.append(os.path.relpath(folder, src))
        found += [os.path.relpath(os.path.join(folder, f), src) for f in sorted(files)
                  if f.lower().endswith(IMAGE_EXTENSIONS)]
    return folders, found


def image_files(src):
    """The image files under src, as paths relative to it, sorted."""
    return tree(src)[1]


def out_name(rel):
    stem, ext = os.path.splitext(rel)
    return stem + (ext if ext.lower() in (".jpg", ".jpeg") else ".jpg")


def refuse_collisions(src, dst, files):
    """Two images that would be written as one file (0.png and 0.jpg): one line naming both."""
    seen = {}
    for rel in files:
        other = seen.setdefault(out_name(rel), rel)
        if other != rel:
            raise UserError(f"{os.path.join(src, other)} and {os.path.join(src, rel)} would both be written as "
                            f"{os.path.join(dst, out_name(rel))}: rename one of them")


def encode(path, quality, done=None):
    """(JPEG bytes of the image at path at quality, 4:2:0, or those of `done`, a copy already written; the squared
    error of their pixels against its, summed; the values)."""
    try:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"), dtype=np.int64)
    except Exception as e:  # noqa: BLE001: a damaged image fails in many ways
        raise UserError(f"cannot read {path} ({type(e).__name__}: {str(e)[:120]}): fix or remove it") from None
    if done:
        with open(done, "rb") as f:
            data = f.read()
    else:
        buffer = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(buffer, "JPEG", quality=quality, subsampling="4:2:0")
        data = buffer.getvalue()
    decoded = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int64)
    return data, int(((decoded - pixels) ** 2).sum()), pixels.size


def copy_one(src, partial, quality, rel):
    """Re-encode src/rel into partial, through a temporary name (a kill leaves no half file); a file already there
    (a copy being finished) is kept. (squared error, values)."""
    out = os.path.join(partial, out_name(rel))
    done = out if os.path.isfile(out) else None
    data, sq, n = encode(os.path.join(src, rel), quality, done)
    if not done:
        with open(out + ".tmp", "wb") as f:
            f.write(data)
        os.replace(out + ".tmp", out)
    return sq, n


def _worker_signals():
    """A pool worker: the parent alone handles a stop, and ends its workers (SIGTERM, Pool.terminate)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def copy_all(src, partial, files, quality, workers):
    """(squared error, values) summed over the copies of `files` into partial, by `workers` processes."""
    if workers <= 1:
        sums = [copy_one(src, partial, quality, rel) for rel in files]
    else:
        with multiprocessing.get_context("fork").Pool(workers, _worker_signals) as pool:  # terminated on any exit
            sums = list(pool.imap_unordered(functools.partial(copy_one, src, partial, quality), files, chunksize=16))
    return sum(s[0] for s in sums), sum(s[1] for s in sums)


def read_marker(folder):
    try:
        with open(os.path.join(folder, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def finished(src, dst, quality):
    """The figures of DST, a finished copy of src at quality; None where DST is absent or empty; else one line."""
    if not os.path.lexists(dst) or os.path.isdir(dst) and not os.listdir(dst):
        return None
    made = read_marker(dst)
    if made is None:
        raise UserError(f"{dst} exists and is no copy made by reencode.py (it has no {MARKER}): pass another DST, "
                        "or remove it")
    if (made.get("src"), made.get("quality")) != (os.path.abspath(src), quality):
        raise UserError(f"{dst} is a copy of {made.get('src')} at quality {made.get('quality')}, not of "
                        f"{os.path.abspath(src)} at {quality}: pass another DST")
    return dict(images=made["images"], seconds=0.0, psnr_db=None, existed=True)


def start_partial(src, partial, quality, folders):
    """DST.partial with every folder of the tree, and its marker; one a kill -9 left is finished where it is of
    the same source and quality, else started again (a line says which)."""
    mine = dict(src=os.path.abspath(src), quality=quality)
    if os.path.isdir(partial):
        same = read_marker(partial) == mine
        print(f"=> {partial}: a copy cut short (kill -9); {'finishing' if same else 'starting again'} it", flush=True)
        if not same:
            shutil.rmtree(partial)
        for folder, _, names in os.walk(partial):  # the half-written file of each worker
            for name in [n for n in names if n.endswith(".tmp")]:
                os.remove(os.path.join(folder, name))
    for folder in folders:
        os.makedirs(os.path.join(partial, folder), exist_ok=True)
    write_file(os.path.join(partial, MARKER), json.dumps(mine))
    return mine


def reencode(src, dst, quality, workers=1):
    """Write dst from src (see the module's doc); returns {images, seconds, psnr_db} (psnr None when dst existed)."""
    if not 1 <= quality <= 95:
        raise UserError(f"--quality {quality} is outside PIL's 1-95: pick one in that range")
    dst = dst.rstrip("/")
    said = finished(src, dst, quality)
    if said:
        return said
    folders, files = tree(src) if os.path.isdir(src) else ([], [])
    if not files:
        raise UserError(f"no image files under {src}: pass the folder of an image tree (e.g. an ImageFolder)")
    refuse_collisions(src, dst, files)
    start, partial = time.time(), dst + ".partial"
    try:
        mine = start_partial(src, partial, quality, folders)
        error, values = copy_all(src, partial, files, quality, workers)
        psnr = 10 * math.log10(255 ** 2 / (error / values)) if error else math.inf
        write_file(os.path.join(partial, MARKER), json.dumps(dict(mine, images=len(files), psnr_db=psnr)))
        os.replace(partial, dst)
    except BaseException:  # a failure, a stop: nothing half-made is left
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return dict(images=len(files), seconds=round(time.time() - start, 2), psnr_db=round(psnr, 3), existed=False)


class Stopped(BaseException):
    """SIGTERM: leave as Ctrl-C does, through every cleanup."""


def stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


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
    signal.signal(signal.SIGTERM, stop)
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
    except (Stopped, KeyboardInterrupt) as e:
        print(f"=> reencode.py stopped by {str(e) or 'SIGINT'}: nothing kept; run the same command again (exiting with "
              f"code {STOPPED_EXIT_CODE})", flush=True)
        sys.exit(STOPPED_EXIT_CODE)
