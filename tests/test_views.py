"""The views of Table 2 (sce.data.views, sce.data.ops): the table itself, the draws (a function of (seed, epoch,
index, view), torchvision's distributions), the one crop-and-resize against torchvision's, each photometric op
and the chain against torchvision.transforms.v2.functional, the PIL route against torchvision's ops with the same
parameters, the blur's sigma at every size, and the compiled views."""
import itertools
import math
import warnings

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from sce.data import ops, views
from sce.compiling import Log
from sce.data.pretrain import Views, finish_view

# the paper's Table 2, written out independently of sce.data.views:
# p(jitter), (brightness, contrast, saturation, hue), p(gray), p(blur), p(solarize)
TABLE2 = {
    "weak": (0, None, 0, 0, 0),
    "strong": (0.8, (0.4, 0.4, 0.4, 0.1), 0.2, 0.5, 0),
    "strong-alpha": (0.8, (0.4, 0.4, 0.2, 0.1), 0.2, 1.0, 0),
    "strong-beta": (0.8, (0.4, 0.4, 0.2, 0.1), 0.2, 0.1, 0.2),
    "strong-gamma": (0.8, (0.4, 0.4, 0.2, 0.1), 0.2, 0.5, 0.2),
}
# rows beyond the paper's, for measurements: the strong view without its blur
NOT_TABLE2 = {"strong-noblur": (0.8, (0.4, 0.4, 0.4, 0.1), 0.2, 0, 0)}
ROWS = {**TABLE2, **NOT_TABLE2}
PIXEL = 1 / 255


@pytest.fixture(scope="module")
def photo():
    from sklearn.datasets import load_sample_image  # here: importing scikit-learn takes ~2 s of collection
    return Image.fromarray(load_sample_image("china.jpg")).resize((120, 90))


def rows_of(aug, n=400, size=24, height=90, width=120, seed=0, epoch=0, view=1):
    return views.draw(views.ViewSpec(aug, size), seed, epoch, np.arange(n), view, height=[height] * n,
                      width=[width] * n)


# ---------------------------------------------------------------- the table and the draws

def test_table2_and_the_draws_follow_torchvisions_distributions():
    assert views.AUGMENTATIONS == ROWS
    for aug, (p_jitter, jitter, p_gray, p_blur, p_solarize) in ROWS.items():
        rows = rows_of(aug, n=4000)
        p = views.Photometric.of(rows)
        for drawn, expected in ((p.jitter, p_jitter), (p.gray, p_gray), (p.sigma > 0, p_blur),
                                (p.solarize, p_solarize), (rows[:, 4] > 0, 0.5)):
            assert abs(drawn.float().mean().item() - expected) < 0.03, aug
        if jitter:  # factors in [1 - s, 1 + s], hue in [-h, h]; every order of the four ops
            low, high = p.factors.min(0).values, p.factors.max(0).values
            bounds = torch.tensor([1 - jitter[0], 1 - jitter[1], 1 - jitter[2], -jitter[3]])
            assert torch.allclose(low, bounds, atol=0.01) and torch.allclose(high, bounds + 2 * torch.tensor(jitter),
                                                                              atol=0.01)
            assert len({tuple(o) for o in p.order.tolist()}) == 24
        sigma = p.sigma[p.sigma > 0]
        assert len(sigma) == 0 or (sigma.min() >= 0.1 and sigma.max() <= 2.0)
    top, left, h, w = rows_of("weak", n=4000)[:, :4].unbind(1)
    area = h * w / (90 * 120)
    assert area.min() >= 0.2 - 0.01 and area.max() <= 1 and (top >= 0).all() and (top + h <= 90).all()
    assert (w / h).min() >= 3 / 4 - 0.05 and (w / h).max() <= 4 / 3 + 0.05 and (left + w <= 120).all()


def torchvision_get_params(u, height, width, scale, ratio=views.RRC_RATIO):
    """RandomResizedCrop.get_params transcribed with its draws read from u, one image."""
    area = height * width
    for attempt in range(views.RRC_ATTEMPTS):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * float(u[2 * attempt]))
        log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * float(u[2 * attempt + 1]))
        w, h = int(round(math.sqrt(target_area * aspect))), int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return (math.floor(float(u[2 * views.RRC_ATTEMPTS]) * (height - h + 1)),
                    math.floor(float(u[2 * views.RRC_ATTEMPTS + 1]) * (width - w + 1)), h, w)
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


