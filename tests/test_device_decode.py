"""JPEGs decoded on the training device (sce.device_decode), run here with torchvision's CPU decoder
in the training process: which files take that path, the header's size, crops against torchvision's,
the same random parameters and views as the loader path, decoder refusals and damaged files."""
import os

import pytest
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image

from sce import device_decode
from sce.augment import Encoded, MultiView, View, crop_geometry
from sce.datasets import build_dataset, load_rgb_tensor, read_encoded, read_header
from sce.device_augment import views_to_device
from sce.loader import PretrainDataset, collate_views

KINDS = {  # file name -> (PIL mode, save options); the first three go to the device's decoder
    "baseline.jpg": ("RGB", {"quality": 90}), "full_chroma.jpg": ("RGB", {"quality": 90, "subsampling": 0}),
    "gray.jpg": ("L", {"quality": 90}), "progressive.jpg": ("RGB", {"quality": 90, "progressive": True}),
    "cmyk.jpg": ("CMYK", {"quality": 90}), "photo.png": ("RGB", {}), "palette.png": ("P", {}),
}


@pytest.fixture(scope="module")
def photo():
    from sklearn.datasets import load_sample_images
    return Image.fromarray(load_sample_images().images[0][100:340, 50:370])  # 320x240


@pytest.fixture(scope="module")
def files(tmp_path_factory, photo):
    root = tmp_path_factory.mktemp("kinds")
    for name, (mode, options) in KINDS.items():
        photo.resize((61, 47)).convert(mode).save(root / name, **options)
    return root


def test_header_size_and_which_files_the_device_decodes(files):
    for name in KINDS:
        path = str(files / name)
        with open(path, "rb") as f:
            size = read_header(f.read())[2]
        decoded = load_rgb_tensor(path)
        assert size == (47, 61) == tuple(decoded.shape[-2:]) == Image.open(path).size[::-1], name
        got = read_encoded(path)
        if name in ("baseline.jpg", "full_chroma.jpg", "gray.jpg"):
            assert isinstance(got, Encoded) and got.size == (47, 61), name
            batch = {"jpeg": got.data, "lengths": [len(got.data)]}
            assert torch.equal(device_decode.decode_all(batch, torch.device("cpu"))[0], decoded), name
        else:  # decoded by the worker, as the loader path does
            assert torch.is_tensor(got) and torch.equal(got, decoded), name


def test_device_crop_equals_torchvisions_resized_crop(photo):
    image = TF.pil_to_tensor(photo)
    for top, left, h, w, flip in [(0, 0, 240, 320, False), (10, 30, 50, 80, True), (100, 200, 17, 13, False)]:
        got = device_decode.crops([image], crop_geometry(top, left, h, w, 32, flip)[None], 32)[0]
        expected = TF.resized_crop(image, top, left, h, w, [32, 32], antialias=True)  # the workers' uint8 resize
        expected = TF.hflip(expected) if flip else expected
        assert (got - expected.float()).abs().max() <= 1  # both round to levels; their filters agree to 1
    got = device_decode.crops([image], device_decode.resize_crop_geometry((240, 320), 36, 32)[None], 32)[0]
    expected = TF.center_crop(TF.resize(image, 36, antialias=True), 32)  # Resize(36) then CenterCrop(32)
    assert (got - expected.float()).abs().max() <= 1


def pretrain_samples(root, encoded, seed=3):
    views = MultiView([View("weak", 16, (0.3, 1.0), True), View("strong-gamma", 12, (0.2, 1.0), True)])
    dataset = build_dataset("imagefolder", root, "pretrain", as_tensor=True, encoded=encoded)
    return PretrainDataset(dataset, views, seed)


def device_views(samples, keys, refetch=None):
    batch = collate_views([samples[key] for key in keys])
    views = batch if isinstance(batch, dict) else batch[0]
    return views_to_device(views, torch.device("cpu"), compile=False, refetch=refetch or samples.decoded), batch


