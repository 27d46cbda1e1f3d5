"""The data path, as the scripts see it. Inside, each module has one job:

    images      one image file read as RGB (PIL, a tensor, or a JPEG's bytes for the device); unreadable ones
    files       dataset readers (ImageFolder, CIFAR, STL-10, Tiny-ImageNet, VOC2007, the demo's digits)
    views       Table 2's views and the one place their random parameters are drawn
    ops         tensor ops: the one crop-and-resize, the photometric ops, the normalisation
    jpeg        JPEGs decoded on the training device
    preloading  small datasets decoded once onto the device
    samplers    which images each rank reads, in which order
    assembly    batches assembled on the device, for both: cut from preloaded images, or decoded there
    pretrain    pretraining batches, by one of four routes: the same batch to the step whatever the route
    evaluation  evaluation splits and batches, by one of three routes: the same batch whatever the route
    preview     pictures of the views

Nothing outside sce/data imports those modules: it imports this one."""
from sce.data.evaluation import (READER, EvalSplit, Geometry, eval_crop_size, eval_resize, eval_route,  # noqa: F401
                                 eval_split, eval_splits, read_splits)
from sce.data.files import (DATASETS, ImageList, build_dataset, data_folder,  # noqa: F401
                             digits_imagefolder, fingerprint, read_voc07)
from sce.data.images import decode_rgb_tensor, read_header  # noqa: F401
from sce.data.jpeg import JpegDecoder  # noqa: F401
from sce.data.jpeg import available as jpeg_on_device
from sce.data.ops import MEAN, MIN_BLUR_SIZE, STD  # noqa: F401
from sce.data.preloading import Budget, preload  # noqa: F401
from sce.data.preview import view_labels, views_grid, write_preview  # noqa: F401
from sce.data.pretrain import READ, Batch, choose_route, from_flags, pretrain_batches  # noqa: F401
from sce.data.samplers import ORDER_VERSION, ResumableSampler, ShuffledShards  # noqa: F401
from sce.data.views import AUGMENTATIONS, ViewSpec  # noqa: F401


def resolve_decode(decode, device):
    """--decode auto: device where torchvision decodes JPEGs on it (a GPU with JPEG engines), else loader."""
    return ("device" if jpeg_on_device(device) else "loader") if decode == "auto" else decode