@pytest.mark.parametrize("height,width,scale", [(40, 48, (0.2, 1.0)), (16, 64, (0.9, 1.0)), (64, 16, (0.95, 1.0))])
def test_crop_parameters_are_torchvisions(height, width, scale):
    """The batched draw equals torchvision's get_params, image by image, fallbacks (narrow images) included."""
    u = views.uniforms(0, 0, np.arange(300), 0)
    got = views.random_resized_crops(u, [height] * 300, [width] * 300, scale)
    for i in range(300):
        assert tuple(int(g[i]) for g in got) == torchvision_get_params(u[i], height, width, scale), i


def test_the_draws_are_a_function_of_seed_epoch_index_and_view():
    """However they are batched (one image in a worker, a batch, a whole epoch), the same numbers; any of the
    four changes them."""
    spec = views.ViewSpec("strong-gamma", 24)
    batch = views.draw(spec, 3, 2, np.arange(500), 1, height=[90] * 500, width=[120] * 500)
    assert all(torch.equal(batch[i], views.draw(spec, 3, 2, [i], 1, height=[90], width=[120])[0])
               for i in range(0, 500, 13))
    for other in ((4, 2, 1), (3, 3, 1), (3, 2, 0)):  # seed, epoch, view
        seed, epoch, view = other
        assert not torch.equal(batch, views.draw(spec, seed, epoch, np.arange(500), view, height=[90] * 500,
                                                  width=[120] * 500))
    assert not torch.equal(batch[:250], batch[250:])  # index


# ---------------------------------------------------------------- crop and resize

