"""Checkpoints: atomic writes, keep-last-K, safe loading, and trunk extraction for evaluation.

A main_pretrain.py checkpoint is a dict with kind "pretrain", epoch (completed epochs), step
(completed optimizer steps), args (dict), model (MomentumModel state dict: encoder.*, projector.*,
predictor.*, momentum_encoder.*, momentum_projector.*, queue, queue_ptr), optimizer, scaler and
the RNG/data position needed to continue. main_lincls.py writes kind "lincls" with a
torchvision-style model (conv1..., layerN..., fc.*). A plain torchvision state dict is accepted
wherever a trunk is read.
"""
import glob
import os
import queue
import re
import shutil
import threading

import torch

from sce import FED_MEAN, FED_STD, UserError, foreign, temporary, torchzip, unpickling
from sce.builder import build_trunk
from sce.compiling import error_line
from sce.timing import Stopwatch


def save_atomic(obj, path, second=None, what="checkpoint"):
    """torch.save to a temporary file in the same folder, fsync, then rename over `path`: a crash or a
    full disk leaves the previous file intact. `second`: another name of the new file (write_atomic); `what`: the
    file's name in an error."""
    write_atomic(path, lambda f: torch.save(obj, f), second, what)


def copy_atomic(source, path):
    """save_atomic of a file already written: its bytes copied, not serialised again."""
    def copy(f):
        with open(source, "rb") as src:
            shutil.copyfileobj(src, f, 16 * 2 ** 20)
    write_atomic(path, copy)


def write_atomic(path, write, second=None, what="checkpoint"):
    """write(f) into a temporary file beside `path`, fsync, then rename over `path`. `second`: a second name of the new
    file (link_atomic), made before the rename: a kill between the two leaves the new file under `second` and the
    previous one under `path`, never `path` replaced without its second name; a failure leaves neither changed."""
    folder, tmp = os.path.dirname(os.path.abspath(path)), temporary(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if second:
            link_atomic(tmp, second)
        os.replace(tmp, path)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except UserError:  # the second name's copy failed (a full disk), and said so
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    except Exception as e:  # a full disk is not always an OSError: torch.save says "unexpected pos"
        if os.path.exists(tmp):
            os.remove(tmp)
        reason = getattr(e, "strerror", None) or error_line(e)
        free = shutil.disk_usage(folder).free / 2 ** 20
        kept = f"the previous {what} is kept" if os.path.exists(path) else "nothing was written"
        raise UserError(f"could not write {what} {path} ({reason}; {free:.0f} MiB free on its disk: free some "
                        f"space or pass another --output-dir); {kept}") from e


def refuse_fewer_epochs(path, epoch, step_in_epoch, epochs):
    """A checkpoint at `epoch` (and `step_in_epoch` into the next) continued with --epochs `epochs`: refused when
    it is already past them (main_pretrain.py and main_lincls.py alike)."""
    begun = epoch + (step_in_epoch > 0)
    if begun > epochs:
        raise UserError(f"{path} is at epoch {begun}, --epochs {epochs} is below it: pass --epochs {begun} or more "
                        "to continue it, or another --output-dir to start afresh")


def require(path, ckpt, keys):
    """The keys a resume reads, one line naming those `ckpt` lacks (a file of another version), not a KeyError;
    a mid-epoch position also needs the data it was on (num_images, data_id)."""
    keys = list(keys) + (["num_images", "data_id"] if ckpt.get("step_in_epoch") else [])
    missing = [k for k in keys if k not in ckpt]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}: it was written by another version; resume it with that "
                        "version, or start afresh in another --output-dir")


def save(state, output_dir, numbered=False, keep=0):
    """checkpoint_last.pth, plus checkpoint_NNNN.pth (NNNN = completed epochs) when `numbered`, a second name of
    the same file made before checkpoint_last.pth is replaced (no kill loses it); keep > 0 keeps only the newest
    `keep` numbered copies."""
    second = numbered_path(output_dir, state["epoch"]) if numbered else None
    save_atomic(state, os.path.join(output_dir, "checkpoint_last.pth"), second)
    if numbered and keep > 0:
        for old in sorted(numbered_checkpoints(output_dir))[:-keep]:
            os.remove(old)


def numbered_path(output_dir, epoch):
    return os.path.join(output_dir, f"checkpoint_{epoch:04d}.pth")


def link_atomic(source, path):
    """`path` made a second name of `source`'s file (a hard link: nothing written twice; the next save_atomic of
    `source` renames a new file over that name, this one keeps the old); a copy where the file system has none."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.link{os.getpid()}")
    try:
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.link(source, tmp)
        os.replace(tmp, path)
    except OSError:
        if os.path.lexists(tmp):
            os.remove(tmp)
        copy_atomic(source, path)


def snapshot(obj, to=None):
    """A copy of a (nested) state, so that the training may go on changing the originals while the copy is written:
    its tensors cloned where they are (CPU), or with `to` a function making each tensor's copy (see Writer.save)."""
    if torch.is_tensor(obj):
        return to(obj) if to else obj.detach().clone()
    if isinstance(obj, dict):
        return {k: snapshot(v, to) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v, to) for v in obj)
    return obj


