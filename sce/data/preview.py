"""Pictures of the augmented views: the --preview-views grid and the TensorBoard image of a run."""
import os

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

from sce import UserError
from sce.data.ops import MEAN, STD

HEADER = 16  # px of label above each column


def denormalize(view):
    """(N, 3, H, W) normalised view (any dtype, device, memory format) -> float [0, 1] on the CPU."""
    view = view.detach().float().cpu()
    return (view * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)).clamp(0, 1)


def views_grid(views, labels, rows=8, cell=112):
    """A PIL image: one row per image (the first `rows`), one column per view, every view resized to
    cell x cell px (nearest: pixels stay visible), each column headed by its label.
    Size: (len(views) * cell, HEADER + rows * cell)."""
    rows = min(rows, len(views[0]))
    columns = [F.interpolate(denormalize(v[:rows]), size=(cell, cell), mode="nearest") for v in views]
    grid = torch.cat([torch.cat(list(c), dim=1) for c in columns], dim=2)  # (3, rows * cell, columns * cell)
    pixels = (grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    image = Image.new("RGB", (pixels.shape[1], HEADER + pixels.shape[0]), "white")
    image.paste(Image.fromarray(pixels), (0, HEADER))
    draw = ImageDraw.Draw(image)
    for i, label in enumerate(labels):
        draw.text((i * cell + 2, 2), label, fill="black")
    return image


def view_labels(args):
    """Column labels of the views main_pretrain.py makes: view 0, view 1, then the local crops."""
    role0, role1 = ("target + online", "target + online") if args.symmetric else ("target", "online")
    labels = [f"{role0}: {args.target_aug}", f"{role1}: {args.online_aug}"]
    return labels + [f"local {size}: {args.local_aug}" for size in args.local_crop_sizes]


def write_preview(args, views, path):
    """--preview-views: a grid of `views` (a list of views of the same images, as training makes them) to `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"folder {folder} does not exist: pass --preview-views a path in an existing folder")
    grid = views_grid(views, view_labels(args))
    grid.save(path)
    print(f"=> wrote the views of {len(views[0])} images to {path} ({grid.size[0]}x{grid.size[1]} px, augment on "
          f"{args.augment})", flush=True)
