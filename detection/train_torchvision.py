#!/usr/bin/env python
"""Fine-tune torchvision's Mask R-CNN R50-FPN from an SCE trunk on a COCO-format dataset.

For users without detectron2. One process per GPU under torchrun (or one plain process):

    torchrun --nproc_per_node 8 detection/train_torchvision.py --pretrained sce_r50_torchvision.pth \
        --train-images coco/train2017 --train-ann coco/annotations/instances_train2017.json \
        --val-images coco/val2017 --val-ann coco/annotations/instances_val2017.json --output-dir out

Defaults follow torchvision's detection reference (26 epochs, LR steps at 16 and 22, 2 images per
GPU on 8 GPUs). The FPN head differs from the paper's R50-C4, so its AP is not Table 9's.
Prints COCO box and mask AP at the end and writes them to OUTPUT/eval.json.
"""
import argparse
import contextlib
import io
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torchvision
from PIL import Image
from pycocotools import mask as mask_util
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torchvision.transforms.functional import pil_to_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sce import UserError, cli  # noqa: E402
from sce import distributed as du  # noqa: E402
from sce.checkpoint import load, save_atomic  # noqa: E402
from sce.preemption import end_with_parent  # noqa: E402
from trunk import read_resnet_trunk  # noqa: E402


class CocoInstances(torch.utils.data.Dataset):
    """Images and instance annotations (boxes, polygon or RLE masks) of a COCO-format json.
    Labels are 1..K in the order of sorted category ids; 0 is torchvision's background."""

    def __init__(self, images, ann_file, train):
        for path in (images, ann_file):
            if not os.path.exists(path):
                raise UserError(f"{path} does not exist: check --train-images/--train-ann/--val-images/--val-ann")
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
                self.coco = COCO(ann_file)
        except (ValueError, KeyError, TypeError, AssertionError) as e:
            raise UserError(f"{ann_file} is not a COCO annotation file ({type(e).__name__}: {e})") from None
        for a in self.coco.anns.values():  # COCOeval needs both; some converted datasets omit them
            a.setdefault("iscrowd", 0)
            a.setdefault("area", a["bbox"][2] * a["bbox"][3])
        self.cat_ids = sorted(self.coco.getCatIds())
        self.images, self.train = images, train
        self.ids = sorted(self.coco.getImgIds())
        if train:  # images without a usable object give no training signal
            self.ids = [i for i in self.ids if any(self._usable(a) for a in self.coco.imgToAnns[i])]

    @staticmethod
    def _usable(ann):
        return not ann["iscrowd"] and ann["bbox"][2] > 0 and ann["bbox"][3] > 0

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, key):
        """key: an index, or the (index, flip) pair of EpochSampler, which draws the training flips."""
        index, flip = key if isinstance(key, tuple) else (key, False)
        img_id = self.ids[index]
        info = self.coco.imgs[img_id]
        image = Image.open(os.path.join(self.images, info["file_name"])).convert("RGB")
        w, h = image.size
        anns = [a for a in self.coco.imgToAnns[img_id] if self._usable(a)]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h)
        masks = torch.from_numpy(np.stack([self.coco.annToMask(a) for a in anns]) if anns
                                 else np.zeros((0, h, w), np.uint8))
        labels = torch.tensor([self.cat_ids.index(a["category_id"]) + 1 for a in anns], dtype=torch.int64)
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])  # boxes outside the image
        image = pil_to_tensor(image).float() / 255
        target = {"boxes": boxes[keep], "labels": labels[keep], "masks": masks[keep], "image_id": img_id}
        if flip:
            image, target["masks"] = image.flip(-1), target["masks"].flip(-1)
            target["boxes"][:, [0, 2]] = w - target["boxes"][:, [2, 0]]
        return image, target


class EpochSampler(torch.utils.data.Sampler):
    """(index, flip) pairs of this process: a shuffle and flips drawn from (seed, epoch) alone, its
    share rank::world (the remainder dropped: every process takes as many steps), less the first
    `skip`. A run resumed within an epoch so sees the images and flips an uninterrupted one would
    have, whatever the global RNG or the data-loading workers did before."""

    def __init__(self, size, seed, rank, world):
        self.size, self.seed, self.rank, self.world = size, seed, rank, world
        self.epoch, self.skip = 0, 0

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order, flips = torch.randperm(self.size, generator=g), torch.rand(self.size, generator=g) < 0.5
        share = range(self.rank, self.size - self.size % self.world, self.world)[self.skip:]
        return iter([(int(order[i]), bool(flips[i])) for i in share])

    def __len__(self):
        return self.size // self.world - self.skip


