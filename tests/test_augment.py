"""Augmentations: Table 2 and torchvision's random stream (CPU pipeline), and the batched device ops
against torchvision.transforms.v2.functional, op by op and chained, for every row."""
import itertools
import math
import warnings

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from sklearn.datasets import load_sample_image
from torch.utils.data import default_collate
from torchvision.transforms.v2 import functional as TF

from sce import UserError
from sce import device_augment as D
from sce.augment import AUGMENTATIONS, MEAN, STD, View, apply_photometric_pil, blur_kernel_size, unpack_params

# the paper's Table 2, written out independently of sce.augment:
# p(jitter), (brightness, contrast, saturation, hue), p(gray), p(blur), p(solarize)
TABLE2 = {
    "weak": (0, None, 0, 0, 0),
    "strong": (0.8, (0.4, 0.4, 0.4, 0.1), 0.2, 0.5, 0),
    "strong-alpha": (0.8, (0.4, 0.4, 0.2, 0.1), 0.2, 1.0, 0),
    "strong-beta": (0.8, (0.4, 0.4, 0.2, 0.1), 0.2, 0.1, 0.2),
    "strong-gamma": (0.8, (0.4, 0.4, 0.2, 0.1), 0.2, 0.5, 0.2),
}
PIXEL = 1 / 255


@pytest.fixture(scope="module")
def photo():
    return Image.fromarray(load_sample_image("china.jpg"))


class SigmaSizedBlur(T.GaussianBlur):
    """torchvision's GaussianBlur (same sigma draw) with taps covering +-3 sigma."""

    def forward(self, img):
        sigma = self.get_params(*self.sigma)
        size = 2 * math.ceil(3 * sigma) + 1
        return TF.gaussian_blur(img, [size, size], [sigma, sigma])


def torchvision_compose(row, size):
    """The view as torchvision's own random transforms build it (blur sigma in [0.1, 2], solarize at 128)."""
    p_jitter, jitter, p_gray, p_blur, p_solarize = TABLE2[row]
    ops = [T.RandomResizedCrop(size, scale=(0.2, 1.0)), T.RandomHorizontalFlip()]
    if p_jitter:
        ops.append(T.RandomApply([T.ColorJitter(*jitter)], p=p_jitter))
    if p_gray:
        ops.append(T.RandomGrayscale(p_gray))
    if p_blur:
        ops.append(T.RandomApply([SigmaSizedBlur(3, sigma=(0.1, 2.0))], p=p_blur))
    if p_solarize:
        ops.append(T.RandomSolarize(128, p=p_solarize))
    return T.Compose(ops + [T.ToTensor(), T.Normalize(MEAN, STD)])


@pytest.mark.parametrize("row", list(TABLE2))
def test_cpu_views_equal_torchvision_transforms(row, photo):
    """Same seed, same view, bit for bit: the table is Table 2 and the random parameters are drawn
    in torchvision's order (so both pipelines follow the stream the CPU pipeline always used)."""
    assert AUGMENTATIONS[row] == TABLE2[row]
    reference, view = torchvision_compose(row, 48), View(row, 48)
    for seed in range(12):
        torch.manual_seed(seed)
        expected = reference(photo)
        torch.manual_seed(seed)
        assert torch.equal(view(photo), expected), (row, seed)
    with pytest.raises(UserError, match="unknown augmentation"):
        View("medium", 32)


def random_images(n=12, h=24, w=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g, dtype=torch.uint8).float() / 255


def per_image(fn, x, *values):
    return torch.stack([fn(x[i], *[v[i].item() for v in values]) for i in range(len(x))])


def test_each_device_op_equals_torchvision_v2():
    x = random_images()
    factor = torch.linspace(0, 2, len(x))  # 0 included: black, flat grey, grayscale
    shift = torch.linspace(-0.5, 0.5, len(x))
    sigma = torch.linspace(0.1, 2.0, len(x))
    checks = [
        (D.brightness(x.clone(), factor), per_image(TF.adjust_brightness, x, factor), PIXEL),
        (D.contrast(x.clone(), factor), per_image(TF.adjust_contrast, x, factor), PIXEL),
        (D.saturation(x.clone(), factor), per_image(TF.adjust_saturation, x, factor), PIXEL),
        (D.hue(x.clone(), shift), per_image(TF.adjust_hue, x, shift), 2 * PIXEL),
        (D.grayscale(x), per_image(lambda im: TF.rgb_to_grayscale(im, 3), x), PIXEL),
        (D.gaussian_blur(x, sigma), per_image(
            lambda im, s: TF.gaussian_blur(im, [blur_kernel_size(s)] * 2, [s, s]), x, sigma), PIXEL),
    ]
    checks.append((D.solarize(x), per_image(lambda im: TF.solarize(im, 0.5), x), PIXEL))
    for i, (ours, reference, tolerance) in enumerate(checks):
        assert ours.shape == reference.shape
        assert (ours - reference).abs().max() <= tolerance, i
    # hue of a gray pixel is undefined: it must stay gray
    assert torch.equal(D.hue(torch.full((1, 3, 2, 2), 0.5), torch.tensor([0.3])), torch.full((1, 3, 2, 2), 0.5))


