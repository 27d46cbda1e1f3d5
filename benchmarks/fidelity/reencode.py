#!/usr/bin/env python
"""A copy of an image tree re-encoded as JPEG (PIL's encoder, libjpeg's tables at the quality asked, 4:2:0 chroma),
for the dose-response of the JPEG damage (benchmarks/fidelity/proxies.py's jpeg-q75 and jpeg-q50 variants).

    python benchmarks/fidelity/reencode.py SRC DST --quality 50 [--workers N]

Every image file under SRC becomes DST/<the same path>, with .jpg for another extension; the other files are left
out, every folder is kept (an empty val/ too). Linked folders are followed, a link that loops is refused; so are two
images that would become one file (0.png and 0.jpg, or k.png beside a folder k.jpg/), and a folder or an image file
that cannot be read (each is named: a copy is whole or refused). The copy is written in DST.partial, made by this
script with its marker .reencode.json (its source and quality) and renamed to DST once whole: a DST holding one of
the same source and quality is a finished copy, left as it is; any other DST that is not empty, a DST that is a
link, a DST.partial without the marker or of another source or quality, and a SRC that is, holds or lies inside DST
or DST.partial are refused before anything is touched. Only a folder with the marker is ever removed: DST.partial
after a failure. A stop (SIGTERM, SIGUSR1, Ctrl-C) exits 75 with one line and keeps DST.partial, as a kill -9 does:
the same command finishes it. Prints one JSON line: images, seconds, and the PSNR of the copy against SRC's pixels
(over every pixel).
"""
import os
import signal
import sys

STOPPED_EXIT_CODE = 75  # as the scripts' (sce.PREEMPTED_EXIT_CODE): run the same command again
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # SLURM's, torchrun's and Ctrl-C, as sce's


def stopped_starting(signum, frame):
    """A stop signal while the script imports, before main() takes the signals over: nothing begun."""
    os.write(1, f"=> reencode.py stopped by {signal.Signals(signum).name} while starting, before copying anything: "
                f"run the same command again (exiting with code {STOPPED_EXIT_CODE})\n".encode())
    os._exit(STOPPED_EXIT_CODE)


if __name__ == "__main__":  # first, before the imports of numpy and PIL
    for sig in STOP_SIGNALS:
        signal.signal(sig, stopped_starting)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import multiprocessing.connection  # noqa: E402
import shutil  # noqa: E402
import stat  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
from sce import UserError, end_with_parent, write_file  # noqa: E402
from sce.layouts import IMAGE_EXTENSIONS, walk  # noqa: E402

# in a copy and its DST.partial, written as the folder is made: a folder without it is not ours
MARKER = ".reencode.json"


class Stopped(BaseException):
    """A stop signal (or a caller's stop request) while work is left: leave through every cleanup, as Ctrl-C does."""


# the script's: the first stop signal, the held() blocks under way, whether the copy was renamed to DST
STOP = argparse.Namespace(signal=None, holding=0, finished=False)


def stop(signum, frame):
    """The script's stop signals: the first raises Stopped wherever the work is, but inside a held() block (it is
    raised at the block's end) or once the copy was finished (it is only recorded); later ones are ignored, so the
    clean-up runs once."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    STOP.signal = signal.Signals(signum).name
    if not STOP.holding and not STOP.finished:
        raise Stopped(STOP.signal)


@contextlib.contextmanager
def held(then_stop=True):
    """A stop signal waits until the block ends: what it makes is made whole (a folder and its marker). Not the
    signal mask: another thread (numpy's OpenBLAS ones) would take the signal, and Python run its handler in the
    main thread at once. A worker forked here starts so, until it ignores the signals (worker_start)."""
    STOP.holding += 1
    try:
        yield
    finally:
        STOP.holding -= 1
    if then_stop and STOP.signal and not STOP.holding and not STOP.finished:
        raise Stopped(STOP.signal)


@contextlib.contextmanager
def writing(path):
    """An OSError writing `path` (a full disk, a read-only folder) as one line naming it."""
    try:
        yield
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror or e}): free some space, or pass a DST where this user can "
                        "write") from None


def tree(src):
    """(every folder, every image file) under src, as paths relative to it, sorted; linked folders followed, a
    folder loop refused (sce.layouts.walk); a folder that cannot be listed (os.walk would skip it) or an image name
    that is no readable file is one line naming it."""
    folders, found, listed, seen = [], [], {src}, set()
    for folder, dirs, files in walk(src, src):
        dirs.sort()
        seen.add(folder)
        listed.update(os.path.join(folder, d) for d in dirs)
        folders.append(os.path.relpath(folder, src))
        found += [os.path.relpath(os.path.join(folder, f), src) for f in sorted(files)
                  if f.lower().endswith(IMAGE_EXTENSIONS)]
    for folder in sorted(listed - seen):
        try:
            os.scandir(folder).close()
            why = "it could not be listed"
        except OSError as e:
            why = e.strerror
        raise UserError(f"cannot read the folder {folder} ({why}): make it readable, or move it out of {src} (the copy "
                        "would lack its images)")
    for rel in found:
        readable_file(os.path.join(src, rel))
    return folders, found


def readable_file(path):
    """A UserError unless `path` is a regular file this user may read (a FIFO would be waited on for ever)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror}{', a link to nothing' if os.path.islink(path) else ''}): "
                        "fix or remove it") from None
    if not stat.S_ISREG(mode):
        raise UserError(f"{path} is no image file but a {describe(mode)}: remove it, or rename it without an image "
                        "extension")
    if not os.access(path, os.R_OK):
        raise UserError(f"cannot read {path} (permission denied): make it readable, or remove it")


