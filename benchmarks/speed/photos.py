"""ImageNet-like photos for the benchmarks and GPU checks, written from scikit-learn's two sample photos
(no download)."""
import os

import numpy as np
from PIL import Image


def write_photos(root, count):
    """ImageNet-like JPEGs: random crops of the two sample photos, 500x375, quality 98 (~100 KB)."""
    from sklearn.datasets import load_sample_images
    photos = load_sample_images().images
    rng = np.random.default_rng(0)
    os.makedirs(os.path.join(root, "photos"))
    for i in range(count):
        photo = photos[i % len(photos)]
        h, w = photo.shape[:2]
        ch, cw = int(h * rng.uniform(0.75, 1.0)), int(w * rng.uniform(0.75, 1.0))
        top, left = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
        img = Image.fromarray(photo[top:top + ch, left:left + cw]).resize((500, 375), Image.BICUBIC)
        img.save(os.path.join(root, "photos", f"{i:05d}.jpg"), quality=98)
    return root
