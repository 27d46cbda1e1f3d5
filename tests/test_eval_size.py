"""Evaluation input size: a small-input trunk is evaluated at the crop size it was pretrained with,
an ImageNet-stem trunk at the protocol's 224, a trunk without a recorded size as before."""
import pytest
import torch

from conftest import write_imagefolder
from sce.builder import build_trunk
from sce.loader import eval_crop_size


@pytest.mark.parametrize("given,small,recorded,dataset,size", [
    (None, True, 32, "imagefolder", 32),  # small-input trunk: its pretraining size
    (None, True, 16, "cifar10", 16),  # the recorded size wins over the dataset's native one
    (None, True, None, "cifar10", 32),  # nothing recorded (a plain state dict): the native size, as before
    (None, True, None, "imagefolder", 224),  # ... and 224 for an ImageFolder, as before
    (None, False, 64, "imagefolder", 224),  # ImageNet stem: the protocol's 224
    (None, False, None, "stl10", 96),
    (48, True, 32, "imagefolder", 48),  # given: used
])
def test_rule(given, small, recorded, dataset, size):
    ckpt_args = {"crop_size": recorded} if recorded else None
    got, why, warning = eval_crop_size(given, small, ckpt_args, dataset)
    assert got == size and why and warning is None


def test_a_size_far_from_pretraining_warns():
    assert "more than 2x away from the 32 px" in eval_crop_size(96, True, {"crop_size": 32})[2]
    assert eval_crop_size(64, True, {"crop_size": 32})[2] is None  # 2x is still near
    assert eval_crop_size(96, False, {"crop_size": 32})[2] is None  # the ImageNet stem has no such size


@pytest.fixture
def seen_sizes(monkeypatch):
    """The (H, W) of every batch the evaluated trunk receives."""
    import main_lincls
    sizes, real = [], main_lincls.load_trunk

    def load_trunk(*a, **k):
        trunk, dim, ckpt = real(*a, **k)
        trunk.register_forward_pre_hook(lambda module, inputs: sizes.append(tuple(inputs[0].shape[-2:])))
        return trunk, dim, ckpt
    monkeypatch.setattr(main_lincls, "load_trunk", load_trunk)
    return sizes


def test_small_input_checkpoint_is_evaluated_at_its_pretraining_size(pretrained, tmp_path, capsys, seen_sizes):
    import main_lincls
    data = write_imagefolder(tmp_path / "data", 3, 4, 40)  # 40 px images, a trunk pretrained at 32
    for extra in (["--knn"], ["--epochs", "1", "--batch-size", "12"]):
        seen_sizes.clear()
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--workers", "0",
                          "--output-dir", str(tmp_path / "out")] + extra)
        assert seen_sizes and set(seen_sizes) == {(32, 32)}
    first = capsys.readouterr().out.splitlines()[0]
    assert "input 32 px (the crop size the small-input trunk was pretrained with)" in first


def test_imagenet_stem_checkpoint_is_evaluated_at_224(tmp_path, capsys, seen_sizes):
    import main_lincls
    trunk, _ = build_trunk("resnet18")
    ckpt = {"kind": "pretrain", "args": {"arch": "resnet18", "small_input": False, "crop_size": 64},
            "model": {f"encoder.{k}": v for k, v in trunk.state_dict().items()}}
    torch.save(ckpt, tmp_path / "imagenet_stem.pth")
    data = write_imagefolder(tmp_path / "data", 3, 2, 40)
    main_lincls.main(["--data", data, "--pretrained", str(tmp_path / "imagenet_stem.pth"), "--knn", "--knn-k", "2",
                      "--workers", "0", "--output-dir", str(tmp_path / "out")])
    assert seen_sizes and set(seen_sizes) == {(224, 224)}
    assert "input 224 px (the protocol's 224)" in capsys.readouterr().out