def collate(batch):
    return tuple(zip(*batch))


def coco_results(output, image_id, cat_ids):
    """torchvision detections of one image -> COCO result dicts (xywh boxes, RLE masks)."""
    boxes = output["boxes"].cpu().clone()
    boxes[:, 2:] -= boxes[:, :2]
    masks = (output["masks"][:, 0] > 0.5).cpu().numpy().astype(np.uint8)
    results = []
    for box, score, label, m in zip(boxes.tolist(), output["scores"].tolist(), output["labels"].tolist(), masks):
        rle = mask_util.encode(np.asfortranarray(m))
        rle["counts"] = rle["counts"].decode("ascii")  # json-serializable
        results.append({"image_id": image_id, "category_id": cat_ids[label - 1], "bbox": box,
                        "score": score, "segmentation": rle})
    return results


def coco_ap(coco_gt, results):
    """COCO AP@[.5:.95] (in %) for boxes and masks; prints pycocotools' summaries."""
    aps = {}
    for iou_type, drop in (("bbox", "segmentation"), ("segm", "bbox")):
        if not results:  # loadRes cannot take an empty list; nothing detected is AP 0
            aps[iou_type] = 0.0
            continue
        # loadRes fills area from the box when a result has one: give masks only for segm
        with contextlib.redirect_stdout(io.StringIO()):
            dets = coco_gt.loadRes([{k: v for k, v in r.items() if k != drop} for r in results])
            ev = COCOeval(coco_gt, dets, iou_type)
            ev.evaluate()
            ev.accumulate()
        print(f"{iou_type}:")
        ev.summarize()
        aps[iou_type] = float(ev.stats[0]) * 100
    return aps["bbox"], aps["segm"]


@torch.no_grad()
def evaluate(model, dataset, device, args):
    """Each rank detects on its share of the images; rank 0 scores all of them."""
    model.eval()
    shard = torch.utils.data.Subset(dataset, range(du.rank(), len(dataset), du.world_size()))
    loader = torch.utils.data.DataLoader(shard, batch_size=args.batch_size, num_workers=args.workers,
                                         collate_fn=collate, worker_init_fn=end_with_parent)
    results = []
    for images, targets in loader:
        outputs = model([img.to(device) for img in images])
        for out, target in zip(outputs, targets):
            results += coco_results(out, target["image_id"], dataset.cat_ids)
    if du.is_dist():
        gathered = [None] * du.world_size()
        dist.all_gather_object(gathered, results)
        results = [r for part in gathered for r in part]
    model.train()
    return (*coco_ap(dataset.coco, results), len(results)) if du.is_main() else (None, None, None)


def lr_at(it, epoch, args):
    """Linear warmup over the first iterations, then x0.1 at each of --lr-steps (epochs)."""
    warmup = 1.0 if it >= args.warmup_iters else 0.001 + (1 - 0.001) * it / args.warmup_iters
    return args.lr * warmup * 0.1 ** sum(epoch >= s for s in args.lr_steps)


def train_one_epoch(ddp, loader, optimizer, scaler, amp, device, epoch, it, total, args, log):
    """The epoch's batches from iteration `it` until the loader or `total` ends; returns the iterations run."""
    start, done = time.time(), 0
    for images, targets in loader:
        lr = lr_at(it + done, epoch, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        images = [img.to(device, non_blocking=True) for img in images]
        targets = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()} for t in targets]
        with torch.autocast(device.type, enabled=amp):
            losses = ddp(images, targets)
        loss = sum(losses.values())
        if not math.isfinite(loss.item()):
            raise UserError(f"the loss is {loss.item()} at iteration {it + done}: lower --lr")
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        done += 1
        if (it + done) % args.print_freq == 0 or it + done == total:
            parts = "  ".join(f"{k} {v.item():.3f}" for k, v in losses.items())
            log(f"epoch {epoch} iter {it + done}/{total}  lr {lr:.5f}  loss {loss.item():.3f}  {parts}  "
                f"{(time.time() - start) / done:.2f} s/it")
        if it + done >= total:
            break
    return done


