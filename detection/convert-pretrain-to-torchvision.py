#!/usr/bin/env python
"""Extract the ResNet-50 trunk of an SCE checkpoint for torchvision's detection models.

    python detection/convert-pretrain-to-torchvision.py checkpoint_last.pth sce_r50_torchvision.pth

The output is a plain state dict that
maskrcnn_resnet50_fpn(weights=None, weights_backbone=None).backbone.body loads with strict=True
(train_torchvision.py --pretrained takes it).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sce import UserError  # noqa: E402
from sce.checkpoint import save_atomic  # noqa: E402
from trunk import check_output, converter_parser, read_resnet_trunk  # noqa: E402


def main():
    parser = converter_parser(__doc__, "state dict to write (.pth)")
    args = parser.parse_args()

    check_output(args.output, args.force)
    # torchvision's detection models only come with a ResNet-50 body
    state = read_resnet_trunk(args.input, args.encoder, depth=50)
    save_atomic({k: v.detach().clone() for k, v in state.items()}, args.output)
    print(f"wrote {len(state)} tensors of the {args.encoder} ResNet-50 trunk to {args.output}")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
