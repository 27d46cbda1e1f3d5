"""Detection transfer (detection/): detectron2 and torchvision conversion of a main_pretrain.py
checkpoint, the detectron2 configs, and torchvision Mask R-CNN fine-tuning. No detectron2 needed."""
import argparse
import ast
import contextlib
import importlib
import io
import json
import os
import pickle
import py_compile
import re
import sys

import numpy as np
import pytest
import torch
import torchvision
import yaml
from PIL import Image

from conftest import REPO, exit_message, run_script, script_in_process, write_imagefolder
from sce import UserError
from sce.builder import MomentumModel, build_trunk

DET = os.path.join(REPO, "detection")
TO_D2 = "detection/convert-pretrain-to-detectron2.py"
TO_TV = "detection/convert-pretrain-to-torchvision.py"


@pytest.fixture(scope="module")
def pretrain_ckpt(tmp_path_factory):
    """A real ResNet-50 checkpoint written by main_pretrain.py (1 epoch on 8 tiny images)."""
    root = tmp_path_factory.mktemp("pretrain")
    data = write_imagefolder(root / "data", num_classes=2, per_class=4, splits=("",))
    import main_pretrain
    with script_in_process():
        main_pretrain.main(["--data", data, "--arch", "resnet50", "--crop-size", "32", "--epochs", "1",
                            "--batch-size", "8", "--queue-size", "64", "--workers", "0", "--output-dir",
                            str(root / "out"), "--proj-hidden-dims", "64", "--proj-dim", "32"])
    return str(root / "out" / "checkpoint_last.pth")