def describe(mode):
    kinds = ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "device"),
             (stat.S_ISBLK, "device"))
    return next((name for test, name in kinds if test(mode)), "special file")


def image_files(src):
    """The image files under src, as paths relative to it, sorted."""
    return tree(src)[1]


def out_name(rel):
    stem, ext = os.path.splitext(rel)
    return stem + (ext if ext.lower() in (".jpg", ".jpeg") else ".jpg")


def refuse_collisions(src, dst, folders, files):
    """Two images that would be written as one file (0.png and 0.jpg), or an image written as a folder's name (k.png
    beside k.jpg/): one line naming both."""
    seen = {folder: folder + "/" for folder in folders}
    for rel in files:
        other = seen.setdefault(out_name(rel), rel)
        if other != rel:
            raise UserError(f"{os.path.join(src, other)} and {os.path.join(src, rel)} would both be written as "
                            f"{os.path.join(dst, out_name(rel))}: rename one of them")


def refuse_overlap(src, dst, partial):
    """A SRC that is, holds or lies inside DST or DST.partial (real paths): the copy would be written into its
    source, or its clean-up remove it."""
    real = os.path.realpath(src)
    for path in (dst, partial):
        other = os.path.realpath(path)
        if real == other or other.startswith(os.path.join(real, "")) or real.startswith(os.path.join(other, "")):
            raise UserError(f"SRC {src} and {path} are one folder or one holds the other: pass a DST outside SRC, "
                            "and a SRC that is no copy in progress")