class Writer:
    """Checkpoints written in the background by one thread, so that an epoch's end does not wait for the disk.
    save() snapshots the state (on its device) and returns; at most one save is in flight (the next waits for it);
    then(fn) runs fn once everything submitted before it is on disk (an epoch's line of log.txt after its
    checkpoint). A failed write (a full disk: a UserError naming it) drops what was queued behind it and is raised
    by the next save(), then() or wait(): at the next epoch's end, a stop, or the run's end, which all wait.
    stopwatch: the Stopwatch of the training thread's time in save() (the snapshot, a wait for the save before it): the
    epoch ends' part of the time split (sce.timing.Split.stopwatch)."""

    def __init__(self, stopwatch=None):
        self.jobs, self.error, self.stream = queue.Queue(), None, None  # stream: the copies to the host (a GPU's)
        self.stopwatch = stopwatch or Stopwatch()
        self.thread = threading.Thread(target=self._work, daemon=True, name="checkpoint-writer")
        self.thread.start()

    def _work(self):
        while True:
            job = self.jobs.get()
            try:
                if self.error is None:
                    job()
            except BaseException as e:  # noqa: BLE001: raised in the training thread by the next call
                self.error = e
            finally:
                job = None  # its state (a GPU's: pinned host copies) is freed now, not at the next job
                self.jobs.task_done()

    def save(self, state, output_dir, numbered=False, keep=0):
        self.stopwatch.timed(self._save, state, output_dir, numbered, keep)

    def _save(self, state, output_dir, numbered, keep):
        self.wait()
        if not any(t.is_cuda for t in _tensors(state)):
            copy, ready, clones = snapshot(state), None, None
        else:  # a GPU's tensors: cloned there in stream order, then copied to pinned host memory on a side stream,
            # so that the writer thread only writes bytes (its own copies to the host would stall the training's
            # stream and hold the GIL the training's launches need: the next epoch's first steps ran 20% slower)
            self.stream = self.stream or torch.cuda.Stream()
            clones = snapshot(state, lambda t: t.detach().clone() if t.is_cuda else t)
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                copy = snapshot(clones, lambda t: t.to("cpu", non_blocking=True) if t.is_cuda else t.clone())
            ready = torch.cuda.Event()
            ready.record(self.stream)

        held = [clones]  # the GPU clones live until their copies to the host are done

        def write():
            if ready is not None:
                ready.synchronize()
                held.clear()
            save(copy, output_dir, numbered, keep)
        self.jobs.put(write)

    def then(self, fn):
        self._raise()
        self.jobs.put(fn)

    def wait(self, quiet=False):
        """Until everything submitted is done; raises the error of a failed write (quiet: says it, while another
        error ends the run)."""
        self.jobs.join()
        if quiet and self.error is not None:
            print(f"error: {self.error}", flush=True)
            self.error = None
        self._raise()

    def _raise(self):
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def numbered_checkpoints(output_dir):
    return [p for p in glob.glob(os.path.join(output_dir, "checkpoint_*.pth"))
            if re.fullmatch(r"checkpoint_\d+\.pth", os.path.basename(p))]


def load(path, lazy=False):
    """A checkpoint read on the CPU whatever device saved it, running none of its code: ours and plain state dicts
    with torch.load(weights_only=True); a zip holding other codes' objects (the SCE authors' Lightning files:
    omegaconf's configs) with sce.unpickling, within its bound on objects, those of other codes (sce.foreign) read
    as {"kind": "foreign", ...}. lazy: a zip's tensors left unread (sce.torchzip.Stored: their shapes known), to
    check a file before any work."""
    if os.path.isdir(path):
        raise UserError(f"checkpoint {path} is a directory, not a file: pass the checkpoint in it, e.g. "
                        f"{os.path.join(path, 'checkpoint_last.pth')}")
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist: check the path")
    with open(path, "rb") as f:
        head = f.read(64)
    if not head.startswith((b"PK\x03\x04", b"\x80")):  # torch.save's zip, or its legacy pickle
        shown = head[:24].decode("ascii", "replace").splitlines()[0] if head.strip() else "nothing"
        raise UserError(f"{path} is not a PyTorch checkpoint (it begins {shown!r}, not as a file of torch.save): "
                        "pass the checkpoint_last.pth of a run")
    if head.startswith(b"PK"):
        read = _read_zip(path, lazy)
        if read is not None:
            return read
    else:
        _scan_legacy(path)
    return _torch_load(path)