@pytest.fixture(scope="module")
def torchvision_weights(pretrain_ckpt, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tv") / "sce_r50_torchvision.pth")
    assert exit_message(TO_TV, pretrain_ckpt, out) is None  # in this process: a torch import saved
    return out


# ---------------------------------------------------------------------------------------------
# detectron2 .pkl


def detectron2_r50_c4_shapes(blocks=(3, 4, 6, 3)):
    """Names and shapes detectron2's ResNet-50 takes, from its documented layout: a stem (7x7 conv1
    + norm) and stages res2..res5 of BottleneckBlocks (1x1 conv1, 3x3 conv2, 1x1 conv3 with 4x the
    bottleneck width; a 1x1 projection `shortcut` in each stage's first block), every conv followed
    by a `.norm` BN. R50-C4 builds stem..res4 as the backbone and res5 inside Res5ROIHeads."""
    shapes = {}

    def conv(name, shape):
        shapes[f"{name}.weight"] = shape
        for p in ("weight", "bias", "running_mean", "running_var"):
            shapes[f"{name}.norm.{p}"] = (shape[0],)

    conv("stem.conv1", (64, 3, 7, 7))
    in_ch = 64
    for i, n in enumerate(blocks):
        mid, out = 64 * 2 ** i, 256 * 2 ** i
        for b in range(n):
            cin = in_ch if b == 0 else out
            conv(f"res{i + 2}.{b}.conv1", (mid, cin, 1, 1))
            conv(f"res{i + 2}.{b}.conv2", (mid, mid, 3, 3))
            conv(f"res{i + 2}.{b}.conv3", (out, mid, 1, 1))
            if b == 0:
                conv(f"res{i + 2}.{b}.shortcut", (out, cin, 1, 1))
        in_ch = out
    return shapes


def torchvision_name(d2_name):
    """Inverse of detectron2's renaming, to find the trunk tensor a converted value came from."""
    name = d2_name.removeprefix("stem.")
    name = re.sub(r"^res(\d)", lambda m: f"layer{int(m.group(1)) - 1}", name)
    name = name.replace("shortcut.norm", "downsample.1").replace("shortcut", "downsample.0")
    return re.sub(r"conv(\d)\.norm", r"bn\1", name)


def test_torchvision_name_inverse_matches_documented_examples():
    examples = {"conv1.weight": "stem.conv1.weight", "bn1.running_mean": "stem.conv1.norm.running_mean",
                "layer1.0.conv1.weight": "res2.0.conv1.weight", "layer1.0.bn1.weight": "res2.0.conv1.norm.weight",
                "layer1.0.downsample.0.weight": "res2.0.shortcut.weight",
                "layer1.0.downsample.1.bias": "res2.0.shortcut.norm.bias",
                "layer4.2.bn3.running_var": "res5.2.conv3.norm.running_var"}
    for tv, d2 in examples.items():
        assert torchvision_name(d2) == tv


def load_pkl(path):
    with open(path, "rb") as f:
        return pickle.load(f)


@pytest.mark.parametrize("encoder", ["online", "momentum"])
def test_detectron2_conversion_of_main_pretrain_checkpoint(pretrain_ckpt, tmp_path, encoder):
    out = str(tmp_path / "sce_r50.pkl")
    flags = ["--encoder", "momentum"] if encoder == "momentum" else []
    with contextlib.redirect_stdout(io.StringIO()) as said:  # in this process: a torch import saved
        assert exit_message(TO_D2, pretrain_ckpt, out, *flags) is None
    assert "wrote 265 tensors" in said.getvalue()
    converted = load_pkl(out)
    assert set(converted) == {"model", "__author__", "matching_heuristics"}
    assert converted["matching_heuristics"] is True
    model = converted["model"]
    expected = detectron2_r50_c4_shapes()
    assert len(expected) == 265
    assert set(model) == set(expected)
    for name, value in model.items():
        assert isinstance(value, np.ndarray) and value.dtype == np.float32, name
        assert value.shape == expected[name], name
    # each value is the trunk tensor it came from, of the requested encoder
    state = torch.load(pretrain_ckpt, map_location="cpu", weights_only=True)["model"]
    prefix = "encoder." if encoder == "online" else "momentum_encoder."
    for name, value in model.items():
        np.testing.assert_array_equal(value, state[prefix + torchvision_name(name)].numpy(), err_msg=name)
    # the two encoders differ after a step, so the flag selected a different trunk
    other = "momentum_encoder." if encoder == "online" else "encoder."
    assert any(not np.array_equal(v, state[other + torchvision_name(k)].numpy()) for k, v in model.items())


def test_detectron2_conversion_resnet101_with_depth_flag(tmp_path):
    trunk, _ = build_trunk("resnet101")
    torch.save(trunk.state_dict(), tmp_path / "r101.pth")
    assert exit_message(TO_D2, tmp_path / "r101.pth", tmp_path / "r101.pkl", "--depth", "101") is None
    model = load_pkl(tmp_path / "r101.pkl")["model"]
    expected = detectron2_r50_c4_shapes(blocks=(3, 4, 23, 3))
    assert {k: v.shape for k, v in model.items()} == expected
    np.testing.assert_array_equal(model["res4.22.conv2.weight"], trunk.layer3[22].conv2.weight.detach().numpy())


def test_lincls_checkpoint_is_accepted(tmp_path):
    trunk, _ = build_trunk("resnet50")
    state = trunk.state_dict()
    state["fc.weight"], state["fc.bias"] = torch.zeros(10, 2048), torch.zeros(10)
    torch.save({"kind": "lincls", "epoch": 1, "args": {"arch": "resnet50"}, "model": state}, tmp_path / "lin.pth")
    assert exit_message(TO_D2, tmp_path / "lin.pth", tmp_path / "lin.pkl") is None
    model = load_pkl(tmp_path / "lin.pkl")["model"]
    assert not any("fc" in k for k in model)
    np.testing.assert_array_equal(model["res5.0.shortcut.norm.running_var"],
                                  state["layer4.0.downsample.1.running_var"].numpy())


# ---------------------------------------------------------------------------------------------
# bad input: one line, no traceback


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr and len(err.splitlines()) == 1 and err.startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in err, err


def assert_exit_error(script, args, *needles):
    msg = exit_message(script, *args)
    assert isinstance(msg, str) and msg.startswith("error: ") and "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg


def test_refuses_bad_checkpoints(tmp_path):
    sce = MomentumModel(criterion=None, arch="resnet50", small_input=True, proj_hidden_dims=[64], proj_dim=32,
                        queue_size=64)
    torch.save({"kind": "pretrain", "epoch": 1, "step": 1, "args": {"arch": "resnet50", "small_input": True},
                "model": sce.state_dict()}, tmp_path / "small.pth")
    torch.save({"kind": "pretrain", "epoch": 1, "step": 1, "args": {"arch": "resnet50"},
                "model": {k: v for k, v in sce.state_dict().items()
                          if not k.startswith(("encoder.", "momentum_encoder."))}},
               tmp_path / "notrunk.pth")
    torch.save(build_trunk("resnet18")[0].state_dict(), tmp_path / "r18.pth")
    torch.save(build_trunk("resnet50")[0].state_dict(), tmp_path / "r50.pth")
    torch.save(build_trunk("wide_resnet50_2")[0].state_dict(), tmp_path / "wide.pth")
    p = lambda name: str(tmp_path / name)  # noqa: E731
    # the real command line once: stderr is one line, no traceback
    assert_one_line_error(run_script([TO_D2, p("r18.pth"), p("a.pkl")], check=False), "ResNet-18", "ResNet-50")
    cases = [
        ([TO_D2, p("notrunk.pth"), p("a.pkl")], ["no torchvision-style ResNet trunk"]),
        ([TO_TV, p("r18.pth"), p("a.pth")], ["ResNet-18", "ResNet-50"]),
        ([TO_D2, p("small.pth"), p("a.pkl")], ["small-input", "3x3"]),
        ([TO_TV, p("small.pth"), p("a.pth")], ["small-input", "3x3"]),
        ([TO_D2, p("r50.pth"), p("a.pkl"), "--depth", "101"], ["ResNet-50 trunk", "--depth 50"]),
        ([TO_D2, p("wide.pth"), p("a.pkl")], ["layer1.0.conv1.weight has shape [128, 64, 1, 1]"]),
        ([TO_D2, p("missing.pth"), p("a.pkl")], ["does not exist"]),
        ([TO_D2, p("r50.pth"), p("r18.pth")], ["already exists", "--force"]),
        ([TO_TV, p("r50.pth"), p("r18.pth")], ["already exists", "--force"]),
        ([TO_D2, p("r50.pth"), p("nofolder/a.pkl")], ["does not exist"]),
    ]
    for (script, *args), needles in cases:
        assert_exit_error(script, args, *needles)
    assert not os.path.exists(p("a.pkl")) and not os.path.exists(p("a.pth"))
    # --force overwrites
    assert exit_message(TO_D2, p("r50.pth"), p("r18.pth"), "--force") is None
    assert load_pkl(p("r18.pth"))["model"]["res5.2.conv3.weight"].shape == (2048, 512, 1, 1)


# ---------------------------------------------------------------------------------------------
# detectron2 configs and train_net.py

# keys of detectron2's config schema (detectron2/config/defaults.py) the configs set, with their
# defaults there: yacs refuses unknown keys and values whose type differs from the default's
D2_DEFAULTS = {
    "VERSION": 2,
    "MODEL.META_ARCHITECTURE": "GeneralizedRCNN",
    "MODEL.WEIGHTS": "",
    "MODEL.MASK_ON": False,
    "MODEL.PIXEL_MEAN": [103.530, 116.280, 123.675],
    "MODEL.PIXEL_STD": [1.0, 1.0, 1.0],
    "MODEL.BACKBONE.FREEZE_AT": 2,
    "MODEL.RESNETS.DEPTH": 50,
    "MODEL.RESNETS.NORM": "FrozenBN",
    "MODEL.RESNETS.STRIDE_IN_1X1": True,
    "MODEL.RPN.PRE_NMS_TOPK_TEST": 6000,
    "MODEL.RPN.POST_NMS_TOPK_TEST": 1000,
    "MODEL.ROI_HEADS.NAME": "Res5ROIHeads",
    "MODEL.ROI_HEADS.NUM_CLASSES": 80,
    "INPUT.FORMAT": "BGR",
    "INPUT.MIN_SIZE_TRAIN": (800,),
    "INPUT.MIN_SIZE_TEST": 800,
    "DATASETS.TRAIN": (),
    "DATASETS.TEST": (),
    "TEST.PRECISE_BN.ENABLED": False,
    "SOLVER.IMS_PER_BATCH": 16,
    "SOLVER.BASE_LR": 0.001,
    "SOLVER.STEPS": (30000,),
    "SOLVER.MAX_ITER": 40000,
    "SOLVER.WARMUP_ITERS": 1000,
}
CONFIGS = ["Base-RCNN-C4-BN.yaml", "coco_R_50_C4_1x.yaml", "coco_R_50_C4_2x.yaml", "pascal_voc_R_50_C4_24k.yaml"]


def flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def decode(value):
    """yacs reads strings such as '(640, 800)' as Python literals, other strings stay strings."""
    if isinstance(value, str):
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
    return value


def merged(name):
    """The config after following _BASE_ like detectron2 does (base first, file on top)."""
    with open(os.path.join(DET, "configs", name)) as f:
        cfg = flatten(yaml.safe_load(f))
    base = cfg.pop("_BASE_", None)
    return {**merged(base), **cfg} if base else cfg


@pytest.mark.parametrize("name", CONFIGS)
def test_config_keys_are_detectron2_schema(name):
    with open(os.path.join(DET, "configs", name)) as f:
        cfg = flatten(yaml.safe_load(f))
    base = cfg.pop("_BASE_", None)
    assert base is None or os.path.isfile(os.path.join(DET, "configs", base))
    assert cfg and set(cfg) <= set(D2_DEFAULTS), set(cfg) - set(D2_DEFAULTS)
    for key, value in cfg.items():
        value, default = decode(value), D2_DEFAULTS[key]
        ok = (isinstance(value, (list, tuple)) and isinstance(default, (list, tuple))) or type(value) is type(default)
        assert ok, f"{key}: {value!r} has not the type of detectron2's default {default!r}"


def test_configs_hold_the_paper_setting():
    coco = {k: decode(v) for k, v in merged("coco_R_50_C4_2x.yaml").items()}
    assert coco["MODEL.MASK_ON"] is True and coco["MODEL.RESNETS.DEPTH"] == 50
    assert coco["MODEL.RESNETS.NORM"] == "SyncBN" and coco["MODEL.BACKBONE.FREEZE_AT"] == 0
    assert coco["MODEL.RESNETS.STRIDE_IN_1X1"] is False and coco["INPUT.FORMAT"] == "RGB"
    assert coco["MODEL.PIXEL_MEAN"] == [123.675, 116.280, 103.530]
    assert coco["MODEL.PIXEL_STD"] == [58.395, 57.120, 57.375]
    assert coco["TEST.PRECISE_BN.ENABLED"] is True and coco["MODEL.ROI_HEADS.NAME"] == "Res5ROIHeadsExtraNorm"
    assert coco["DATASETS.TRAIN"] == ("coco_2017_train",) and coco["DATASETS.TEST"] == ("coco_2017_val",)
    # 2x = 180k iterations of 16 images, twice the 1x schedule
    assert coco["SOLVER.MAX_ITER"] == 180000 and coco["SOLVER.IMS_PER_BATCH"] == 16
    assert decode(merged("coco_R_50_C4_1x.yaml")["SOLVER.MAX_ITER"]) == 90000
    voc = {k: decode(v) for k, v in merged("pascal_voc_R_50_C4_24k.yaml").items()}
    assert voc["SOLVER.MAX_ITER"] == 24000 and voc["MODEL.ROI_HEADS.NUM_CLASSES"] == 20
    assert voc["MODEL.MASK_ON"] is False
    assert voc["DATASETS.TEST"] == ("voc_2007_test",) and voc["MODEL.RESNETS.STRIDE_IN_1X1"] is False


def test_train_net_compiles_and_registers_the_extra_norm_head(tmp_path):
    py_compile.compile(os.path.join(DET, "train_net.py"), cfile=str(tmp_path / "train_net.pyc"), doraise=True)
    with open(os.path.join(DET, "train_net.py")) as f:
        source = f.read()
    assert "@ROI_HEADS_REGISTRY.register()\nclass Res5ROIHeadsExtraNorm(Res5ROIHeads)" in source
    assert "COCOEvaluator" in source and "PascalVOCDetectionEvaluator" in source


# ---------------------------------------------------------------------------------------------
# torchvision route


def test_torchvision_conversion_loads_strictly_into_mask_rcnn(pretrain_ckpt, torchvision_weights):
    state = torch.load(torchvision_weights, map_location="cpu", weights_only=True)
    body = torchvision.models.detection.maskrcnn_resnet50_fpn(weights=None, weights_backbone=None).backbone.body
    body.load_state_dict(state, strict=True)
    trunk = torch.load(pretrain_ckpt, map_location="cpu", weights_only=True)["model"]
    for k, v in body.state_dict().items():
        assert torch.equal(v, trunk["encoder." + k]), k


def write_coco(root, num_images=4, size=64, seed=0):
    """root/images/*.png and root/ann.json: 1-2 coloured rectangles per image with polygon masks,
    categories 3 and 7 (non-contiguous ids, as in COCO)."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    images, anns = [], []
    for i in range(num_images):
        pixels = rng.integers(0, 60, (size, size, 3)).astype(np.uint8)
        for j in range(1 + i % 2):
            cat = (3, 7)[j]
            x, y = (int(v) for v in rng.integers(2, size // 2 - 4, 2))
            w, h = (int(v) for v in rng.integers(size // 4, size // 2, 2))
            pixels[y:y + h, x:x + w] = (220, 40, 40) if cat == 3 else (40, 220, 40)
            anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": cat, "bbox": [x, y, w, h],
                         "area": w * h, "iscrowd": 0, "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]]})
        Image.fromarray(pixels).save(os.path.join(root, "images", f"{i}.png"))
        images.append({"id": i + 1, "file_name": f"{i}.png", "width": size, "height": size})
    with open(os.path.join(root, "ann.json"), "w") as f:
        json.dump({"images": images, "annotations": anns,
                   "categories": [{"id": 3, "name": "red"}, {"id": 7, "name": "green"}]}, f)
    return str(root)


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    return write_coco(tmp_path_factory.mktemp("coco"))


def import_train_torchvision():
    sys.path.insert(0, DET)
    try:
        return importlib.import_module("train_torchvision")
    finally:
        sys.path.remove(DET)


@pytest.mark.parametrize("size", [37, 40])
def test_epoch_sampler_shares_are_disjoint_equal_and_resume_exactly(size):
    """On 1 to 8 ranks: each rank's (index, flip) pairs are its own, every rank takes as many, together they
    cover the epoch but the remainder (< ranks), and a share resumed after `skip` steps is the rest of it."""
    sampler = import_train_torchvision().EpochSampler
    for world in range(1, 9):
        shares = []
        for rank in range(world):
            s = sampler(size, seed=3, rank=rank, world=world)
            s.epoch = 2
            shares.append(list(s))
            assert len(shares[-1]) == len(s) == size // world
            s.skip = 2  # resumed after 2 steps of this epoch
            assert list(s) == shares[-1][2:] and len(s) == size // world - 2
        indices = [i for share in shares for i, _ in share]
        assert len(set(indices)) == len(indices) == size - size % world  # disjoint; only the remainder left out
        one = sampler(size, seed=3, rank=0, world=1)
        one.epoch = 2
        flip = dict(list(one))
        assert all(flip[i] == f for share in shares for i, f in share)  # the flips follow the image, any world
    other = sampler(size, seed=3, rank=0, world=1)
    assert list(other) != list(one)  # another epoch, another order


def test_coco_evaluation_of_perfect_and_mislabelled_detections(coco):
    tt = import_train_torchvision()
    dataset = tt.CocoInstances(os.path.join(coco, "images"), os.path.join(coco, "ann.json"), train=False)
    assert dataset.cat_ids == [3, 7]

    def evaluate(relabel):
        results = []
        for i in range(len(dataset)):
            _, target = dataset[i]
            n = len(target["labels"])
            output = {"boxes": target["boxes"], "labels": relabel(target["labels"]), "scores": torch.ones(n),
                      "masks": target["masks"][:, None].float()}
            results += tt.coco_results(output, target["image_id"], dataset.cat_ids)
        return tt.coco_ap(dataset.coco, results)

    ap_box, ap_mask = evaluate(lambda labels: labels)
    assert ap_box == pytest.approx(100) and ap_mask == pytest.approx(100)
    ap_box, ap_mask = evaluate(lambda labels: 3 - labels)  # swap the two classes
    assert ap_box == 0 and ap_mask == 0


def train_args(coco, torchvision_weights, out):
    images, ann = os.path.join(coco, "images"), os.path.join(coco, "ann.json")
    # a small lr keeps the detections of a barely pretrained trunk finite, so evaluation scores some
    return ["detection/train_torchvision.py", "--pretrained", torchvision_weights, "--train-images", images,
            "--train-ann", ann, "--val-images", images, "--val-ann", ann, "--output-dir", out, "--max-iters", "2",
            "--workers", "0", "--min-size", "64", "--max-size", "64", "--rois-per-image", "32",
            "--score-thresh", "0", "--lr", "1e-4", "--warmup-iters", "1", "--print-freq", "1"]


def check_training_run(proc, out, torchvision_weights):
    assert re.search(r"AP box \d+\.\d  AP mask \d+\.\d", proc.stdout), proc.stdout
    with open(os.path.join(out, "eval.json")) as f:
        ev = json.load(f)
    assert ev["iter"] == 2 and ev["detections"] > 0
    assert 0 <= ev["ap_box"] <= 100 and 0 <= ev["ap_mask"] <= 100
    ckpt = torch.load(os.path.join(out, "checkpoint_last.pth"), map_location="cpu", weights_only=True)
    assert ckpt["kind"] == "detection" and ckpt["iter"] == 2
    # the trunk started from the converted weights and moved a little in 2 small steps
    start = torch.load(torchvision_weights, map_location="cpu", weights_only=True)
    w0, w1 = start["layer4.2.conv3.weight"], ckpt["model"]["backbone.body.layer4.2.conv3.weight"]
    assert not torch.equal(w0, w1) and (w1 - w0).abs().max() < 1e-3 * w0.abs().max()


def test_train_torchvision_two_iterations_and_evaluation(coco, torchvision_weights, tmp_path, monkeypatch, capsys,
                                                        in_process):
    # in this process (the torchrun test below runs the script as a command)
    out = str(tmp_path / "out")
    monkeypatch.setattr(sys, "argv", train_args(coco, torchvision_weights, out) + ["--batch-size", "2"])
    import_train_torchvision().main()
    proc = argparse.Namespace(stdout=capsys.readouterr().out)
    assert "4 training images, 4 evaluation images, 2 classes, 2 iterations on 1 process(es)" in proc.stdout
    check_training_run(proc, out, torchvision_weights)


def test_train_torchvision_under_torchrun_two_processes(coco, torchvision_weights, tmp_path):
    out = str(tmp_path / "out")
    proc = run_script(["torchrun", "--standalone", "--nproc_per_node=2"] + train_args(coco, torchvision_weights, out)
                      + ["--batch-size", "1"])
    assert "2 iterations on 2 process(es)" in proc.stdout
    check_training_run(proc, out, torchvision_weights)


def test_train_torchvision_bad_input(coco, tmp_path):
    script, *args = train_args(coco, str(tmp_path / "missing.pth"), str(tmp_path / "out"))
    assert_exit_error(script, args, "missing.pth", "does not exist")
    args[args.index("--pretrained") + 1] = str(tmp_path / "r18.pth")
    torch.save(build_trunk("resnet18")[0].state_dict(), tmp_path / "r18.pth")
    assert_exit_error(script, args, "ResNet-18")
    del args[args.index("--pretrained"):args.index("--pretrained") + 2]
    args[args.index("--train-ann") + 1] = str(tmp_path / "nope.json")
    assert_exit_error(script, args, "nope.json", "does not exist")
    with open(tmp_path / "bad.json", "w") as f:
        f.write("[1, 2]")
    args[args.index("--train-ann") + 1] = str(tmp_path / "bad.json")
    assert_exit_error(script, args, "bad.json", "not a COCO annotation file")
    assert_exit_error(script, args + ["--lr", "-0.1"], "--lr must be >= 0")
    assert_exit_error(script, args + ["--print-freq", "0"], "--print-freq must be positive")


class DoublingScaler(torch.amp.GradScaler):
    """A GradScaler that works on the CPU (autocast stays off there) and doubles its scale at every
    step from 1: its scale counts the steps it has taken, so it shows whether a resume brought it back."""

    def __init__(self, device, enabled):
        super().__init__("cpu", init_scale=1.0, growth_interval=1)


def train_in_process(coco, out, *flags, write=True):
    """train_torchvision.main() in this process on 4 images, 2 per batch (2 iterations per epoch), with
    no evaluation and a DoublingScaler. Returns the (image, flip) pairs it trained on, its iteration
    log lines (epoch, iteration, lr) and the checkpoints it saved, less model and optimizer;
    write=False saves nothing to disk (a reference run)."""
    tt = import_train_torchvision()
    images, ann = os.path.join(coco, "images"), os.path.join(coco, "ann.json")
    argv = ["train_torchvision.py", "--train-images", images, "--train-ann", ann, "--val-images", images,
            "--val-ann", ann, "--output-dir", out, "--workers", "0", "--min-size", "32", "--max-size", "32",
            "--rois-per-image", "8", "--lr", "1e-4", "--warmup-iters", "1", "--print-freq", "1", "--batch-size", "2",
            "--epochs", "2", *flags]
    seen, saved, getitem, save = [], [], tt.CocoInstances.__getitem__, tt.save_atomic

    def recording_getitem(self, key):
        seen.append(key)
        return getitem(self, key)

    def recording_save(obj, path):
        saved.append({k: v for k, v in obj.items() if k not in ("model", "optimizer")})
        if write:
            save(obj, path)

    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setattr(tt.CocoInstances, "__getitem__", recording_getitem)
        mp.setattr(tt, "save_atomic", recording_save)
        mp.setattr(tt, "evaluate", lambda *args: (0.0, 0.0, 0))
        mp.setattr(torch.amp, "GradScaler", DoublingScaler)
        mp.setattr(sys, "argv", argv)
        tt.main()
    steps = re.findall(r"^epoch (\d+) iter (\d+)/\d+  lr (\S+)", stdout.getvalue(), re.M)
    return seen, steps, saved


@pytest.fixture(scope="module")
def stopped_and_resumed(coco, tmp_path_factory):
    """3 iterations in one run, and in a run stopped by --max-iters 1 (within epoch 0) then resumed."""
    whole = train_in_process(coco, str(tmp_path_factory.mktemp("whole")), "--max-iters", "3", write=False)
    out = str(tmp_path_factory.mktemp("stopped"))
    return whole, train_in_process(coco, out, "--max-iters", "1"), train_in_process(coco, out, "--max-iters", "3",
                                                                                   "--resume", write=False)


def test_max_iters_stop_resumes_within_the_epoch(stopped_and_resumed):
    (seen, steps, saved), stopped, resumed = stopped_and_resumed
    assert steps == [("0", "1", "0.00000"), ("0", "2", "0.00010"), ("1", "3", "0.00010")]  # (epoch, iteration, lr)
    assert len(seen) == 6 and sorted(i for i, _ in seen[:4]) == [0, 1, 2, 3]  # epoch 0: each image once
    # the stop is saved as within epoch 0, after its first batch; the resume goes on from there
    assert [(s["epoch"], s["epoch_iter"], s["iter"]) for s in stopped[2]] == [(0, 1, 1)]
    assert stopped[1] + resumed[1] == steps and stopped[0] + resumed[0] == seen
    assert [(s["epoch"], s["epoch_iter"], s["iter"]) for s in resumed[2]] == [(1, 0, 2), (1, 1, 3)]
    assert [(s["epoch"], s["epoch_iter"], s["iter"]) for s in saved] == [(1, 0, 2), (1, 1, 3)]


def test_resume_restores_the_grad_scaler(stopped_and_resumed):
    whole, stopped, resumed = stopped_and_resumed
    assert [s["scaler"]["scale"] for s in stopped[2]] == [2.0]  # 1 step
    # 3 steps in all, as in the uninterrupted run, not 1 + a fresh scaler's 2
    assert [s["scaler"]["scale"] for s in resumed[2]] == [s["scaler"]["scale"] for s in whole[2]] == [4.0, 8.0]


def test_resume_within_an_epoch_needs_its_seed(coco, tmp_path):
    # the batches done are skipped from the order of (seed, epoch): another seed would skip other images
    out = str(tmp_path / "stopped")
    train_in_process(coco, out, "--max-iters", "1")
    with pytest.raises(UserError, match="stopped within epoch 0: resume it with --batch-size 2 and --seed 0"):
        train_in_process(coco, out, "--max-iters", "3", "--resume", "--seed", "1", write=False)
