#!/usr/bin/env python
"""Write the ResNet trunk of a checkpoint in the SCE authors' format (eztorch), which their linear evaluation
reads as it is (run/linear_classifier_evaluation.py with model.pretrained_trunk_path=OUTPUT: the state dict's
trunk.* keys, their default model.trunk_pattern), small-input trunks included.

    python detection/convert-pretrain-to-eztorch.py checkpoint_last.pth sce_r18_eztorch.ckpt

The output holds {"state_dict": {"trunk.<torchvision name>": tensor}, "epoch": E, "hyper_parameters": {"trunk":
{"_target_": "eztorch.models.trunks.create_resnet", "name": ARCH, "num_classes": 0, "small_input": ...}}}: plain
tensors, numbers and strings (a weights-only load reads it); their config must build the same trunk (name,
small_input).
"""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sce import UserError  # noqa: E402
from sce.checkpoint import load, read_as, save_atomic, trunk_spec  # noqa: E402
from trunk import check_output, converter_parser  # noqa: E402


def main():
    parser = converter_parser(__doc__, "checkpoint to write in the SCE authors' format (.ckpt)")
    args = parser.parse_args()

    check_output(args.output, args.force)
    ckpt = load(args.input)
    state, arch, small_input = trunk_spec(ckpt, args.input, encoder=args.encoder)
    said = read_as(ckpt, args.input, args.encoder)
    if said:
        print(said)
    out = {"state_dict": collections.OrderedDict((f"trunk.{k}", v.detach().clone()) for k, v in state.items()),
           "hyper_parameters": {"trunk": {"_target_": "eztorch.models.trunks.create_resnet", "name": arch,
                                          "num_classes": 0, "small_input": small_input}}}
    if type(ckpt.get("epoch")) is int:
        out["epoch"] = ckpt["epoch"]
    save_atomic(out, args.output)
    print(f"wrote {len(state)} tensors of the {args.encoder} {arch}{' (small input)' if small_input else ''} trunk "
          f"to {args.output} (state_dict trunk.*, the SCE authors' format)")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