def _scan_legacy(path):
    """torch's legacy format (pickles one after another: magic number, protocol, system info, the object) scanned
    before torch.load builds it: a pickle whose shared references expand past sce.unpickling's bound would hang its
    hashing. A cut or damaged file is left to torch.load to name."""
    try:
        with open(path, "rb") as f:
            for _ in range(4):
                unpickling.scan(f, rewind=False)
    except unpickling.Refused as e:
        raise UserError(f"{path} is not read: {e}") from None
    except Exception:  # noqa: BLE001: damaged; torch.load says what it finds
        pass


def _read_zip(path, lazy):
    """The inert read of a torch zip (sce.torchzip): another code's file in our form, its trunks' tensors read
    unless `lazy`; the inert read itself where `lazy` and the file is ours or a plain state dict (its tensors
    Stored), else None (torch.load reads it, and names what is damaged)."""
    try:
        obj, placeholders = torchzip.Archive(path).load()
        found = foreign.recognise(obj, path)
        if found is not None and not lazy:
            found["trunks"] = {k: v and torchzip.tensors(v) for k, v in found["trunks"].items()}
    except unpickling.Refused as e:
        raise UserError(f"{path} is not read: {e}") from None
    except UserError:
        raise
    except Exception:  # noqa: BLE001: a cut or damaged zip or pickle: torch.load says what it finds
        return None
    if found is not None:
        return found
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a {type(obj).__name__}, expected a checkpoint dict")
    outside = sorted(n for n in placeholders if not n.startswith("torch."))
    if outside:  # no layout we know: torch.load would refuse it too
        raise UserError(f"{path} is not a checkpoint we read: it holds objects of {', '.join(outside[:3])} and no "
                        f"trunk under a prefix we know ({', '.join(p for p, _, _ in foreign.PREFIXES[:5])}, ...): "
                        "extract its ResNet's state dict (torchvision names) with the code that wrote it")
    return obj if lazy else None


def _torch_load(path):
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        refused = re.search(r"WeightsUnpickler error:\s*(.+?)\.?( Please|$)", str(e), re.M)
        if refused and refused[1].startswith("Unsupported operand"):  # a pickle of a newer protocol: not torch's
            raise UserError(f"{path} is not a PyTorch checkpoint: a pickle torch.save did not write ({refused[1]}): "
                            "pass the checkpoint_last.pth of a run") from None
        if refused:  # not torch's advice (a load that is not weights-only), which would run the file's code
            raise UserError(f"{path} is not a checkpoint of ours: it holds objects a weights-only load refuses "
                            f"({refused[1]}); open such a file otherwise only if it comes from a source you trust") \
                from None
        raise UserError(f"{path} is not a readable PyTorch checkpoint ({error_line(e)})") from None
    if not isinstance(ckpt, dict):
        raise UserError(f"{path} holds a {type(ckpt).__name__}, expected a checkpoint dict")
    return ckpt


def _strip(state, prefix):
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def trunk_state_dict(ckpt, path="checkpoint", encoder="online"):
    """The torchvision-style ResNet weights (no fc) held by any checkpoint we accept."""
    kind = ckpt.get("kind")
    if kind == "pretrain":
        prefix = "encoder." if encoder == "online" else "momentum_encoder."
        state = _strip(ckpt["model"], prefix)
    elif kind == "foreign":
        state = ckpt["trunks"][encoder]
        if state is None:
            where = f" (no {ckpt['prefixes'][1]})" if ckpt["prefixes"][1] else ""
            raise UserError(f"{path} ({ckpt['what']}) holds no momentum trunk{where}: evaluate its online trunk "
                            "(--encoder online)")
    elif encoder != "online":
        raise UserError(f"{path} has no momentum encoder: only main_pretrain.py checkpoints and other codes' with one "
                        "do")
    elif kind == "lincls":
        state = ckpt["model"]
    else:  # a plain state dict, possibly wrapped as {"state_dict": ...} or saved from DDP
        state = ckpt.get("state_dict", ckpt.get("model", ckpt))
        if isinstance(state, dict) and all(k.startswith("module.") for k in state):
            state = _strip(state, "module.")
    if not isinstance(state, dict) or "conv1.weight" not in state or "layer1.0.conv1.weight" not in state:
        raise UserError(f"{path} holds no torchvision-style ResNet trunk (expected keys conv1.weight, "
                        "layer1.0.conv1.weight, ...; other codes' under the prefixes of docs/published-weights.md): "
                        "pass a main_pretrain.py or main_lincls.py checkpoint or a torchvision ResNet state dict")
    return {k: v for k, v in state.items() if not k.startswith("fc.")}


