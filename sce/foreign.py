"""Checkpoints of other codes that hold a torchvision ResNet, recognised by their keys and read as one of ours
(sce.checkpoint), without running any of their code (sce.unpickling):

    the SCE authors' (eztorch, Lightning)  state_dict: trunk. (online), momentum_trunk. (momentum)
    solo-learn (Lightning)                 state_dict: backbone., momentum_backbone.
    MoCo v2                                state_dict: module.encoder_q., module.encoder_k.
    MoCo v3                                state_dict: module.base_encoder., module.momentum_encoder.
    DINO-style                             student / teacher: backbone. (module.backbone. under DDP), or one state
                                           dict student.backbone. / teacher.backbone.

A file found is {"kind": "foreign", "what": its line, "trunks": {"online": state, "momentum": state or None}, "args":
{"arch", "small_input"}, "normalize": (mean, std) or None}: its trunks' arch and stem read from the weights' shapes and
checked against what the file itself says of them (the SCE authors' hyper_parameters' trunk, MoCo's arch, DINO's
args), its input normalisation where the file records one (the SCE authors' transforms)."""
import re

from sce import UserError
from sce.unpickling import Inert, Refused, inert_fields

# (online prefix, momentum prefix, code), tried in order on a file's state dict; a DINO-style student's and
# teacher's dicts (DINO_KEYS) are tried with the prefixes of DINO_BACKBONES
PREFIXES = [("trunk.", "momentum_trunk.", "sce"),
            ("backbone.", "momentum_backbone.", "solo-learn"),
            ("module.encoder_q.", "module.encoder_k.", "mocov2"),
            ("encoder_q.", "encoder_k.", "mocov2"),
            ("module.base_encoder.", "module.momentum_encoder.", "mocov3"),
            ("base_encoder.", "momentum_encoder.", "mocov3"),
            ("student.backbone.", "teacher.backbone.", "dino"),
            ("module.student.backbone.", "module.teacher.backbone.", "dino")]
# code -> what a file of it is called (a Lightning checkpoint, another file)
WHAT = {"sce": ("the SCE authors' Lightning checkpoint", "a checkpoint in the SCE authors' format"),
        "solo-learn": ("a solo-learn Lightning checkpoint", "a backbone. checkpoint (solo-learn's names)"),
        "mocov2": ("a MoCo v2 checkpoint",) * 2, "mocov3": ("a MoCo v3 checkpoint",) * 2,
        "dino": ("a DINO-style checkpoint",) * 2,
        "lightning": ("a Lightning checkpoint of a torchvision ResNet",) * 2}
DINO_KEYS = ("student", "teacher")
DINO_BACKBONES = ("module.backbone.", "backbone.")
LIGHTNING = "pytorch-lightning_version"
# blocks per stage (layer1..layer4) -> depth, for bottleneck and basic-block ResNets
BOTTLENECK_DEPTHS = {(3, 4, 6, 3): 50, (3, 4, 23, 3): 101, (3, 8, 36, 3): 152}
BASIC_DEPTHS = {(2, 2, 2, 2): 18, (3, 4, 6, 3): 34}
# a bottleneck's (width of layer1's first block, groups of its 3x3 conv) -> the torchvision name's form
BOTTLENECK_NAMES = {(64, 1): "resnet{}", (128, 1): "wide_resnet{}_2", (128, 32): "resnext{}_32x4d",
                    (256, 32): "resnext{}_32x8d"}


def strip(state, prefix):
    """The entries of `state` under `prefix`, without it, the fc head dropped (MoCo's and solo-learn's heads)."""
    return {k[len(prefix):]: v for k, v in state.items()
            if isinstance(k, str) and k.startswith(prefix) and not k[len(prefix):].startswith("fc.")}


def is_resnet(state):
    return isinstance(state, dict) and "conv1.weight" in state and "layer1.0.conv1.weight" in state


def blocks_per_stage(state):
    """(blocks of layer1, ..., layer4), 0 for a stage it lacks."""
    counts = []
    for stage in range(1, 5):
        ids = {int(k.split(".")[1]) for k in state if k.startswith(f"layer{stage}.") and k.split(".")[1].isdigit()}
        counts.append(max(ids) + 1 if ids else 0)
    return tuple(counts)


