"""Shared by the detection scripts: read a ResNet trunk from any checkpoint we accept and check it
is the ImageNet-shaped torchvision ResNet (7x7 stem, bottleneck blocks) a detector expects."""
import argparse
import os
import sys

import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sce import UserError  # noqa: E402
from sce.checkpoint import checkpoint_arch, load, read_as, trunk_state_dict  # noqa: E402
from sce.foreign import BASIC_DEPTHS, BOTTLENECK_DEPTHS, blocks_per_stage  # noqa: E402


def describe(state, path):
    """'ResNet-18', 'ResNet-50', ... or a description of an unknown layout."""
    counts = blocks_per_stage(state)
    if 0 in counts:
        raise UserError(f"{path} holds a ResNet trunk without layer{counts.index(0) + 1}: not a full ResNet")
    bottleneck = "layer1.0.conv3.weight" in state
    depth = (BOTTLENECK_DEPTHS if bottleneck else BASIC_DEPTHS).get(counts)
    if depth:
        return f"ResNet-{depth}", depth
    kind = "bottleneck" if bottleneck else "basic-block"
    return f"{kind} ResNet with {'-'.join(map(str, counts))} blocks", None


def read_resnet_trunk(path, encoder="online", depth=50, depth_flag=False):
    """The torchvision-style trunk of `path` (no fc), refused unless it has exactly the names and
    shapes of torchvision's resnet{depth}: ResNet-18/34, ResNeXt, wide and small-input trunks are
    caught here with a message saying what was found. depth_flag: the caller has a --depth flag
    the message may suggest."""
    ckpt = load(path)
    state = trunk_state_dict(ckpt, path, encoder)
    arch, small_input = checkpoint_arch(ckpt)
    if read_as(ckpt, path, encoder):  # another code's file: what was read
        print(read_as(ckpt, path, encoder))
    if ckpt.get("normalize"):
        mean, std = ckpt["normalize"]
        print(f"note: {path} records inputs normalised with mean {mean} std {std}: give the detector those "
              "(detectron2's MODEL.PIXEL_MEAN / PIXEL_STD are x255)")
    conv1 = tuple(state["conv1.weight"].shape)
    if small_input or conv1[-1] != 7:
        raise UserError(f"{path} holds a small-input trunk (conv1 {'x'.join(map(str, conv1[-2:]))}, "
                        "no max-pool; pretrained with --small-input for 32-96 px images): detectors "
                        "need the ImageNet 7x7 stride-2 stem, pretrain without --small-input")
    name, found = describe(state, path)
    if found != depth:
        hint = f" or pass --depth {found}" if depth_flag and found in (50, 101, 152) else ""
        raise UserError(f"{path} holds a {name} trunk{f' ({arch})' if arch else ''} but the detector "
                        f"needs a bottleneck ResNet-{depth}: convert a ResNet-{depth} checkpoint{hint}")
    with torch.device("meta"):  # shapes only, no memory
        expected = getattr(torchvision.models, f"resnet{depth}")().state_dict()
    expected = {k: v.shape for k, v in expected.items() if not k.startswith("fc.")}
    # old torchvision weights have no num_batches_tracked; BatchNorm loads them as 0 anyway
    missing = [k for k in expected if k not in state and not k.endswith("num_batches_tracked")]
    extra = [k for k in state if k not in expected]
    wrong = [k for k in expected if k in state and state[k].shape != expected[k]]
    if missing or extra or wrong:
        k = (wrong or missing or extra)[0]
        what = (f"{k} has shape {list(state[k].shape)}, torchvision's is {list(expected[k])}" if wrong
                else f"{k} is missing" if missing else f"unexpected key {k}")
        raise UserError(f"{path} is not a torchvision ResNet-{depth} trunk ({what}{f'; arch {arch}' if arch else ''}): "
                        "ResNeXt and wide ResNets are not supported by the detection scripts")
    for k in expected:
        state.setdefault(k, torch.zeros((), dtype=torch.long))
    return {k: state[k] for k in expected}


INPUT_HELP = ("main_pretrain.py or main_lincls.py checkpoint, a torchvision ResNet state dict, or another code's "
              "checkpoint (docs/published-weights.md)")


def converter_parser(doc, output_help):
    """The flags every converter takes: input, output, --encoder, --force (check_output)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help=INPUT_HELP)
    parser.add_argument("output", help=output_help)
    parser.add_argument("--encoder", default="online", choices=["online", "momentum"],
                        help="trunk of a pretraining checkpoint to export (default: online)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")
    return parser


def check_output(path, force):
    if os.path.exists(path) and not force:
        raise UserError(f"{path} already exists: pass --force to overwrite it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"output folder {folder} does not exist: create it first")