def read_image(path):
    """The int64 RGB pixels of the image file at path; one line naming it if it cannot be read or is no regular
    file (opened without waiting, so a FIFO put there since the listing is refused, not waited on)."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise UserError(f"{path} is no image file but a {describe(os.fstat(f.fileno()).st_mode)}: remove it, "
                                "or rename it without an image extension")
            with Image.open(f) as image:
                return np.asarray(image.convert("RGB"), dtype=np.int64)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001: a damaged image fails in many ways
        raise UserError(f"cannot read {path} ({type(e).__name__}: {str(e)[:120]}): fix or remove it") from None


def encode(path, quality, done=None):
    """(JPEG bytes of the image at path at quality, 4:2:0, or those of `done`, a copy already written; the squared
    error of their pixels against its, summed; the values)."""
    pixels = read_image(path)
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
        with writing(out):
            with open(out + ".tmp", "wb") as f:
                f.write(data)
            os.replace(out + ".tmp", out)
    return sq, n


def worker_start():
    """A copying process ends with its parent however that ends (sce.end_with_parent: the kernel's SIGKILL once it is
    gone, kill -9 included), and leaves a stop to it: the stop signals, which a terminal or SLURM sends to every
    process, are ignored (the parent ends its workers)."""
    end_with_parent()
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def copy_part(src, partial, quality, rels, conn):
    """A worker: copies `rels`, then sends ("done", (squared error, values)) or ("error", its one line) to conn."""
    worker_start()
    try:
        conn.send(("done", copy_some(src, partial, quality, rels)))
    except Exception as e:  # noqa: BLE001: the parent reports it, in one line
        conn.send(("error", str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"))


def copy_some(src, partial, quality, rels):
    """(squared error, values) of the copies of `rels`."""
    sums = [copy_one(src, partial, quality, rel) for rel in rels]
    return sum(s[0] for s in sums), sum(s[1] for s in sums)


def copy_all(src, partial, files, quality, workers, stopping):
    """(squared error, values) summed over the copies of `files` into partial, by `workers` processes (each every
    workers-th image, its own pipe: no lock shared, so a stop or a failure ends them all at once with SIGKILL); a
    stop (stopping(), a caller's request such as proxies.py's, or a signal) is Stopped within half a second."""
    sums = []
    if workers <= 1:
        for rel in files:
            if stopping():
                raise Stopped("a stop request")
            sums.append(copy_one(src, partial, quality, rel))
        return sum(s[0] for s in sums), sum(s[1] for s in sums)
    context, procs, waiting = multiprocessing.get_context("fork"), [], {}
    try:
        with held(then_stop=False):  # a worker forked meanwhile must not raise the signal (it is then ignored)
            for i in range(workers):
                ours, theirs = context.Pipe(duplex=False)
                proc = context.Process(target=copy_part, args=(src, partial, quality, files[i::workers], theirs),
                                       daemon=True)
                proc.start()
                procs.append(proc)
                theirs.close()
                waiting[ours] = proc
        while waiting:
            if stopping() or STOP.signal:
                raise Stopped(STOP.signal or "a stop request")
            for conn in multiprocessing.connection.wait(list(waiting), timeout=0.5):
                proc = waiting.pop(conn)
                try:
                    kind, value = conn.recv()
                except EOFError:
                    proc.join()
                    raise UserError(f"a copying process ended without a word (exit {proc.exitcode}): run the same "
                                    "command again") from None
                if kind == "error":
                    raise UserError(value)
                sums.append(value)
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.join()
    return sum(s[0] for s in sums), sum(s[1] for s in sums)


def read_marker(folder):
    try:
        with open(os.path.join(folder, MARKER)) as f:
            made = json.load(f)
        return made if isinstance(made, dict) else None
    except (OSError, ValueError):
        return None


def finished(src, dst, quality):
    """The figures of DST, a finished copy of src at quality; None where DST is absent or an empty folder; else one
    line."""
    if os.path.islink(dst):
        raise UserError(f"{dst} is a link (to {os.readlink(dst)}): pass the folder itself, or another DST")
    if not os.path.lexists(dst) or os.path.isdir(dst) and not os.listdir(dst):
        return None
    made = read_marker(dst)
    if made is None:
        raise UserError(f"{dst} exists and is no copy made by reencode.py (it has no {MARKER}): pass another DST, "
                        "or remove it")
    if (made.get("src"), made.get("quality")) != (os.path.abspath(src), quality):
        raise UserError(f"{dst} is a copy of {made.get('src')} at quality {made.get('quality')}, not of "
                        f"{os.path.abspath(src)} at {quality}: pass another DST")
    psnr = made.get("psnr_db")
    return dict(images=made.get("images"), seconds=0.0, psnr_db=None if psnr is None else round(psnr, 3), existed=True)


def own_partial(src, partial, quality):
    """DST.partial, ours: made here, its marker written at once (the stop signals held, so never one without the
    other), or one a stop or a kill left, of the same source and quality (its marker says so), which is finished (a
    line says so). Any other DST.partial is refused, left as it is. Returns its marker's contents."""
    mine = dict(src=os.path.abspath(src), quality=quality)
    if not os.path.lexists(partial):
        with held(), writing(partial):
            os.mkdir(partial)  # fails where anything took the name meanwhile: a folder that was there is never ours
            write_file(os.path.join(partial, MARKER), json.dumps(mine))
        return mine
    made = read_marker(partial) if os.path.isdir(partial) and not os.path.islink(partial) else None
    if made is None:
        raise UserError(f"{partial} exists and reencode.py did not make it (it has no {MARKER}): it is left as it "
                        "is; rename or remove it, or pass another DST")
    if (made.get("src"), made.get("quality")) != (mine["src"], quality):
        raise UserError(f"{partial} is a copy of {made.get('src')} at quality {made.get('quality')} cut short: "
                        "finish it with that SRC and --quality, or remove it")
    print(f"=> {partial}: a copy cut short (a stop, a kill); finishing it", flush=True)
    return mine