def resume(args, last, model, optimizer, scaler, world, log):
    """(epoch, iteration, batches of that epoch already trained on) of OUTPUT/checkpoint_last.pth, loaded into
    the model, optimizer and scaler."""
    ckpt = load(last)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    if ckpt.get("scaler"):  # {} from a run without --amp: the fresh scale stays
        scaler.load_state_dict(ckpt["scaler"])
    start_epoch, it, epoch_iter = ckpt["epoch"], ckpt["iter"], ckpt.get("epoch_iter", 0)
    # within an epoch, the batches done are skipped from the order of (seed, epoch): the same order needed
    ran = (ckpt["args"]["batch_size"], ckpt.get("world"), ckpt["args"]["seed"])
    if epoch_iter and ran != (args.batch_size, world, args.seed):
        raise UserError(f"{last} stopped within epoch {start_epoch}: resume it with --batch-size "
                        f"{ran[0]} and --seed {ran[2]} on {ran[1]} process(es), as it ran")
    log(f"=> resumed from {last} (epoch {start_epoch} after its batch {epoch_iter}, iteration {it})")
    return start_epoch, it, epoch_iter


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", default="", help="trunk to start from: the output of "
                        "convert-pretrain-to-torchvision.py or any checkpoint it takes (default: none, "
                        "random init)")
    parser.add_argument("--encoder", default="online", choices=["online", "momentum"],
                        help="trunk of a main_pretrain.py --pretrained checkpoint (default: online)")
    parser.add_argument("--train-images", required=True, help="folder of the training images")
    parser.add_argument("--train-ann", required=True, help="COCO-format json of the training images")
    parser.add_argument("--val-images", required=True, help="folder of the evaluation images")
    parser.add_argument("--val-ann", required=True, help="COCO-format json of the evaluation images")
    parser.add_argument("--output-dir", required=True, help="checkpoint_last.pth and eval.json go here")
    parser.add_argument("--epochs", default=26, type=int, help="training epochs (default: 26)")
    parser.add_argument("--max-iters", default=0, type=int,
                        help="stop after this many iterations in all, for smoke tests (default: 0, no limit)")
    parser.add_argument("--batch-size", default=2, type=int, help="images per process (default: 2)")
    parser.add_argument("--lr", default=0.02, type=float,
                        help="SGD learning rate, for 16 images per step in all; scale it linearly "
                        "(default: 0.02)")
    parser.add_argument("--lr-steps", default=[16, 22], type=int, nargs="+",
                        help="epochs at which the learning rate is divided by 10 (default: 16 22)")
    parser.add_argument("--warmup-iters", default=1000, type=int, help="linear warmup iterations (default: 1000)")
    parser.add_argument("--momentum", default=0.9, type=float, help="SGD momentum (default: 0.9)")
    parser.add_argument("--weight-decay", default=1e-4, type=float, help="weight decay (default: 1e-4)")
    parser.add_argument("--min-size", default=800, type=int, help="shorter image side, in pixels (default: 800)")
    parser.add_argument("--max-size", default=1333, type=int, help="longest image side, in pixels (default: 1333)")
    parser.add_argument("--rois-per-image", default=512, type=int,
                        help="proposals sampled per image to train the box and mask heads (default: 512)")
    parser.add_argument("--score-thresh", default=0.05, type=float,
                        help="detections scored below are dropped before evaluation (default: 0.05)")
    parser.add_argument("--workers", default=4, type=int, help="data-loading workers per process (default: 4)")
    parser.add_argument("--amp", action="store_true", help="mixed precision on GPU")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT/checkpoint_last.pth")
    parser.add_argument("--eval-only", action="store_true",
                        help="only evaluate (the --resume checkpoint or the --pretrained start)")
    parser.add_argument("--print-freq", default=20, type=int, help="log every N iterations (default: 20)")
    parser.add_argument("--seed", default=0, type=int, help="random seed (default: 0)")
    return parser


