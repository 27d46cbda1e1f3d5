"""JPEG files decoded on the training device (`--decode device`, the default on a GPU with JPEG engines).

The loader workers only read each file's bytes, its size from the header and every random parameter
of its views (sce.augment, the same draws in the same order as when they decode it themselves); the
main process decodes the batch's JPEGs with torchvision's decode_jpeg on the device (the GPU's
hardware JPEG engines on A100 / H100 / H200), then crops, resizes (antialiased) and flips each image
there. Each view is a "geometry" row (top, left, height, width of a window of the image, the size it
is resized to, the window of that kept, flip): a random resized crop, or an evaluation's resize and
centre crop.

Files the GPU decoder does not take (PNG and other formats, progressive or CMYK JPEG) are decoded and
transformed by the worker as before, per image, in the same batch. A file the decoder refuses at
decode time is decoded from the same bytes by PIL on the host; one nothing can read is named and
replaced by the next readable image, as the loader does.
"""
import warnings

import torch
import torch.nn.functional as F
import torchvision.transforms as T
import torchvision.transforms.functional as TF

from sce.augment import RRC_RATIO, Encoded, EncodedSample, crop_geometry, normalize_stats, stand_in
from sce.datasets import decode_rgb_tensor
from sce.loader import EvalSamples, UnreadableImage, image_path

try:
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # torchvision without its decoders (TorchCodec era): the workers decode
    decode_jpeg = None


def available(device):
    """Whether JPEGs are best decoded on `device`: torchvision's decoder on a GPU with hardware JPEG
    engines (A100, A30, H100, H200, B200, L4, L40). Elsewhere (V100, T4, A10, consumer GPUs) nvJPEG
    decodes on the host, in the training process, slower than the loader's workers."""
    if decode_jpeg is None or device.type != "cuda":
        return False
    capability, name = torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)
    return capability in ((8, 0), (9, 0)) or capability[0] >= 10 or name.startswith(("NVIDIA L4", "NVIDIA L40"))


def resize_crop_geometry(image_size, resize, crop):
    """The geometry row of torchvision's Resize(resize) (the short side) then CenterCrop(crop)."""
    h, w = image_size
    new_long = int(resize * max(h, w) / min(h, w))
    rh, rw = (resize, new_long) if h <= w else (new_long, resize)
    return torch.tensor([0, 0, h, w, rh, rw, int(round((rh - crop) / 2.0)), int(round((rw - crop) / 2.0)), 0.0])


# ---------------------------------------------------------------- batches

def decode_all(batch, device):
    """The images (3, H, W) uint8 on `device` of a batch's JPEG bytes (collate_views' jpeg and lengths):
    one batched decode_jpeg; if it fails, each image alone, and PIL on the host for those the decoder
    refuses; None for an image nothing reads. On CUDA the decoder runs on a side stream, so that its
    outputs never take memory the current stream's queued work still uses (torchvision's decoder does
    not wait for that stream)."""
    datas = list(batch["jpeg"].split(batch["lengths"]))
    if device.type != "cuda":
        return _decode(datas, device)
    stream, current = _STREAMS.setdefault(str(device), torch.cuda.Stream(device)), torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        images = _decode(datas, device)
    current.wait_stream(stream)
    for image in images:
        if image is not None:
            image.record_stream(current)
    return images


_STREAMS = {}  # device -> the decoder's stream
_warned = []


def _decode(datas, device):
    try:
        return list(decode_jpeg(datas, mode=ImageReadMode.RGB, device=device))
    except RuntimeError as e:  # one refused image fails the whole list
        if not _warned:
            _warned.append(e)
            warnings.warn(f"the device's JPEG decoder refused a batch ({str(e).strip()[:150]}): its images are decoded "
                          "one by one, those it refuses by PIL on the host (slower; this warning is shown once)")
    images = []
    for data in datas:
        try:
            images.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:
            try:
                images.append(decode_rgb_tensor(data.numpy().tobytes()).to(device))
            except Exception:  # noqa: BLE001: damaged beyond PIL too: the caller replaces it
                images.append(None)
    return images


def resample(image, geometry, size, mode="bilinear"):
    """One view of one image before its rounding and flip (crops): uint8 (3, H, W) on the device and
    its geometry row -> float (3, size, size) in [0, 255]."""
    top, left, h, w, rh, rw, wt, wl, _ = (int(v) for v in geometry.tolist())
    x = image[:, top:top + h, left:left + w].unsqueeze(0).float()
    if max(h / rh, w / rw) > 32:  # CUDA's antialiased resize runs out of shared memory past ~90x: two steps
        x = F.interpolate(x, size=(rh * 16, rw * 16), mode=mode, antialias=True, align_corners=False)
    x = F.interpolate(x, size=(rh, rw), mode=mode, antialias=True, align_corners=False)
    return x[0, :, wt:wt + size, wl:wl + size]


def crops(images, geometry, size, mode="bilinear"):
    """The views of decoded images with their geometry rows, (n, 3, size, size) float in [0, 255],
    rounded to integer levels as the workers' uint8 resize rounds, and flipped where asked."""
    x = torch.stack([resample(image, g, size, mode) for image, g in zip(images, geometry)]).round_().clamp_(0, 255)
    flip = geometry[:, 8].to(x.device, non_blocking=True) > 0
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)


