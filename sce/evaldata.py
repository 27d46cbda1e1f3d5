"""The evaluation splits as the protocols read them, for main_lincls.py and the kNN monitor of main_pretrain.py:
train and val of any --dataset layout, their classes checked, preloaded on the device (a small-input trunk),
decoded there (an ImageNet-stem trunk, --decode device) or read with the loader's transforms. Every image of
a split is read: an unreadable one stops the evaluation with one line naming it (sce.loader.UnreadableImage)."""
import os

from sce import UserError
from sce.datasets import build_dataset
from sce.device_decode import DecodedEval
from sce.loader import eval_resize, eval_transform
from sce.preload import preload_eval

FOLDERS = ("imagefolder", "imagenet100", "tiny-imagenet")  # DATA/train and DATA/val


def decodes_on_device(decode, small_input):
    """JPEGs decoded, resized and cropped on the device (--decode device), for an ImageNet-stem trunk: a
    small-input one is preloaded instead, its protocol's padded random crop is not a device geometry."""
    return decode == "device" and not small_input


def num_classes_of(train, val, dataset, root):
    """Number of classes, checking there are two or more and that val has the same ones."""
    classes = getattr(train, "classes", None)
    n = len(classes) if classes else int(max(train.targets)) + 1
    where = os.path.join(root, "train") if dataset in FOLDERS else root
    if n < 2:
        raise UserError(f"{where} holds a single class ({classes[0] if classes else 0}): "
                        "a classifier needs at least 2 classes (one sub-folder per class)")
    val_classes = getattr(val, "classes", None)
    if classes and val_classes and list(val_classes) != list(classes):
        odd = sorted(set(val_classes) ^ set(classes))
        raise UserError(f"{os.path.join(root, 'val')} and {where} have different classes "
                        f"(first difference: {odd[0] if odd else 'order'}): both need the same class folders")
    return n


def read_splits(dataset, root, transform=None, encoded=False, class_list=None):
    """(train, val, number of classes) of `root` in the `dataset` layout (val: the test set of CIFAR / STL10)."""
    missing = [s for s in ("train", "val") if not os.path.isdir(os.path.join(root, s))]
    if dataset in FOLDERS and os.path.isdir(root) and missing:  # else build_dataset names what is wrong
        raise UserError(f"{root} has no {missing[0]}/ folder: an evaluation needs {root}/train and {root}/val")
    train, val = (build_dataset(dataset, root, split, transform, class_list, encoded=encoded)
                  for split in ("train", "val"))
    return train, val, num_classes_of(train, val, dataset, root)


def splits(dataset, root, size, small_input, device, preload="auto", decode="loader", workers=0,
           augment_train=False, class_list=None, what=""):
    """(train, val, number of classes) as the evaluation reads them at `size` px: preloaded on the device
    (a small-input trunk, --preload), read for the device's JPEG decoder (an ImageNet-stem trunk, --decode
    device) or with the loader's transforms. augment_train: the linear probe's random crops and flips."""
    encoded = decodes_on_device(decode, small_input)
    train, val, classes = read_splits(dataset, root, encoded=encoded, class_list=class_list)
    if small_input:  # the large-image protocol's random resized crop stays in the loader
        bank, queries = (preload_eval(ds, size, preload, device, workers, augment, what=f"{what}{split} images")
                         for ds, split, augment in ((train, "train", augment_train), (val, "val", False)))
        if bank and queries:
            return bank, queries, classes
    train_tf, val_tf = (eval_transform(t, size, small_input) for t in (augment_train, False))
    if encoded:  # the loader path's resize and centre crop
        resize = eval_resize(size)
        return (DecodedEval(train, size, train_tf, None if augment_train else resize),
                DecodedEval(val, size, val_tf, resize), classes)
    train.transform, val.transform = train_tf, val_tf
    return train, val, classes
