"""JPEG files decoded on the training device (`--decode device`, the default on a GPU with JPEG engines): the
loader workers only read each file's bytes and its size from the header; the main process decodes a batch's
JPEGs with torchvision's decode_jpeg on the device (the hardware JPEG engines of A100 / H100 / H200). A file
the device's decoder refuses is decoded from the same bytes by PIL on the host; one nothing reads is None,
for the caller to name or replace."""
import warnings

import torch

from sce.data.images import decode_rgb_tensor

try:
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # torchvision without its decoders (TorchCodec era): the workers decode
    decode_jpeg = None


def available(device):
    """Whether JPEGs are best decoded on `device`: torchvision's decoder on a GPU with hardware JPEG engines
    (A100, A30, H100, H200, B200, L4, L40). Elsewhere (V100, T4, A10, consumer GPUs) nvJPEG decodes on the
    host, in the training process, slower than the loader's workers."""
    if decode_jpeg is None or device.type != "cuda":
        return False
    capability, name = torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)
    return capability in ((8, 0), (9, 0)) or capability[0] >= 10 or name.startswith(("NVIDIA L4", "NVIDIA L40"))


class JpegDecoder:
    """decoder(datas) -> the images (3, H, W) uint8 on the device of a list of JPEG files' bytes (uint8 tensors),
    None for an image nothing reads: one batched decode_jpeg; if it fails, each image alone, and PIL on the
    host for those the device refuses (one warning a decoder). On CUDA it decodes on a side stream of its own,
    so that its outputs never take memory the current stream's queued work still uses (torchvision's decoder
    does not wait for that stream)."""

    def __init__(self, device):
        self.device, self.warned = device, False
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, datas):
        if self.stream is None:
            return self._decode(datas)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            images = self._decode(datas)
        current.wait_stream(self.stream)
        for image in images:
            if image is not None:
                image.record_stream(current)
        return images

    def _decode(self, datas):
        try:
            return list(decode_jpeg(datas, mode=ImageReadMode.RGB, device=self.device))
        except RuntimeError as e:  # one refused image fails the whole list
            if not self.warned:
                self.warned = True
                warnings.warn(f"the device's JPEG decoder refused a batch ({str(e).strip()[:150]}): its images are "
                              "decoded one by one, those it refuses by PIL on the host (slower; said once)")
        images = []
        for data in datas:
            try:
                images.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device))
            except RuntimeError:
                try:
                    images.append(decode_rgb_tensor(data.numpy().tobytes()).to(self.device))
                except Exception:  # noqa: BLE001: damaged beyond PIL too: the caller names or replaces it
                    images.append(None)
        return images
