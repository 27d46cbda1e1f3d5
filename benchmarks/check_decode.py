#!/usr/bin/env python
"""How far the device's JPEG decoder (torchvision's decode_jpeg on CUDA: the GPU's JPEG engines) is from
libjpeg-turbo (its CPU decoder, what the loader workers use), in 8-bit levels over every pixel of the
images; exit 1 past the bounds (for gpu_check.sh).

    python benchmarks/check_decode.py [--data DIR] [--images 64] [--max-mean 2] [--max-diff 80]

Without --data, the benchmark's photos (500x375, quality 98); with it, the JPEGs under DIR.
"""
import argparse
import glob
import json
import os
import sys
import tempfile

import torch
from torchvision.io import ImageReadMode, decode_jpeg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from photos import write_photos  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--data", metavar="DIR", help="a folder of JPEG files (searched recursively)")
parser.add_argument("--images", type=int, default=64, help="images compared (default: 64)")
# torchvision's own CUDA test asks a mean under 2; nvJPEG's chroma upsampling differs from libjpeg's "fancy" one
parser.add_argument("--max-mean", type=float, default=2.0, help="bound on the mean difference, levels (default: 2)")
parser.add_argument("--max-diff", type=float, default=80, help="bound on the largest difference, levels (default: 80)")
parser.add_argument("--device", default="cuda", help="(default: cuda)")
args = parser.parse_args()

with tempfile.TemporaryDirectory() as tmp:
    root = args.data or write_photos(tmp, args.images)
    paths = sorted(glob.glob(os.path.join(root, "**", "*.jp*g"), recursive=True))[:args.images]
    datas = [torch.frombuffer(bytearray(open(p, "rb").read()), dtype=torch.uint8) for p in paths]
    on_device = decode_jpeg(datas, mode=ImageReadMode.RGB, device=args.device)
    diffs = [(d.cpu().int() - decode_jpeg(b, mode=ImageReadMode.RGB).int()).abs() for d, b in zip(on_device, datas)]
mean = float(torch.cat([d.flatten() for d in diffs]).float().mean())
largest = max(int(d.max()) for d in diffs)
name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
print(json.dumps({"what": "decode_difference", "images": len(paths), "mean_levels": round(mean, 3),
                  "max_levels": largest, "device": name}))
sys.exit(0 if mean <= args.max_mean and largest <= args.max_diff else 1)