@pytest.fixture
def mixed(tmp_path, photo):
    """An ImageFolder of 6 photos: baseline JPEGs, a progressive one, a PNG."""
    root = tmp_path / "data" / "photos"
    os.makedirs(root)
    for i in range(6):
        crop = photo.crop((20 * i, 10 * i, 20 * i + 150, 10 * i + 120)).resize((50, 40))
        kind = ".png" if i == 4 else ".jpg"
        crop.save(root / f"{i}{kind}", **({"progressive": True} if i == 5 else {}))
    return str(tmp_path / "data")


def test_device_path_draws_the_loader_paths_parameters_and_views(mixed):
    keys = [(2, i) for i in range(6)]
    encoded, loader = pretrain_samples(mixed, True), pretrain_samples(mixed, False)
    got, batch = device_views(encoded, keys)
    expected, _ = device_views(loader, keys)
    assert batch["encoded"].tolist() == [0, 1, 2, 3] and batch["decoded"].tolist() == [4, 5]
    plain = collate_views([loader[key] for key in keys])[0]
    for v in range(2):  # the same random parameters: same crops' parameter rows, same geometry
        assert torch.equal(batch["params"][v], plain[v][1])
        # crops within 1 level (the two resize filters), stretched by the photometric ops (factors up to 1.4)
        diff = (got[v] - expected[v]).abs() * 0.229  # normalised units back to pixels (std ~0.23)
        assert diff.max() <= 3 / 255 and diff.mean() <= 0.2 / 255, (v, diff.max() * 255, diff.mean() * 255)


def test_a_refused_file_is_decoded_on_the_host_and_a_damaged_one_replaced(mixed, monkeypatch):
    keys = [(0, i) for i in range(4)]
    samples = pretrain_samples(mixed, True)
    reference, _ = device_views(samples, keys)
    real = device_decode.decode_jpeg
    refused = samples.dataset.samples[1][0]
    with open(refused, "rb") as f:
        refused_bytes = f.read()

    def decode(data, **kwargs):  # the device's decoder refuses one file (a batch holding it fails)
        listed = data if isinstance(data, list) else [data]
        if any(d.numpy().tobytes() == refused_bytes for d in listed):
            raise RuntimeError("nvjpeg: unsupported")
        return real(data, **kwargs)
    monkeypatch.setattr(device_decode, "decode_jpeg", decode)
    got, _ = device_views(samples, keys)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))  # PIL on the host: the same pixels
    damaged = samples.dataset.samples[2][0]
    with open(damaged, "rb") as f:
        data = f.read()
    with open(damaged, "wb") as f:  # the header whole, the scan cut short: no decoder reads it
        f.write(data[:data.index(b"\xff\xda") + 40])
    assert isinstance(read_encoded(damaged), Encoded)
    got, batch = device_views(samples, keys)
    assert batch["bad"].tolist() == [-1, -1, 2, -1] and "truncated" in batch["reasons"][2]
    replaced, _, _ = samples.decoded((0, 2))  # the loader path: the next readable image, the same parameters
    assert torch.equal(got[0][2], views_to_device([(replaced[0][0][None], replaced[0][1][None])],
                                                  torch.device("cpu"), compile=False)[0][0])


def test_decoded_eval_batches_equal_the_loader_transform(mixed):
    from sce.augment import MEAN, STD
    from sce.loader import eval_transform
    dataset = build_dataset("imagefolder", mixed, "pretrain", encoded=True)
    transform = eval_transform(False, 32)  # resize 36 (= 32 x 256 / 224) + centre crop 32, on PIL images
    decoded = device_decode.DecodedEval(dataset, 32, transform, resize=36)
    loader = torch.utils.data.DataLoader(decoded, batch_size=6, collate_fn=collate_views)
    stats = (torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1))
    images, targets = device_decode.eval_batch(next(iter(loader)), 32, torch.device("cpu"))
    plain = build_dataset("imagefolder", mixed, "pretrain", transform)
    expected = torch.stack([plain[i][0] for i in range(6)])
    assert targets.tolist() == [0] * 6
    diff = (images - expected).abs() * stats[1]
    assert diff.max() <= 3 / 255 and diff.mean() <= 0.6 / 255, diff.max() * 255  # torch's and PIL's resize