def test_the_crop_and_resize_is_torchvisions():
    """Shrinking, enlarging, flipped windows, in a batch (products) against torchvision's antialiased resized_crop
    in float rounded to levels, and alone (interpolate), a uint8 image on the CPU (a loader worker's crop)
    torchvision's in uint8, which is a level off the float one in some pixels; a window reaching outside is
    zero-padded there; the bicubic resize + centre crop of the evaluations too."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (6, 3, 40, 48), generator=g, dtype=torch.uint8)
    boxes = [(0, 0, 40, 48), (3, 5, 20, 30), (10, 2, 12, 9), (0, 40, 40, 8), (20, 10, 7, 33), (1, 1, 39, 47)]
    flip = [False, True, False, True, False, True]
    rows = torch.tensor([box + (f,) for box, f in zip(boxes, flip)], dtype=torch.float64)
    batched = ops.resized_crops(x, rows, 24)
    for n, (t, l, hh, ww) in enumerate(boxes):
        expected = TF.resized_crop(x[n].float(), t, l, hh, ww, [24, 24], antialias=True)
        expected = (TF.hflip(expected) if flip[n] else expected).round()
        got = batched[n]  # float rounding may tip a tie (.5, common when enlarging) either way
        assert (got - expected).abs().max() <= 1 and (got != expected).float().mean() < 0.05, n
        alone = ops.resized_crops(x[n:n + 1], rows[n:n + 1], 24)[0]
        in_uint8 = TF.resized_crop(x[n], t, l, hh, ww, [24, 24], antialias=True)
        assert torch.equal(alone, (TF.hflip(in_uint8) if flip[n] else in_uint8).float()), n
        assert (alone - expected).abs().max() <= 1 and (alone != expected).float().mean() < 0.3, n
        floats = ops.resized_crops(x[n:n + 1].float(), rows[n:n + 1], 24)[0]  # a float image alone: the products'
        assert (floats - expected).abs().max() <= 1 and (floats != expected).float().mean() < 0.05, n
    padded = ops.resized_crops(x[:1], torch.tensor([[-4.0, -4.0, 40.0, 40.0, 0]]), 40)  # not a resize: a shift
    assert torch.equal(padded[0, :, 4:, 4:], x[0, :, :36, :36].float()) and padded[0, :, :4].abs().sum() == 0
    image = torch.randint(0, 256, (3, 50, 70), generator=g, dtype=torch.uint8)
    for mode, interpolation in (("bilinear", T.InterpolationMode.BILINEAR), ("bicubic", T.InterpolationMode.BICUBIC)):
        expected = T.CenterCrop(32)(TF.resize(image.float(), 36, interpolation=interpolation, antialias=True))
        assert (ops.resize_center_crop(image, 36, 32, mode) - expected.round().clamp(0, 255)).abs().max() <= 1


# ---------------------------------------------------------------- the photometric ops

def random_images(n=12, h=24, w=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g, dtype=torch.uint8).float() / 255


def per_image(fn, x, *values):
    return torch.stack([fn(x[i], *[v[i].item() for v in values]) for i in range(len(x))])


def test_each_photometric_op_equals_torchvision_v2():
    x = random_images()
    factor = torch.linspace(0, 2, len(x))  # 0 included: black, flat grey, grayscale
    shift = torch.linspace(-0.5, 0.5, len(x))
    sigma = torch.linspace(0.1, 2.0, len(x))
    checks = [
        (ops.brightness(x.clone(), factor), per_image(TF.adjust_brightness, x, factor), PIXEL),
        (ops.contrast(x.clone(), factor), per_image(TF.adjust_contrast, x, factor), PIXEL),
        (ops.saturation(x.clone(), factor), per_image(TF.adjust_saturation, x, factor), PIXEL),
        (ops.hue(x.clone(), shift), per_image(TF.adjust_hue, x, shift), 2 * PIXEL),
        (ops.grayscale(x), per_image(lambda im: TF.rgb_to_grayscale(im, 3), x), PIXEL),
        (ops.gaussian_blur(x, sigma), per_image(
            lambda im, s: TF.gaussian_blur(im, [ops.blur_kernel_size(s)] * 2, [s, s]), x, sigma), PIXEL),
        (ops.solarize(x), per_image(lambda im: TF.solarize(im, 0.5), x), PIXEL)]
    for i, (ours, reference, tolerance) in enumerate(checks):
        assert ours.shape == reference.shape and (ours - reference).abs().max() <= tolerance, i
    # hue of a gray pixel is undefined: it must stay gray; sigma 0 leaves an image exactly
    assert torch.equal(ops.hue(torch.full((1, 3, 2, 2), 0.5), torch.tensor([0.3])), torch.full((1, 3, 2, 2), 0.5))
    blurred = ops.gaussian_blur(x[:3], torch.tensor([0.0, 1.5, 0.0]))
    assert torch.equal(blurred[0], x[0]) and torch.equal(blurred[2], x[2]) and not torch.allclose(blurred[1], x[1])


def test_color_jitter_in_every_order():
    """Hue runs once for the batch, the other ops in slots around it: each of the 24 orders still applies the
    four ops in its own order (torchvision, image by image)."""
    orders = torch.tensor([list(p) for p in itertools.permutations(range(4))])
    x = random_images(n=len(orders), seed=1)
    factors = torch.tensor([[0.7, 1.3, 0.6, 0.08]]).repeat(len(orders), 1)
    jitter = torch.arange(len(orders)) != 5  # one image without jitter: unchanged
    ours = ops.color_jitter(x, jitter, orders, factors)
    fns = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
    for i, order in enumerate(orders.tolist()):
        expected = x[i]
        for op in order if jitter[i] else []:
            expected = fns[op](expected, factors[i, op].item())
        assert (ours[i] - expected).abs().max() <= 2 * PIXEL, order
    assert torch.equal(ours[5], x[5])


def reference_chain(x, p, i):
    """Image i through torchvision.transforms.v2.functional with its drawn parameters."""
    if p.jitter[i]:
        fns = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
        for op in p.order[i].tolist():
            x = fns[op](x, p.factors[i, op].item())
    if p.gray[i]:
        x = TF.rgb_to_grayscale(x, 3)
    sigma = p.sigma[i].item()
    if sigma > 0:
        x = TF.gaussian_blur(x, [ops.blur_kernel_size(sigma)] * 2, [sigma] * 2)
    return TF.solarize(x, 0.5) if p.solarize[i] else x


@pytest.mark.parametrize("aug", list(ROWS))
def test_a_view_equals_torchvision_v2_and_pil_from_the_same_parameters(aug, photo):
    """The tensor routes' view (sce.data.pretrain.finish_view: photometric ops, normalisation, dtype, memory
    format) against torchvision's v2 ops image by image; the PIL route (--augment cpu) against the same
    parameters within its 8-bit rounding (after each PIL op; hue through PIL's 8-bit HSV) and PIL's resize."""
    image = TF.pil_to_tensor(photo)
    rows = rows_of(aug, n=24, size=40)
    p = views.Photometric.of(rows)
    crops = torch.cat([ops.resized_crops(image[None], r[None], 40) for r in rows])  # one by one, as the workers
    scale, shift = ops.normalization("cpu")
    view = finish_view(crops, rows, views.ViewSpec(aug, 40).photometric, scale=scale, shift=shift,
                       dtype=torch.bfloat16, memory_format=torch.channels_last)
    reference = torch.stack([reference_chain(crops[i] / 255, p, i) for i in range(len(rows))])
    expected = (reference - torch.tensor(ops.MEAN).view(1, 3, 1, 1)) / torch.tensor(ops.STD).view(1, 3, 1, 1)
    assert view.dtype == torch.bfloat16 and view.is_contiguous(memory_format=torch.channels_last)
    assert (view.float() - expected).abs().max() <= 0.04 + (2 if ROWS[aug][0] else 1) * PIXEL / 0.225  # bf16
    if ROWS[aug][0]:  # the batch mixes applied and skipped ops, and several jitter orders
        assert 0 < p.jitter.sum() < 24 and len({tuple(o) for o in p.order.tolist()}) > 3
    pil = torch.stack([views.pil_view(photo, views.ViewSpec(aug, 40), r) for r in rows])
    diff = ((pil - view.float()) * torch.tensor(ops.STD).view(1, 3, 1, 1)).abs()
    assert diff.max() < 24 * PIXEL and diff.mean() < 2 * PIXEL, (diff.max() * 255, diff.mean() * 255)


def effective_sigma(image):
    """Standard deviation, along x, of the light an impulse was spread into."""
    profile = image.double().sum(dim=0)
    x = torch.arange(len(profile), dtype=torch.float64) - len(profile) // 2
    return float(((profile * x ** 2).sum() / profile.sum()).sqrt())


@pytest.mark.parametrize("size", [32, 224])
def test_blur_has_the_requested_sigma_at_every_size(size):
    """A line impulse blurred with sigma s spreads with standard deviation s (within 10%), on both routes: a
    kernel sized from the image (3 taps at 32 px) made sigma 2 act like 0.8. A line, not a point, so that the
    8-bit PIL route keeps the tails."""
    impulse = torch.zeros(1, 1, size, size)
    impulse[..., size // 2] = 1.0
    pil = Image.fromarray((impulse[0, 0].numpy() * 255).astype(np.uint8)).convert("RGB")
    for sigma in (0.5, 1.0, 2.0):
        device = ops.gaussian_blur(impulse.expand(1, 3, -1, -1), torch.tensor([sigma]))
        assert effective_sigma(device[0, 0]) == pytest.approx(sigma, rel=0.1), ("tensor", size, sigma)
        row = torch.zeros(views.PACKED, dtype=torch.float64)
        row[:4] = torch.tensor([0, 0, size, size])
        row[views.ROW["sigma"]] = sigma  # only the blur
        view = views.pil_view(pil, views.ViewSpec("weak", size), row)
        cpu = view[0] * ops.STD[0] + ops.MEAN[0]
        assert effective_sigma(cpu) == pytest.approx(sigma, rel=0.1), ("pil", size, sigma)


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile unsupported here")
def test_compiled_views_equal_eager_and_a_failed_compile_runs_eagerly(monkeypatch):
    """What CUDA runs by default: a view's chain compiled whole (fullgraph: one graph, no break), traced by
    aot_eager here (inductor's C++ build takes half a minute on 2 cores; its numbers on a GPU are
    benchmarks/gpu/check.sh's); a compile that fails warns once and runs eagerly from then on."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real(fn, backend="aot_eager", **kwargs))
    image = torch.randint(0, 256, (3, 60, 70), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    rows = views.draw(views.ViewSpec("strong-gamma", 32), 0, 0, np.arange(16), 1, height=[60] * 16, width=[70] * 16)
    crops = torch.cat([ops.resized_crops(image[None], r[None], 32) for r in rows])  # one by one, as the workers
    args, output = (crops, rows, True), dict(dtype=torch.bfloat16, channels_last=True)
    runner = Views([], "cpu", compile=True, compiles=Log(), **output)
    eager, compiled = finish_view(*args, **runner.output), runner.run(finish_view, *args)
    assert compiled.dtype == torch.bfloat16 and compiled.is_contiguous(memory_format=torch.channels_last)
    assert (compiled.float() - eager.float()).abs().max() <= 0.016  # 1 bf16 step at 2-4, from fp32 rounding
    assert (compiled.float() != eager.float()).float().mean() < 0.01

    def broken_compile(fn, **kwargs):
        def fail(*a, **k):
            raise RuntimeError("Cannot find a working triton installation\nmore lines")
        return fail
    monkeypatch.setattr(torch, "compile", broken_compile)
    runner = Views([], "cpu", compile=True, compiles=Log(), **output)
    with pytest.warns(UserWarning, match=r"torch.compile of the views failed \(Cannot find a working triton "
                                         r"installation\): running it eagerly"):
        out = runner.run(finish_view, *args)
    assert runner.failed and torch.equal(out, eager)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second try, no second warning
        assert torch.equal(runner.run(finish_view, *args), eager)
