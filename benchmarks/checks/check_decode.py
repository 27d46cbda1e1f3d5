#!/usr/bin/env python
"""How far the device's JPEG decoder (sce.data's JpegDecoder: torchvision's decode_jpeg on CUDA, the GPU's JPEG
engines) is from libjpeg-turbo (its CPU decoder, what the loader workers use), in 8-bit levels over every
pixel of the JPEGs training sends there (sce.data.read_header's plain ones); exit 1 past the bounds.

    python benchmarks/checks/check_decode.py [--data DIR] [--images 64] [--max-mean 2] [--max-diff 80]

Without --data, the benchmark's photos (500x375, quality 98); with it, the JPEGs under DIR.
"""
import argparse
import glob
import itertools
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "speed"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
from photos import write_photos  # noqa: E402
from sce.data import JpegDecoder, decode_rgb_tensor, read_header  # noqa: E402

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
    files = (open(p, "rb").read() for p in sorted(glob.glob(os.path.join(root, "**", "*.jp*g"), recursive=True)))
    datas = [torch.frombuffer(bytearray(d), dtype=torch.uint8)
             for d in itertools.islice((d for d in files if read_header(d)[3]), args.images)]
    if not datas:
        sys.exit(f"error: no baseline JPEG under {root}")
    on_device = JpegDecoder(torch.device(args.device))(datas)
    diffs = [(d.cpu().int() - decode_rgb_tensor(b.numpy().tobytes()).int()).abs() for d, b in zip(on_device, datas)]
mean = float(torch.cat([d.flatten() for d in diffs]).float().mean())
largest = max(int(d.max()) for d in diffs)
name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
print(json.dumps({"what": "decode_difference", "images": len(datas), "mean_levels": round(mean, 3),
                  "max_levels": largest, "device": name}))
sys.exit(0 if mean <= args.max_mean and largest <= args.max_diff else 1)
