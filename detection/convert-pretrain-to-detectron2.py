#!/usr/bin/env python
"""Convert the ResNet trunk of an SCE checkpoint to detectron2's .pkl weight format.

    python detection/convert-pretrain-to-detectron2.py checkpoint_last.pth sce_r50.pkl

Names follow detectron2's ResNet: stem.conv1(.norm), res2..res5 blocks with conv1..conv3(.norm)
and shortcut(.norm). With matching_heuristics detectron2 matches res5 into the C4 ROI head.
"""
import os
import pickle
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sce import UserError  # noqa: E402
from trunk import check_output, converter_parser, read_resnet_trunk  # noqa: E402


def detectron2_name(name):
    """torchvision ResNet name -> detectron2 name, e.g. layer1.0.bn1.weight -> res2.0.conv1.norm.weight."""
    if not name.startswith("layer"):
        name = "stem." + name
    name = re.sub(r"^layer(\d)", lambda m: f"res{int(m.group(1)) + 1}", name)
    name = name.replace("downsample.0", "shortcut").replace("downsample.1", "shortcut.norm")
    return re.sub(r"\bbn(\d)", r"conv\1.norm", name)


def main():
    parser = converter_parser(__doc__, "detectron2 weights to write (.pkl)")
    parser.add_argument("--depth", default=50, type=int, choices=[50, 101, 152],
                        help="ResNet depth the detectron2 config uses, MODEL.RESNETS.DEPTH (default: 50)")
    args = parser.parse_args()

    check_output(args.output, args.force)
    state = read_resnet_trunk(args.input, args.encoder, args.depth, depth_flag=True)
    model = {detectron2_name(k): v.detach().cpu().numpy() for k, v in state.items()
             if not k.endswith("num_batches_tracked")}
    out = {"model": model, "__author__": "SCE", "matching_heuristics": True}
    # write next to the target and rename: an interrupted run never leaves a truncated .pkl
    tmp = os.path.join(os.path.dirname(os.path.abspath(args.output)), f".{os.path.basename(args.output)}.tmp")
    try:
        with open(tmp, "wb") as f:
            pickle.dump(out, f)
        os.replace(tmp, args.output)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(f"could not write {args.output} ({e.strerror or e})") from None
    print(f"wrote {len(model)} tensors of the {args.encoder} ResNet-{args.depth} trunk to {args.output}")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