def start_partial(partial, folders):
    """Every folder of the tree in DST.partial (ours), without the half-written file of a worker a kill ended."""
    with writing(partial):
        for folder, _, names in os.walk(partial):
            for name in [n for n in names if n.endswith(".tmp")]:
                os.remove(os.path.join(folder, name))
        for folder in folders:
            os.makedirs(os.path.join(partial, folder), exist_ok=True)


def remove_ours(partial):
    """Remove DST.partial, ours (it has our marker), its marker last: a kill midway leaves it still ours. What cannot
    be removed stays (the failure that led here is the one reported, not a stop that came meanwhile)."""
    with held(then_stop=False):
        for name in os.listdir(partial):
            path = os.path.join(partial, name)
            if name != MARKER:
                with contextlib.suppress(OSError):
                    shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        with contextlib.suppress(OSError):
            os.remove(os.path.join(partial, MARKER))
            os.rmdir(partial)


def reencode(src, dst, quality, workers=1, stopping=lambda: False):
    """Write dst from src (see the module's doc); returns {images, seconds, psnr_db} (psnr that of the copy when dst
    existed). stopping(): a caller's stop request, honoured between two images (Stopped; DST.partial kept)."""
    if not 1 <= quality <= 95:
        raise UserError(f"--quality {quality} is outside PIL's 1-95: pick one in that range")
    dst = dst.rstrip("/") or dst
    partial = dst + ".partial"
    STOP.finished = False
    refuse_overlap(src, dst, partial)
    said = finished(src, dst, quality)
    if said:
        return said
    folders, files = tree(src) if os.path.isdir(src) else ([], [])
    if not files:
        raise UserError(f"no image files under {src}: pass the folder of an image tree (e.g. an ImageFolder)")
    refuse_collisions(src, dst, folders, files)
    start = time.time()
    mine = own_partial(src, partial, quality)
    try:
        start_partial(partial, folders)
        error, values = copy_all(src, partial, files, quality, workers, stopping)
        psnr = 10 * math.log10(255 ** 2 / (error / values)) if error else math.inf
        with writing(dst):
            write_file(os.path.join(partial, MARKER), json.dumps(dict(mine, images=len(files), psnr_db=psnr)))
            with held():
                os.replace(partial, dst)
                STOP.finished = True
    except Stopped:  # DST.partial is kept: the same command finishes it
        raise
    except BaseException:  # a failure: DST.partial, ours, is removed
        remove_ours(partial)
        raise
    return dict(images=len(files), seconds=round(time.time() - start, 2), psnr_db=round(psnr, 3), existed=False)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="the image tree (e.g. an ImageFolder with train/ and val/)")
    parser.add_argument("dst", help="its copy, written once")
    parser.add_argument("--quality", type=int, required=True, help="JPEG quality, 1-95")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="processes encoding, at most one a core (default: one a core)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        raise UserError(f"--workers {args.workers}: give 1 or more (1 encodes in this process)")
    if args.workers > len(os.sched_getaffinity(0)):
        from sce.cli import cap_processes  # here only: it imports torch
        args.workers = cap_processes(args.workers)
    try:
        said = reencode(args.src, args.dst, args.quality, args.workers)
    except Stopped as e:
        partial = args.dst.rstrip("/") + ".partial"
        stopped(e, f"what was copied is kept in {partial}; run the same command again to finish the copy"
                if read_marker(partial) else None)
    print(json.dumps(dict(what="reencode", src=args.src, dst=args.dst, quality=args.quality, **said)), flush=True)
    if STOP.signal:
        print(f"=> reencode.py: {STOP.signal} came once the copy was whole: nothing is left to do", flush=True)


def stopped(why, then=None):
    """Exit STOPPED_EXIT_CODE with one line: stopped by `why`, `then` what to do (by default: nothing was begun)."""
    then = f": {then}" if then else " before copying anything: run the same command again"
    print(f"=> reencode.py stopped by {why}{then} (exiting with code {STOPPED_EXIT_CODE})", flush=True)
    sys.exit(STOPPED_EXIT_CODE)


def run():
    """The script: its stop signals taken over (stop), a UserError as one line."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
    except Stopped as e:  # before the copy began (the flags read, sce.cli imported)
        stopped(e)


if __name__ == "__main__":
    run()