def place(n, size, device, pieces):
    """(n, 3, size, size) float on `device` holding `pieces`, [(batch indices, rows or None), ...]; the
    loader pins both, so their copies do not wait for the device."""
    out = torch.empty((n, 3, size, size), device=device)
    for index, rows in pieces:
        if rows is not None and len(index):
            out[index.to(device, non_blocking=True)] = rows.to(device, non_blocking=True).float()
    return out


def pretrain_views(batch, device, refetch):
    """The views of a pretraining batch of sce.loader.collate_views before their photometric ops: per view, float
    (N, 3, size, size) in [0, 255] on the device, and per view the packed parameter rows (N, 12).
    refetch(key): the sample as the workers make it (sce.loader.PretrainDataset.decoded), for an image
    no decoder reads: there it is named and replaced by the next readable one."""
    images = decode_all(batch, device)
    params = [p.clone() for p in batch["params"]]
    readable = [j for j, image in enumerate(images) if image is not None]
    pieces = [[(batch["encoded"][readable], crops([images[j] for j in readable], g[readable], size) if readable
                else None)] for g, size in zip(batch["geometry"], batch["sizes"])]
    for j in (j for j, image in enumerate(images) if image is None):  # named and replaced by the workers' path
        views, bad, reason = refetch(batch["keys"][j])
        place_at = int(batch["encoded"][j])
        batch["bad"][place_at], batch["reasons"][place_at] = bad, reason
        for v, (crop, row) in enumerate(views):
            pieces[v].append((torch.tensor([place_at]), crop[None]))
            params[v][place_at] = row
    n = len(batch["encoded"]) + len(batch["decoded"])
    return [place(n, size, device, pieces[v] + [(batch["decoded"], batch["images"][v])])
            for v, size in enumerate(batch["sizes"])], params


# ---------------------------------------------------------------- evaluation

class DecodedEval(torch.utils.data.Dataset):
    """An evaluation dataset read with sce.datasets.read_encoded, whose JPEGs the device decodes: the
    worker draws the geometry of each, a resize (short side) + centre crop (`resize` given) or, for
    training, a random resized crop + flip; mode: the resize's interpolation. Other files go through
    `transform` (the loader path's torchvision transform, on the worker)."""

    def __init__(self, dataset, size, transform, resize=None, mode="bilinear"):
        self.dataset, self.size, self.transform, self.resize, self.mode = dataset, size, transform, resize, mode
        self.targets, self.classes = getattr(dataset, "targets", None), getattr(dataset, "classes", None)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        img, target = self.dataset[i]
        if not isinstance(img, Encoded):
            return self.transform(TF.to_pil_image(img) if torch.is_tensor(img) else img), target
        if self.resize:
            geometry = resize_crop_geometry(img.size, self.resize, self.size)
        else:
            box = T.RandomResizedCrop.get_params(stand_in(img), (0.08, 1.0), RRC_RATIO)  # T.RandomResizedCrop's
            geometry = crop_geometry(*box, self.size, bool(torch.rand(1) < 0.5))
        return EncodedSample(img.data, [geometry], None, key=image_path(self.dataset, i)), target  # key: names it

    def path(self, i):
        return image_path(self.dataset, i)


def eval_batch(batch, size, device, mode="bilinear"):
    """(normalised images (N, 3, size, size), targets) on the device, of a batch of collate_views from a
    DecodedEval (or a plain batch). mode: the interpolation of the resize (the logistic regression's
    protocol: bicubic)."""
    if not isinstance(batch, dict):
        images, targets = batch
        return images.to(device, non_blocking=True), targets
    decoded = decode_all(batch, device)
    bad = [key for key, image in zip(batch["keys"], decoded) if image is None]
    if bad:  # an evaluation reads every image
        raise UnreadableImage.of(bad[0], "neither the device's JPEG decoder nor PIL reads it", len(bad) - 1)
    scale, shift = normalize_stats(device)
    views = torch.addcmul(shift, crops(decoded, batch["geometry"][0], size, mode) / 255, scale)
    n = len(batch["encoded"]) + len(batch["decoded"])
    return place(n, size, device, [(batch["encoded"], views),
                                   (batch["decoded"], batch["images"][0])]), batch["targets"]


class DecodedLoader:
    """(normalised images on the device, targets) batches of a DataLoader over a DecodedEval (with
    sce.loader.collate_views), as sce.knn.extract_features and main_lincls.py's loops read them."""

    def __init__(self, loader, device, size, mode):
        self.loader, self.device, self.size, self.mode, self.sampler = loader, device, size, mode, loader.sampler

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield eval_batch(batch, self.size, self.device, self.mode)


def decoded_loader(loader, device):
    """A DecodedLoader for a DataLoader over a DecodedEval (or a Subset, an EvalSamples of one); any other,
    unchanged."""
    dataset = getattr(loader, "dataset", None)
    while isinstance(dataset, (torch.utils.data.Subset, EvalSamples)):
        dataset = dataset.dataset
    if not isinstance(dataset, DecodedEval):
        return loader
    return DecodedLoader(loader, device, dataset.size, dataset.mode)