def checkpoint_arch(ckpt):
    """(arch, small_input) recorded in our checkpoints (other codes': read from their weights), or (None, None) for
    plain state dicts."""
    args = ckpt.get("args") or {}
    return args.get("arch"), args.get("small_input")


def read_as(ckpt, path, encoder):
    """The line saying what another code's file was read as ('=> X.ckpt: the SCE authors' Lightning checkpoint,
    epoch 99, resnet50, online trunk'), None for ours and plain state dicts."""
    if ckpt.get("kind") != "foreign":
        return None
    args = ckpt["args"]
    return (f"=> {path}: {ckpt['what']}, {foreign.describe_arch(args['arch'], args['small_input'])}, {encoder} trunk "
            f"({ckpt['prefixes'][encoder != 'online']})")


def trunk_spec(ckpt, path, arch=None, small_input=None, encoder="online"):
    """(state, arch, small_input) of the trunk `ckpt` holds, its names and shapes checked against the arch's (no
    tensor is read: a lazy load's Stored will do). arch / small_input default to what the checkpoint recorded,
    else to what its weights' shapes say."""
    state = trunk_state_dict(ckpt, path, encoder)
    saved_arch, saved_small = checkpoint_arch(ckpt)
    found_arch, found_small = foreign.resnet_arch(state)
    if saved_arch and arch and saved_arch != arch:
        raise UserError(f"{path} holds a {saved_arch} trunk but --arch {arch} was given: pass --arch {saved_arch}")
    if found_arch and arch and found_arch != arch:
        raise UserError(f"{path} holds a {found_arch} trunk (from its weights' shapes) but --arch {arch} was given: "
                        f"pass --arch {found_arch}")
    arch = arch or saved_arch or found_arch or "resnet50"
    if small_input is None:
        small_input = bool(saved_small) if saved_small is not None else found_small
    with torch.device("meta"):  # the arch's names and shapes, nothing allocated
        expected = build_trunk(arch, small_input)[0].state_dict()
    mismatch = [k for k in expected if k not in state or tuple(state[k].shape) != tuple(expected[k].shape)]
    if mismatch or len(state) != len(expected):
        raise UserError(f"{path} does not fit a {arch}{' (small input)' if small_input else ''} "
                        f"trunk (first differing key: {(mismatch or sorted(set(state) - set(expected)))[0]}): "
                        "pass the --arch (and --small-input) the checkpoint was trained with")
    return state, arch, small_input


def check_trunk(path, arch=None, small_input=None, encoder="online"):
    """`path` checked as load_trunk will read it, its tensors left unread (before an output folder is made): returns
    (arch, small_input, the args the checkpoint recorded)."""
    ckpt = load(path, lazy=True)
    _, arch, small_input = trunk_spec(ckpt, path, arch, small_input, encoder)
    return arch, small_input, ckpt.get("args") if isinstance(ckpt.get("args"), dict) else None


def renormalize(trunk, mean, std):
    """The trunk's inputs, normalised with ImageNet's statistics by the data path, normalised with (mean, std) instead,
    those it was trained with: an exact per-channel affine map before conv1 (non-persistent buffers: its state dict
    is unchanged)."""
    mean, std = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    trunk.register_buffer("input_scale", torch.tensor(FED_STD).view(1, 3, 1, 1) / std, persistent=False)
    trunk.register_buffer("input_shift", (torch.tensor(FED_MEAN).view(1, 3, 1, 1) - mean) / std, persistent=False)
    trunk.register_forward_pre_hook(lambda module, args: (args[0] * module.input_scale + module.input_shift,
                                                          *args[1:]))


def load_trunk(path, arch=None, small_input=None, encoder="online", say=True):
    """Build the trunk and load it strictly from `path`; returns (trunk, feat_dim, ckpt).
    arch/small_input default to what the checkpoint recorded, else to what its weights' shapes say. Another code's
    file: its line said (`say`, on the main process), and its recorded input normalisation applied (renormalize)."""
    ckpt = load(path)
    state, arch, small_input = trunk_spec(ckpt, path, arch, small_input, encoder)
    with torch.device("meta"):  # no random init of weights the file replaces (a ResNet-50's: a second)
        trunk, feat_dim = build_trunk(arch, small_input)
    expected = trunk.state_dict()
    trunk.load_state_dict({k: v.to(expected[k].dtype, copy=True).contiguous() for k, v in state.items()}, assign=True)
    said = say and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)
    if said and read_as(ckpt, path, encoder):
        print(read_as(ckpt, path, encoder), flush=True)
    normalize = ckpt.get("normalize") if ckpt.get("kind") == "foreign" else None
    if normalize:
        renormalize(trunk, *normalize)
        if said:
            print(f"=> its inputs normalised with mean {normalize[0]} std {normalize[1]}, as {path} records for its "
                  "training (ImageNet's statistics otherwise)", flush=True)
    return trunk, feat_dim, ckpt