def reference_chain(x, params):
    """One image through torchvision.transforms.v2.functional with the drawn parameters."""
    if params["jitter"]:
        ops = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
        for i in params["order"].tolist():
            x = ops[i](x, params["factors"][i].item())
    if params["gray"]:
        x = TF.rgb_to_grayscale(x, 3)
    if params["sigma"] > 0:
        x = TF.gaussian_blur(x, [blur_kernel_size(params["sigma"].item())] * 2, [params["sigma"].item()] * 2)
    if params["solarize"]:
        x = TF.solarize(x, 0.5)
    return x


@pytest.mark.parametrize("row", list(TABLE2))
def test_device_chain_equals_torchvision_v2(row, photo):
    torch.manual_seed(0)
    view, image = View(row, 40, on_device=True), TF.pil_to_tensor(photo)
    samples = [view(image) for _ in range(40)]
    crops, rows = default_collate(samples)
    assert crops.dtype == torch.uint8 and crops.shape == (40, 3, 40, 40) and rows.shape == (40, 12)
    params = unpack_params(rows)
    x = crops.float() / 255
    ours = D.photometric(x.clone(), params)
    reference = torch.stack([reference_chain(x[i], {k: v[i] for k, v in params.items()}) for i in range(40)])
    assert (ours - reference).abs().max() <= (2 if TABLE2[row][0] else 1) * PIXEL
    if TABLE2[row][0]:  # the batch mixes applied and skipped ops, and several jitter orders
        assert 0 < params["jitter"].sum() < 40 and len({tuple(o) for o in params["order"].tolist()}) > 3
    # normalisation, dtype and memory format of the final view
    view_batch = D.augment(crops, rows, "cpu", torch.bfloat16, channels_last=True)
    expected = (reference - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    assert view_batch.dtype == torch.bfloat16 and view_batch.is_contiguous(memory_format=torch.channels_last)
    assert (view_batch.float() - expected).abs().max() <= 0.04  # bf16 has 8 bits of mantissa


def test_both_pipelines_give_the_same_views(photo):
    """Same seed, same crop and parameters; the CPU pipeline rounds to 8 bits after each PIL op
    (hue through PIL's 8-bit HSV), the device one works in float."""
    cpu, device = View("strong-gamma", 48), View("strong-gamma", 48, on_device=True)
    diffs = []
    for seed in range(10):
        torch.manual_seed(seed)
        expected = cpu(photo)
        torch.manual_seed(seed)
        crops, params = default_collate([device(TF.pil_to_tensor(photo))])
        ours = D.augment(crops, params, "cpu")[0]
        diffs.append(((ours - expected) * torch.tensor(STD).view(3, 1, 1)).abs())
    assert max(d.max() for d in diffs) < 16 * PIXEL and np.mean([d.mean() for d in diffs]) < 2 * PIXEL


def test_color_jitter_in_every_order():
    """Hue runs once for the batch, the other ops in slots around it: each of the 24 orders still
    applies the four ops in its own order (torchvision, image by image)."""
    orders = torch.tensor([list(p) for p in itertools.permutations(range(4))])
    x = random_images(n=len(orders), seed=1)
    factors = torch.tensor([[0.7, 1.3, 0.6, 0.08]]).repeat(len(orders), 1)
    jitter = torch.arange(len(orders)) != 5  # one sample without jitter: unchanged
    ours = D.color_jitter(x, jitter, orders, factors)
    ops = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
    for i, order in enumerate(orders.tolist()):
        expected = x[i]
        for op in order if jitter[i] else []:
            expected = ops[op](expected, factors[i, op].item())
        assert (ours[i] - expected).abs().max() <= 2 * PIXEL, order
    assert torch.equal(ours[5], x[5])


def test_every_image_gray_then_some_blurred_or_solarized():
    # every row gray, then per-row blur and solarize on top of the (expanded) gray image
    crops = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8)
    params = dict(jitter=torch.zeros(3, dtype=torch.bool), order=torch.arange(4).repeat(3, 1),
                  factors=torch.tensor([[1.0, 1.0, 1.0, 0.0]] * 3), gray=torch.ones(3, dtype=torch.bool),
                  sigma=torch.tensor([1.0, 0.0, 0.0]), solarize=torch.tensor([False, True, False]))
    out = D.photometric(crops / 255, params)
    gray = D.grayscale(crops / 255)
    assert torch.allclose(out[2], gray[2]) and torch.allclose(out[1], D.solarize(gray[1:2])[0])
    assert torch.allclose(out[0], D.gaussian_blur(gray[:1], torch.tensor([1.0]))[0], atol=1e-6)
    assert torch.equal(out[:, 0], out[:, 1])  # still gray