def resnet_arch(state):
    """(torchvision arch name or None, small_input) of a ResNet state dict, from its weights' shapes: the blocks
    per stage, bottleneck or basic blocks, the bottleneck's width and groups, and conv1's kernel (3: the small-input
    stem)."""
    counts, bottleneck = blocks_per_stage(state), "layer1.0.conv3.weight" in state
    depth = (BOTTLENECK_DEPTHS if bottleneck else BASIC_DEPTHS).get(counts)
    name = "resnet{}"
    if depth and bottleneck:
        width = state["layer1.0.conv1.weight"].shape[0]
        conv2 = state.get("layer1.0.conv2.weight")
        name = BOTTLENECK_NAMES.get((width, width // conv2.shape[1] if conv2 is not None else 0))
    small_input = tuple(state["conv1.weight"].shape[-2:]) == (3, 3)
    return (name.format(depth) if depth and name else None), small_input


def describe_arch(arch, small_input):
    return f"{arch}{' (small input)' if small_input else ''}"


def plain(obj, budget=None, depth=0):
    """Python values of what an inert read left of omegaconf's containers (a DictConfig's _content, a node's _val),
    dicts and lists; other placeholders kept. At most 100,000 values and 32 levels (a pickle's shared references
    would expand without end)."""
    budget = budget if budget is not None else [100_000]
    budget[0] -= 1
    if budget[0] < 0 or depth > 32:
        raise Refused("its hyper-parameters nest deeper or wider than any Lightning file's")
    if isinstance(obj, Inert):
        fields = inert_fields(obj)
        for key in ("_content", "_val"):
            if key in fields:
                return plain(fields[key], budget, depth + 1)
        return plain(obj.items, budget, depth + 1) if obj.items else obj  # a dict's subclass (AttributeDict)
    if isinstance(obj, dict):
        return {k: plain(v, budget, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v, budget, depth + 1) for v in obj]
    return obj


def find_normalize(config):
    """The first (mean, std) of three numbers each that a transform of `config` (plain values) holds, or None."""
    stack = [config]
    while stack:
        node = stack.pop(0)
        if isinstance(node, dict):
            mean, std = node.get("mean"), node.get("std")
            if all(isinstance(v, list) and len(v) == 3 and all(type(x) in (int, float) for x in v)
                   for v in (mean, std)):
                return tuple(map(float, mean)), tuple(map(float, std))
            stack += list(node.values())
        elif isinstance(node, list):
            stack += node
    return None


def _stated(obj):
    """(arch, small_input) the file itself states for its trunk, each None where it says nothing, and the
    normalisation it records: the SCE authors' hyper_parameters (trunk: name, small_input; their transforms),
    MoCo's arch, DINO's args.arch."""
    hparams = obj.get("hyper_parameters")
    if hparams is not None:
        hparams = plain(hparams)
        trunk = hparams.get("trunk") if isinstance(hparams, dict) else None
        trunk = trunk if isinstance(trunk, dict) else {}
        transforms = [hparams.get(k) for k in ("train_transform", "val_transform", "test_transform")]
        name, small = trunk.get("name"), trunk.get("small_input")
        name = name if isinstance(name, str) and re.fullmatch(r"[a-z0-9_]+", name) else None  # not "${...}"
        return name, small if isinstance(small, bool) else None, find_normalize(transforms)
    args = obj.get("args")
    arch = obj.get("arch") if isinstance(obj.get("arch"), str) else inert_fields(args).get("arch")
    return (arch if isinstance(arch, str) else None), None, None


def _trunks(obj):
    """(online state, momentum state or None, code, prefixes) of the first layout of PREFIXES / DINO_KEYS that holds
    a ResNet, or None."""
    for key in DINO_KEYS:  # DINO: {"student": ..., "teacher": ...}
        if not isinstance(obj.get(key), dict):
            break
    else:
        for prefix in DINO_BACKBONES:
            online, momentum = (strip(obj[k], prefix) for k in DINO_KEYS)
            if is_resnet(online):
                return online, momentum if is_resnet(momentum) else None, "dino", \
                    (f"student/{prefix}", f"teacher/{prefix}")
    state = obj.get("state_dict", obj.get("model", obj))
    if not isinstance(state, dict):
        return None
    for online_prefix, momentum_prefix, code in PREFIXES:
        online = strip(state, online_prefix)
        if is_resnet(online):
            momentum = strip(state, momentum_prefix)
            return online, momentum if is_resnet(momentum) else None, code, (online_prefix, momentum_prefix)
    if LIGHTNING in obj and is_resnet(strip(state, "")):  # the trunk alone, as the authors publish theirs
        return strip(state, ""), None, "lightning", ("no prefix", "")
    return None


def recognise(obj, path):
    """The file's content in our form (see the module's doc) if it is one of the layouts above, else None (ours, a
    plain state dict, or what no reader here knows)."""
    if not isinstance(obj, dict) or obj.get("kind") in ("pretrain", "lincls"):
        return None
    found = _trunks(obj)
    if found is None:
        return None
    online, momentum, code, prefixes = found
    what = WHAT[code][LIGHTNING not in obj]
    epoch = obj.get("epoch")
    if type(epoch) is int:
        what += f", epoch {epoch}"
    arch, small_input = resnet_arch(online)
    if arch is None:
        raise UserError(f"{path} ({what}) holds a ResNet of {'-'.join(map(str, blocks_per_stage(online)))} blocks "
                        "that no torchvision arch has: it cannot be evaluated here")
    stated_arch, stated_small, normalize = _stated(obj)
    if (stated_arch and stated_arch != arch) or (stated_small is not None and stated_small != small_input):
        said = describe_arch(stated_arch or arch, small_input if stated_small is None else stated_small)
        raise UserError(f"{path} ({what}) says its trunk is a {said} but its weights are those of a "
                        f"{describe_arch(arch, small_input)}: the file is inconsistent, it is not read")
    return {"kind": "foreign", "what": what, "prefixes": prefixes, "trunks": {"online": online, "momentum": momentum},
            "args": {"arch": arch, "small_input": small_input}, "normalize": normalize}