def test_device_decoded_run_resumes_mid_epoch_exactly(mixed, tmp_path, monkeypatch, capsys):
    from conftest import assert_mid_epoch_resume_is_exact
    for i in range(6, 8):  # 8 images: 2 steps of 4 an epoch
        photo = Image.open(os.path.join(mixed, "photos", "0.jpg")).rotate(90 * i)
        photo.save(os.path.join(mixed, "photos", f"{i}.jpg"))
    args = ["--data", mixed, "--arch", "resnet18", "--small-input", "--crop-size", "16", "--batch-size", "4",
            "--queue-size", "16", "--workers", "0", "--proj-hidden-dims", "32", "--proj-dim", "16", "--print-freq",
            "1", "--epochs", "2", "--augment", "gpu", "--decode", "device", "--shuffle-bn", "--bn-splits", "2"]
    torch.set_num_threads(1)
    assert_mid_epoch_resume_is_exact(args, tmp_path, monkeypatch)
    assert "JPEGs decoded on the device" in capsys.readouterr().out


def test_evaluation_features_and_linear_probe_decoded_on_the_device(mixed, tmp_path, capsys):
    import json
    import main_lincls
    from sce.builder import build_trunk
    from sce.knn import split_features
    from sce.loader import eval_transform
    from sce.transfer import ImageList
    torch.manual_seed(0)
    trunk, _ = build_trunk("resnet18")  # an ImageNet stem: the large-image protocol
    paths = [os.path.join(mixed, "photos", f) for f in sorted(os.listdir(os.path.join(mixed, "photos")))]
    tf = eval_transform(False, 64)  # resize 73 + centre crop 64
    torch.save({"kind": "pretrain", "args": {"arch": "resnet18", "small_input": False},
                "model": {f"encoder.{k}": v for k, v in trunk.state_dict().items()}}, tmp_path / "stem.pth")
    common = dict(checkpoint=str(tmp_path / "stem.pth"), workers=0, batch_size=4)
    on_device = split_features(trunk, device_decode.DecodedEval(ImageList(paths, list(range(6)), tf, encoded=True),
                                                                64, tf, 73), "x", tmp_path, torch.device("cpu"),
                               **common)
    loader = split_features(trunk, ImageList(paths, list(range(6)), tf), "x", tmp_path, torch.device("cpu"),
                            **common)
    assert len(list(tmp_path.glob("features_x_*.pt"))) == 2  # two cache entries: the key says where JPEGs decode
    cosine = torch.nn.functional.cosine_similarity(torch.from_numpy(on_device), torch.from_numpy(loader))
    assert cosine.min() > 0.999, cosine  # torch's resize on the device against PIL's in the workers
    # the linear probe and kNN of that ImageNet-stem checkpoint, JPEGs decoded in the training process
    data = tmp_path / "eval"
    for split in ("train", "val"):
        for c in range(2):
            os.makedirs(data / split / f"c{c}")
            for p in paths[c::2]:
                os.symlink(p, data / split / f"c{c}" / os.path.basename(p))
    for extra in (["--epochs", "1", "--batch-size", "3"], ["--knn", "--knn-k", "2"]):
        main_lincls.main(["--data", str(data), "--pretrained", str(tmp_path / "stem.pth"), "--crop-size", "64",
                          "--decode", "device", "--workers", "0", "--output-dir", str(tmp_path / extra[0])] + extra)
    assert "Epoch 1/1: Acc@1" in capsys.readouterr().out
    assert 0 <= json.load(open(tmp_path / "--knn" / "results_knn.json"))["acc1"] <= 100