def main():
    args = get_parser().parse_args()
    cli.check_finite(args)
    cli.check_ranges({"--batch-size": args.batch_size, "--epochs": args.epochs, "--warmup-iters": args.warmup_iters,
                      "--print-freq": args.print_freq, "--min-size": args.min_size, "--max-size": args.max_size,
                      "--rois-per-image": args.rois_per_image},
                     {"--lr": args.lr, "--weight-decay": args.weight_decay, "--momentum": args.momentum,
                      "--workers": args.workers, "--max-iters": args.max_iters})
    cli.check_seed(args.seed)
    args.workers = cli.cap_processes(args.workers)
    os.makedirs(args.output_dir, exist_ok=True)
    last = os.path.join(args.output_dir, "checkpoint_last.pth")
    if args.resume and not os.path.isfile(last):
        raise UserError(f"--resume: {last} does not exist")

    _, world, _, device = du.init()
    torch.manual_seed(args.seed + du.rank())
    log = print if du.is_main() else (lambda *a, **k: None)
    trunk = read_resnet_trunk(args.pretrained, args.encoder, depth=50) if args.pretrained else None
    train_set = CocoInstances(args.train_images, args.train_ann, train=True)
    val_set = CocoInstances(args.val_images, args.val_ann, train=False)
    if val_set.cat_ids != train_set.cat_ids:
        raise UserError(f"{args.val_ann} and {args.train_ann} list different categories")

    model = torchvision.models.detection.maskrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=len(train_set.cat_ids) + 1,
        min_size=args.min_size, max_size=args.max_size, box_score_thresh=args.score_thresh,
        box_batch_size_per_image=args.rois_per_image)
    if trunk is not None:
        model.backbone.body.load_state_dict(trunk)  # strict: every trunk weight has its place
        log(f"=> loaded the ResNet-50 trunk of {args.pretrained}")
    if world > 1 and device.type == "cuda":
        # every BN trains, synchronized across GPUs: 2 images per GPU are too few for BN statistics
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None) \
        if world > 1 else model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    amp = args.amp and device.type == "cuda"
    scaler = torch.amp.GradScaler(device.type, enabled=amp)

    start_epoch, it, epoch_iter = (resume(args, last, model, optimizer, scaler, world=world, log=log) if args.resume
                                   else (0, 0, 0))

    sampler = EpochSampler(len(train_set), args.seed, du.rank(), world)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                                         num_workers=args.workers, collate_fn=collate, worker_init_fn=end_with_parent,
                                         persistent_workers=args.workers > 0)
    per_epoch = len(loader)
    if per_epoch == 0:
        raise UserError(f"{len(train_set)} training images make no batch of {args.batch_size} per process "
                        f"on {world} processes: lower --batch-size")
    total = args.epochs * per_epoch if args.max_iters <= 0 else min(args.max_iters, args.epochs * per_epoch)
    log(f"{len(train_set)} training images, {len(val_set)} evaluation images, "
        f"{len(train_set.cat_ids)} classes, {total} iterations on {world} process(es)")

    epoch = start_epoch
    while not args.eval_only and it < total and epoch < args.epochs:
        sampler.epoch, sampler.skip = epoch, epoch_iter * args.batch_size  # resumed: the batches done are skipped
        model.train()
        done = train_one_epoch(ddp, loader, optimizer, scaler, amp, device, epoch=epoch, it=it, total=total, args=args,
                               log=log)
        it, epoch_iter = it + done, epoch_iter + done
        if epoch_iter == per_epoch:  # else --max-iters stopped within the epoch: a resume goes on in it
            epoch, epoch_iter = epoch + 1, 0
        if du.is_main():
            save_atomic({"kind": "detection", "epoch": epoch, "epoch_iter": epoch_iter, "iter": it, "world": world,
                         "args": vars(args), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict()}, last)

    ap_box, ap_mask, num_dets = evaluate(model, val_set, device, args)
    if du.is_main():
        print(f"AP box {ap_box:.1f}  AP mask {ap_mask:.1f}  ({num_dets} detections on {len(val_set)} images)")
        with open(os.path.join(args.output_dir, "eval.json"), "w") as f:
            json.dump({"ap_box": ap_box, "ap_mask": ap_mask, "detections": num_dets, "iter": it}, f)
    du.cleanup()


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