def test_views_to_device_handles_both_kinds():
    normalised = [torch.randn(2, 3, 8, 8)]
    out = D.views_to_device(normalised, "cpu", torch.bfloat16, channels_last=True)
    assert out[0].dtype == torch.bfloat16 and out[0].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out[0].float(), normalised[0].to(torch.bfloat16).float())
    crops, rows = strong_batch(n=4)  # and (uint8 crops, parameters) pairs, augmented
    out = D.views_to_device([(crops, rows)], "cpu", torch.bfloat16, channels_last=True)
    assert torch.equal(out[0], D.augment(crops, rows, "cpu", torch.bfloat16, channels_last=True))


def effective_sigma(image):
    """Standard deviation, along x, of the light an impulse was spread into."""
    profile = image.double().sum(dim=0)
    x = torch.arange(len(profile), dtype=torch.float64) - len(profile) // 2
    return float(((profile * x ** 2).sum() / profile.sum()).sqrt())


@pytest.mark.parametrize("size", [32, 64, 96, 224])
def test_blur_has_the_requested_sigma_at_every_size(size):
    """A line impulse blurred with sigma s spreads with standard deviation s (within 10%), for both
    pipelines: a kernel sized from the image (3 taps at 32 px) made sigma 2 act like 0.8. A line,
    not a point, so that the 8-bit CPU pipeline keeps the tails."""
    impulse = torch.zeros(1, 1, size, size)
    impulse[..., size // 2] = 1.0
    for sigma in (0.5, 1.0, 2.0):
        device = D.gaussian_blur(impulse.expand(1, 3, -1, -1), torch.tensor([sigma]))
        assert effective_sigma(device[0, 0]) == pytest.approx(sigma, rel=0.1), ("device", size, sigma)
        pil = Image.fromarray((impulse[0, 0].numpy() * 255).astype(np.uint8)).convert("RGB")
        params = dict(jitter=False, gray=False, sigma=sigma, solarize=False)
        cpu = TF.pil_to_tensor(apply_photometric_pil(pil, params))[0]
        assert effective_sigma(cpu) == pytest.approx(sigma, rel=0.1), ("cpu", size, sigma)


def test_blur_with_sigma_zero_leaves_the_image_exactly():
    x = random_images(n=3)
    out = D.gaussian_blur(x, torch.tensor([0.0, 1.5, 0.0]))
    assert torch.equal(out[0], x[0]) and torch.equal(out[2], x[2]) and not torch.allclose(out[1], x[1])


def strong_batch(n=16, size=32):
    torch.manual_seed(0)
    view = View("strong-gamma", size, on_device=True)
    image = torch.randint(0, 256, (3, 60, 70), dtype=torch.uint8)
    return default_collate([view(image) for _ in range(n)])


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile unsupported here")
def test_compiled_augmentation_equals_eager(monkeypatch):
    """What CUDA runs by default: the chain compiled (here by inductor's C++ backend), one graph."""
    monkeypatch.setattr(D, "COMPILED", {})
    monkeypatch.setattr(D, "compile_failed", False)
    crops, rows = strong_batch()
    weak_rows = torch.zeros_like(rows)
    for r in (rows, weak_rows):  # augment_batch, then crop_batch (no photometric op)
        eager = D.augment(crops, r, "cpu", torch.bfloat16, channels_last=True, compile=False)
        compiled = D.augment(crops, r, "cpu", torch.bfloat16, channels_last=True, compile=True)
        assert compiled.dtype == torch.bfloat16 and compiled.is_contiguous(memory_format=torch.channels_last)
        assert (compiled.float() - eager.float()).abs().max() <= 0.016  # 1 bf16 step at 2-4, from fp32 rounding
        assert (compiled.float() != eager.float()).float().mean() < 0.01
    assert set(D.COMPILED) == {"augment_batch", "crop_batch"} and not D.compile_failed


def test_augmentation_falls_back_to_eager_when_compile_fails(monkeypatch):
    def broken_compile(fn, **kwargs):
        def fail(*args):
            raise RuntimeError("Cannot find a working triton installation\nmore lines")
        return fail
    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(D, "COMPILED", {})
    monkeypatch.setattr(D, "compile_failed", False)
    crops, rows = strong_batch(n=4)
    with pytest.warns(UserWarning, match="failed \\(Cannot find a working triton installation\\); running it eagerly"):
        out = D.augment(crops, rows, "cpu", compile=True)
    assert D.compile_failed
    assert torch.equal(out, D.augment(crops, rows, "cpu", compile=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second try, no second warning
        assert torch.equal(out, D.augment(crops, rows, "cpu", compile=True))
