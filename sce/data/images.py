"""One image file read: any mode as 8-bit RGB (PIL, or libjpeg-turbo into a tensor, or a plain JPEG's bytes left for
the device's decoder), and what an unreadable one becomes (pretraining names and replaces it, an evaluation stops)."""
import io
import warnings

import numpy as np
import torch
import torchvision.transforms.functional as TF
from PIL import Image, JpegImagePlugin

try:  # libjpeg-turbo to a tensor; torchvision 0.29 deprecates it for TorchCodec: PIL decodes once it is gone
    from torchvision.io import ImageReadMode, decode_jpeg
    warnings.filterwarnings("ignore", "The image decoding and encoding capabilities of TorchVision are deprecated",
                            DeprecationWarning)  # once per image otherwise, an error under -W error
except ImportError:
    decode_jpeg = None

from sce import UserError


def load_rgb(path):
    """Open any image as 8-bit RGB: grayscale, palette, CMYK, alpha and 16-bit inputs included."""
    with open(path, "rb") as f:
        img = Image.open(f)
        img.load()
    return to_rgb(img)


def to_rgb(img):
    """A loaded PIL image of any mode as 8-bit RGB. Deep modes scale by their mode's range, never by an image's own
    content, so that a stored value is the same 8-bit level in every image: 16-bit gray ("I;16", "I;16B", "I;16L",
    "I;16N", and "I", PIL's 32-bit mode, in which PIL opens 16-bit files: a 16-bit PNG in older Pillows (newer
    ones: "I;16"), a PGM of maxval > 255, scaled to 0..65535) takes v to round(v / 257), 65535 to 255, anything
    outside 0..65535 clipped; float ("F") reads as 8-bit levels as PIL's own convert("L") does (0..255,
    clipped, truncated: a float image in 0..1 reads dark)."""
    if img.mode == "I" or img.mode.startswith("I;16"):
        arr = np.floor(np.asarray(img, dtype=np.float64) / 257.0 + 0.5)
        img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    elif img.mode == "F":
        img = img.convert("L")
    if img.mode in ("P", "LA", "PA"):
        img = img.convert("RGBA")
    return img if img.mode == "RGB" else img.convert("RGB")


def load_rgb_tensor(path):
    """load_rgb as a uint8 tensor (3, H, W), for the loader of --augment gpu (decode_rgb_tensor)."""
    with open(path, "rb") as f:
        return decode_rgb_tensor(f.read())


def decode_rgb_tensor(data):
    """An image file's bytes as a uint8 RGB tensor (3, H, W). A colour or gray JPEG (most photo
    datasets) decodes straight into the tensor with torchvision's libjpeg-turbo: the same pixels as
    PIL's with the wheels of requirements.txt (tested), for ~8% less loader work per image
    (benchmarks/speed/bench_pretrain.py). Unlike PIL, libjpeg prints its warnings about damaged data
    ("Corrupt JPEG data: ...") on stderr, at each read of such a file."""
    img = Image.open(io.BytesIO(data))  # parses the header only
    if decode_jpeg and img.format == "JPEG" and img.mode in ("RGB", "L"):
        try:
            return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        except RuntimeError:
            pass  # a damaged file: PIL's decoder below names the problem, as with --augment cpu
    img.load()
    return TF.pil_to_tensor(to_rgb(img))


def read_header(data):
    """(format, mode, (height, width), plain) of an image file's bytes, from its header alone. plain: a
    JPEG of the kind GPU decoders take, baseline, gray or YCbCr 4:4:4 / 4:2:2 / 4:2:0 (not progressive,
    not CMYK, not Adobe's RGB-coded kind)."""
    img = Image.open(io.BytesIO(data))
    plain = (img.format == "JPEG" and img.mode in ("RGB", "L") and not img.info.get("progressive")
             and img.info.get("adobe_transform") != 0
             and (img.mode == "L" or JpegImagePlugin.get_sampling(img) in (0, 1, 2)))
    return img.format, img.mode, (img.height, img.width), plain


class Encoded:
    """A JPEG file's bytes (uint8 tensor) and its (height, width) from the header: decoded later, on the
    training device (sce.data.jpeg)."""

    def __init__(self, data, size):
        self.data, self.size = data, size


def read_encoded(path):
    """A plain JPEG (read_header), which the training device decodes (sce.data.jpeg), as an Encoded:
    its bytes and its size from the header; any other file (PNG, progressive or CMYK JPEG, ...) decoded
    here into a uint8 tensor (3, H, W), as load_rgb_tensor."""
    with open(path, "rb") as f:
        data = f.read()
    _, _, size, plain = read_header(data)
    if decode_jpeg and plain:
        return Encoded(torch.frombuffer(bytearray(data), dtype=torch.uint8), size)
    return decode_rgb_tensor(data)


READERS = {"pil": load_rgb, "tensor": load_rgb_tensor, "encoded": read_encoded}  # how image files are read


class UnreadableImage(UserError):
    """An image an evaluation cannot read. Raised in a loader worker, torch raises it again in the main
    process with the worker's traceback as its message: the last line, this error's own, is kept."""

    def __init__(self, message):
        super().__init__(message.strip().splitlines()[-1].split("UnreadableImage: ", 1)[-1])

    @classmethod
    def of(cls, dataset, index, reason, others=0):
        more = f"; {others} more unreadable images" if others else ""
        reason = (str(reason).strip().splitlines() or ["?"])[0][:200]
        remedy = getattr(unwrap(dataset, index)[0], "remedy", "fix or remove it")
        return cls(f"cannot read {image_path(dataset, index)} ({reason}){more}: {remedy} (an evaluation reads every "
                   "image)")


def skip_unreadable(dataset, new, total, max_bad):
    """Pretraining replaces an unreadable image by the next readable one: name each one newly met ({index: reason})
    in a warning, and stop once there are more than --max-bad-images in all (`total`)."""
    for i, reason in sorted(new.items()):
        print(f"warning: skipping unreadable image {image_path(dataset, i)} ({reason})", flush=True)
    if total > max_bad:
        raise UserError(f"{total} unreadable images, more than --max-bad-images {max_bad}: fix or remove them (see "
                        "the warnings above)")


def unwrap(dataset, i):
    """(the dataset under any Subsets, and image i's index there)."""
    while isinstance(dataset, torch.utils.data.Subset):
        dataset, i = dataset.dataset, dataset.indices[i]
    return dataset, i


def image_path(dataset, i):
    """The file of image i of a dataset (through Subsets), or its index where it has none (CIFAR, STL10)."""
    dataset, i = unwrap(dataset, i)
    return dataset.path(i) if hasattr(dataset, "path") else f"image #{i}"
