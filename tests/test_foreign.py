"""Other codes' checkpoints (the SCE authors' Lightning files, MoCo, DINO-style, solo-learn) read without running
their code, and ours written in the SCE authors' format."""
import argparse
import collections
import os
import sys
import types
import typing
import zipfile

import pytest
import torch
import torchvision
from conftest import exit_message, write_imagefolder
from test_errors import as_user_runs

import main_lincls
import main_lowshot
from sce import UserError
from sce.checkpoint import check_trunk, load, load_trunk, read_as, trunk_spec

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)  # eztorch/transforms/utils.py
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CALLS = []  # what a stand-in of omegaconf's classes would record if a reader built one


class _Config:
    """What omegaconf's containers pickle: protocol 2's NEWOBJ then BUILD of their __dict__ (basecontainer.py's
    __getstate__): _metadata, _parent, _content (DictConfig) or _val (a node)."""

    def __getstate__(self):
        return dict(self.__dict__)

    def __setstate__(self, state):
        CALLS.append(type(self).__name__)


def _stand_ins():
    """Modules omegaconf.dictconfig, .base and .nodes holding stand-ins of DictConfig, ContainerMetadata, Metadata
    and AnyNode, under their names (pickle writes a class by its module and name)."""
    made = {}
    for module, names in [("omegaconf.dictconfig", ["DictConfig"]), ("omegaconf.base", ["ContainerMetadata",
                                                                                          "Metadata"]),
                          ("omegaconf.nodes", ["AnyNode"])]:
        mod = types.ModuleType(module)
        for name in names:
            cls = type(name, (_Config,), {"__module__": module, "__qualname__": name})
            setattr(mod, name, cls)
            made[name] = cls
        sys.modules[module] = mod
    sys.modules["omegaconf"] = types.ModuleType("omegaconf")
    return made


def _config(classes, values, parent=None):
    """A DictConfig stand-in of `values` (nested dicts become DictConfigs), its nodes AnyNodes, as OmegaConf.create
    makes them: metadata with typing.Any and a collections.defaultdict resolver cache."""
    cfg = classes["DictConfig"]()
    meta = classes["ContainerMetadata"]()
    meta.__dict__.update(ref_type=typing.Any, object_type=dict, optional=True, key=None, flags={}, flags_root=False,
                         resolver_cache=collections.defaultdict(dict), key_type=typing.Any, element_type=typing.Any)
    content = {}
    for key, value in values.items():
        if isinstance(value, dict):
            content[key] = _config(classes, value, cfg)
        else:
            node = classes["AnyNode"]()
            node_meta = classes["Metadata"]()
            node_meta.__dict__.update(ref_type=typing.Any, object_type=None, optional=True, key=key, flags=None)
            node.__dict__.update(_metadata=node_meta, _parent=cfg, _val=value)
            content[key] = node
    cfg.__dict__.update(_metadata=meta, _parent=parent, _content=content)
    return cfg


def authors_trunk(arch, small_input):
    """eztorch.models.trunks.create_resnet(name, num_classes=0, small_input): torchvision's ResNet, fc an
    Identity, a small input's conv1 3x3 stride 1 and no max-pool."""
    trunk = getattr(torchvision.models, arch)(weights=None)
    trunk.fc = torch.nn.Identity()
    if small_input:
        trunk.conv1 = torch.nn.Conv2d(3, trunk.conv1.out_channels, 3, 1, 1, bias=False)
        trunk.maxpool = torch.nn.Identity()
    return trunk


def write_authors_checkpoint(path, arch="resnet18", small_input=True, stated=None, cuda=False, seed=0, twins=False):
    """A file as the SCE authors' run/pretrain.py and Lightning 1.7.7's ModelCheckpoint write it: its top-level keys,
    the weights under state_dict (trunk., momentum_trunk., projector., momentum_projector., predictor., queue,
    queue_ptr), hyper_parameters holding omegaconf DictConfigs (the trunk's name and small_input, the transforms'
    CIFAR-10 normalisation); `cuda`: its storages tagged as a GPU run's. Returns (online trunk, momentum trunk).
    stated: the trunk settings it says, if not those of its weights; twins: the momentum trunk the online one (a
    file half the size)."""
    torch.manual_seed(seed)
    online = authors_trunk(arch, small_input)
    momentum = online if twins else authors_trunk(arch, small_input)
    for trunk in {online, momentum}:  # BN statistics that are not the defaults
        for m in trunk.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    state = collections.OrderedDict()
    state.update({f"trunk.{k}": v for k, v in online.state_dict().items()})
    state.update({f"momentum_trunk.{k}": v for k, v in momentum.state_dict().items()})
    for head in ("projector", "momentum_projector", "predictor"):
        state[f"{head}.layers.0.weight"] = torch.randn(16, 512)
    state["queue"], state["queue_ptr"] = torch.randn(16, 32), torch.zeros(1, dtype=torch.long)
    classes = _stand_ins()
    try:
        trunk_cfg = dict({"_target_": "eztorch.models.trunks.create_resnet", "name": arch, "num_classes": 0,
                          "small_input": small_input}, **(stated or {}))
        normalize = {"_target_": "eztorch.transforms.Normalize", "mean": list(CIFAR_MEAN), "std": list(CIFAR_STD)}
        hparams = {"trunk": _config(classes, trunk_cfg),
                   "optimizer": _config(classes, {"name": "sgd", "initial_lr": 0.06}),
                   "train_transform": _config(classes, {"_target_": "Compose", "transforms": {"0": normalize}}),
                   "normalize_outputs": True, "num_global_crops": 2}
        ckpt = {"epoch": 199, "global_step": 39000, "pytorch-lightning_version": "1.7.7", "state_dict": state,
                "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"current": {"completed": 199}}}},
                "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": "", "dirpath": "/x"}},
                "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.06, "params": [0]}]}],
                "lr_schedulers": [{"last_epoch": 199}], "hparams_name": "kwargs", "hyper_parameters": hparams}
        tag = torch.serialization.location_tag
        if cuda:
            torch.serialization.location_tag = lambda storage: "cuda:0"
        try:
            torch.save(ckpt, path)
        finally:
            torch.serialization.location_tag = tag
    finally:
        for name in [m for m in sys.modules if m == "omegaconf" or m.startswith("omegaconf.")]:
            del sys.modules[name]
    return online.eval(), momentum.eval()


def normalized(x, mean, std):
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


class Imports:
    """A finder on sys.meta_path recording the imports asked for (omegaconf's, were a reader to import it)."""

    def __init__(self):
        self.asked = []

    def find_spec(self, name, path=None, target=None):
        self.asked.append(name)
        return None


@pytest.fixture
def imports():
    finder = Imports()
    sys.meta_path.insert(0, finder)
    CALLS.clear()
    yield finder
    sys.meta_path.remove(finder)


def test_the_authors_lightning_checkpoint_reads_as_their_trunk(tmp_path, imports, capsys):
    """A small-input ResNet-18 file of the authors' code: read with nothing of omegaconf imported or built, on the
    CPU whatever device saved it (its storages a GPU's); the online trunk (the momentum one with --encoder
    momentum) gives the features of their own trunk built from the same weights, fed the CIFAR-10 normalisation
    their file records (ours feeds ImageNet's: the trunk re-normalises); one line says what was read."""
    path = tmp_path / "epoch=199.ckpt"
    online, momentum = write_authors_checkpoint(path, cuda=True)
    assert check_trunk(str(path)) == ("resnet18", True, {"arch": "resnet18", "small_input": True})
    x = torch.rand(2, 3, 8, 8)
    for encoder, theirs in (("online", online), ("momentum", momentum)):
        trunk, feat_dim, _ = load_trunk(str(path), encoder=encoder)
        trunk.eval()
        with torch.no_grad():
            ours = trunk(normalized(x, IMAGENET_MEAN, IMAGENET_STD))
            expected = theirs(normalized(x, CIFAR_MEAN, CIFAR_STD))
        assert feat_dim == 512 and (ours - expected).abs().max() < 1e-4, (ours - expected).abs().max()
        prefix = "trunk." if encoder == "online" else "momentum_trunk."
        assert f"=> {path}: the SCE authors' Lightning checkpoint, epoch 199, resnet18 (small input), {encoder} " \
               f"trunk ({prefix})" in capsys.readouterr().out
    assert not CALLS and not [n for n in imports.asked if n.startswith("omegaconf")]


class RunsCode:
    """Unpickled, calls `call(*args)`: what a crafted checkpoint carries."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


@pytest.fixture(scope="module")
def r18():
    """A small-input ResNet-18's state dict (torchvision names), BN statistics not the defaults."""
    torch.manual_seed(0)
    state = authors_trunk("resnet18", True).state_dict()
    for k, v in state.items():
        if k.endswith("running_mean"):
            v.uniform_(-0.1, 0.1)
    return state


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path, r18):
    """A checkpoint whose pickle would call os.system: one line naming the call, nothing run, no output folder."""
    marker, out = tmp_path / "marker", tmp_path / "o"
    torch.save({"state_dict": {f"trunk.{k}": v for k, v in r18.items()}, "hyper_parameters": {
        "trunk": RunsCode(os.system, f"touch {marker}")}}, tmp_path / "crafted.ckpt")
    data = write_imagefolder(tmp_path / "data", 2, 2, 8)
    message = as_user_runs(main_lincls.main, ["--data", data, "--pretrained", str(tmp_path / "crafted.ckpt"),
                                              "--knn", "--output-dir", str(out)])
    assert message == (f"error: {tmp_path / 'crafted.ckpt'} is not read: it would call {os.system.__module__}.system "
                       "(a pickle that runs code; nothing was run)"), message
    assert not marker.exists() and not out.exists()


def rewritten(path, name_end, data=None, stated=None):
    """The zip at `path` with its record ending `name_end` given `data`, its directory stating `stated` bytes."""
    import struct
    import zipfile
    with zipfile.ZipFile(path) as z:
        records = {n: z.read(n) for n in z.namelist()}
    name = next(n for n in records if n.endswith(name_end))
    records[name] = data if data is not None else records[name]
    with zipfile.ZipFile(path, "w") as z:
        for n, d in records.items():
            z.writestr(n, d)
    raw = bytearray(path.read_bytes())
    entry = raw.index(b"PK\x01\x02")  # the central directory's entries, to `name`'s
    while raw[entry + 46:entry + 46 + len(name)] != name.encode():
        entry = raw.index(b"PK\x01\x02", entry + 4)
    raw[entry + 24:entry + 28] = struct.pack("<I", stated if stated is not None else len(records[name]))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("crafted,refused", [
    ("expanded", "a tensor of it has more elements than its storage (28991029248 of 27)"),
    ("retyped", "it would change how torch's storages are typed (nothing was built)"),
    ("short", "its storage 0 holds 4 bytes, not its 1728 elements")])
def test_a_zip_that_outgrows_its_storages_is_refused(tmp_path, r18, crafted, refused):
    """A stride-0 view of 2**30 copies of conv1's first filter; BUILD on the torch.FloatStorage every file's
    storages share (its dtype of itemsize 0: every size passes); a record its zip states longer than it is: each a
    line, nothing read past its storage."""
    state = {f"trunk.{k}": v for k, v in r18.items()}
    if crafted == "expanded":
        state["trunk.conv1.weight"] = state["trunk.conv1.weight"][:1].clone().expand(2 ** 30, 3, 3, 3)
    path = tmp_path / "crafted.ckpt"
    torch.save({"state_dict": state}, path)
    if crafted == "retyped":
        with zipfile.ZipFile(path) as z:
            pickled = z.read("crafted/data.pkl")
        retype = b"ctorch\nFloatStorage\n}X\x05\x00\x00\x00dtypeK\x00sb0"  # BUILD, then POP
        rewritten(path, "/data.pkl", pickled[:2] + retype + pickled[2:])
    if crafted == "short":
        rewritten(path, "/data/0", b"\0" * 4, stated=len(r18["conv1.weight"].numpy().tobytes()))
    with pytest.raises(UserError) as info:
        load(str(path))
    assert str(info.value) == f"{path} is not read: {refused}"


def test_a_small_input_trunk_of_no_known_size_is_refused_before_any_folder(tmp_path, imports):
    """The authors' CIFAR trunk on an ImageFolder (main_lincls.py) or VOC07 (main_lowshot.py), no --crop-size: one
    line naming --crop-size, the output folder not made (the file read first). A file whose stated trunk settings
    contradict its weights is refused."""
    path = tmp_path / "epoch=199.ckpt"
    write_authors_checkpoint(path)
    data = write_imagefolder(tmp_path / "data", 2, 2, 8)
    for main in (main_lincls.main, main_lowshot.main):
        message = as_user_runs(main, ["--data", data, "--pretrained", str(path), "--output-dir", str(tmp_path / "o")])
        assert message.startswith("error: a small-input trunk whose file records no crop size, on --dataset ") and \
            "pass --crop-size" in message, message
        assert not (tmp_path / "o").exists()
    # a file whose hyper_parameters' trunk contradicts its weights: refused, not guessed
    write_authors_checkpoint(path, stated={"small_input": False})
    with pytest.raises(UserError, match=r"\(the SCE authors' Lightning checkpoint, epoch 199\) says its trunk is a "
                                        r"resnet18 but its weights are those of a resnet18 \(small input\)"):
        check_trunk(str(path))
    assert not CALLS and not [n for n in imports.asked if n.startswith("omegaconf")]


def test_other_codes_checkpoints_give_their_trunks(tmp_path, r18):
    """MoCo v2 / v3, DINO-style (student / teacher, an argparse.Namespace of args) and solo-learn files holding a
    ResNet: their online and momentum trunks read, arch and stem from the weights, each prefix named in its line;
    an arch the file states otherwise is refused."""
    other = dict(r18, **{"conv1.weight": r18["conv1.weight"] + 1})  # the momentum trunk: its own conv1
    head = {"fc.0.weight": torch.zeros(4, 512), "fc.2.weight": torch.zeros(2, 4)}

    def under(prefix, state):
        return {f"{prefix}{k}": v for k, v in {**state, **head}.items()}
    layouts = [
        ({"epoch": 200, "arch": "resnet18", "state_dict": {**under("module.encoder_q.", r18),
                                                           **under("module.encoder_k.", other)}},
         "module.encoder_q.", "module.encoder_k."),
        ({"epoch": 300, "arch": "resnet18", "state_dict": {**under("module.base_encoder.", r18),
                                                           **under("module.momentum_encoder.", other)}},
         "module.base_encoder.", "module.momentum_encoder."),
        ({"student": under("backbone.", r18), "teacher": under("backbone.", other), "epoch": 100,
          "args": argparse.Namespace(arch="resnet18")}, "student/backbone.", "teacher/backbone."),
        ({"student": under("module.backbone.", r18), "teacher": under("module.backbone.", other)},
         "student/module.backbone.", "teacher/module.backbone."),
        ({"pytorch-lightning_version": "2.0.0", "epoch": 999, "state_dict": {
            **under("backbone.", r18), **under("momentum_backbone.", other)}}, "backbone.", "momentum_backbone.")]
    path = str(tmp_path / "other.pth")
    for ckpt, online, momentum in layouts:
        torch.save(ckpt, path)
        assert check_trunk(path)[:2] == ("resnet18", True)
        read = load(path)
        for encoder, prefix, state in (("online", online, r18), ("momentum", momentum, other)):
            found = trunk_spec(read, path, encoder=encoder)[0]
            assert found.keys() == state.keys() and all(torch.equal(v, state[k]) for k, v in found.items())
            assert read_as(read, path, encoder).endswith(f"resnet18 (small input), {encoder} trunk ({prefix})")
        if "arch" in ckpt or "args" in ckpt:
            ckpt["arch" if "arch" in ckpt else "args"] = "resnet50" if "arch" in ckpt else argparse.Namespace(
                arch="resnet50")
            torch.save(ckpt, path)
            with pytest.raises(UserError, match=r"says its trunk is a resnet50 \(small input\) but its weights are "
                                                r"those of a resnet18 \(small input\): the file is inconsistent"):
                check_trunk(path)
    # a Lightning file holding the trunk alone under torchvision's names (hyper-parameters no weights-only load reads)
    torch.save({"pytorch-lightning_version": "1.7.7", "state_dict": r18, "hyper_parameters": {
        "args": argparse.Namespace(lr=1)}}, path)
    read = load(path)
    assert trunk_spec(read, path)[0].keys() == r18.keys()
    assert read_as(read, path, "online").endswith("a Lightning checkpoint of a torchvision ResNet, resnet18 (small "
                                                  "input), online trunk (no prefix)")
    with pytest.raises(UserError, match="holds no momentum trunk: evaluate its online trunk"):
        trunk_spec(read, path, encoder="momentum")


def their_linear_evaluation_trunk(path, arch, small_input):
    """The trunk the SCE authors' linear evaluation builds from `path` (eztorch's LinearClassifierEvaluation):
    torch.load, the state dict's keys matching ^(trunk\\.) with it removed, loaded strictly into create_resnet's trunk
    (a weights-only load, torch's default since 2.6)."""
    import re
    model = torch.load(path, map_location="cpu", weights_only=True)
    state = model["state_dict"] if "state_dict" in model else model
    state = {re.sub(r"^(trunk\.)", "", k): v for k, v in state.items() if re.match(r"^(trunk\.)", k)}
    trunk = authors_trunk(arch, small_input)
    trunk.load_state_dict(state)
    return trunk.eval()


def test_ours_in_their_format_is_read_by_their_linear_evaluation(pretrained, tmp_path, capsys):
    """convert-pretrain-to-eztorch.py on a small-input main_pretrain.py checkpoint: their loader builds the trunk
    ours reads (the same features), and ours reads the file back as a checkpoint in their format."""
    out = tmp_path / "sce_r18_eztorch.ckpt"
    assert exit_message("detection/convert-pretrain-to-eztorch.py", pretrained, out) is None
    assert f"trunk to {out} (state_dict trunk.*, the SCE authors' format)" in capsys.readouterr().out
    theirs = their_linear_evaluation_trunk(out, "resnet18", True)
    ours = load_trunk(pretrained)[0].eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
    assert check_trunk(str(out))[:2] == ("resnet18", True)
    load_trunk(str(out))
    assert "a checkpoint in the SCE authors' format, epoch 1, resnet18 (small input), online trunk (trunk.)" in \
        capsys.readouterr().out


def test_the_authors_file_through_every_entry_point(tmp_path, capsys, imports):
    """Their CIFAR-10 trunk: main_lincls.py --knn on CIFAR-10's batches reads it, its line first; their ResNet-50
    ImageNet file converted for detectron2 gives their trunk's weights under detectron2's names; the small-input one
    is refused by the converter in one line."""
    import pickle
    from conftest import write_cifar
    small, r50 = tmp_path / "cifar.ckpt", tmp_path / "imagenet.ckpt"
    write_authors_checkpoint(small)
    write_cifar(tmp_path / "cifar", per_batch=2)
    assert as_user_runs(main_lincls.main, ["--data", str(tmp_path / "cifar"), "--dataset", "cifar10", "--pretrained",
                                           str(small), "--knn", "--knn-k", "3", "--workers", "0", "--output-dir",
                                           str(tmp_path / "o")]) is None
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"=> {small}: the SCE authors' Lightning checkpoint, epoch 199, resnet18 (small input), " \
                       "online trunk (trunk.)", lines
    assert "input 32 px (the native size of cifar10)" in "\n".join(lines)
    online, _ = write_authors_checkpoint(r50, "resnet50", False, twins=True)
    assert exit_message("detection/convert-pretrain-to-detectron2.py", r50, tmp_path / "r50.pkl") is None
    with open(tmp_path / "r50.pkl", "rb") as f:
        model = pickle.load(f)["model"]
    assert (model["res5.2.conv3.norm.running_mean"] == online.state_dict()["layer4.2.bn3.running_mean"].numpy()).all()
    assert exit_message("detection/convert-pretrain-to-detectron2.py", small, tmp_path / "s.pkl").startswith(
        f"error: {small} holds a small-input trunk (conv1 3x3")
    assert not CALLS and not [n for n in imports.asked if n.startswith("omegaconf")]


def test_a_legacy_checkpoint_whose_keys_expand_is_refused_before_torch_load(tmp_path):
    """torch's legacy format (pickles one after another) goes to torch.load: a dict key of 60 tuples each of two
    references to the one before (2**60 items to hash) is refused by the scan first, in one line, at once."""
    import faulthandler
    import pickle
    import time
    bomb = b")"
    for k in range(60):
        bomb += b"q" + bytes([k]) + b"h" + bytes([k]) + b"\x86"
    legacy = pickle.dumps(0x1950A86A20F9469CFC6C, 2) + pickle.dumps(1001, 2) + pickle.dumps({}, 2)
    (tmp_path / "old.pth").write_bytes(legacy + b"\x80\x02}" + bomb + b"K\x01s.")
    start = time.perf_counter()
    faulthandler.dump_traceback_later(60, exit=True)  # a hash inside the C unpickler never returns to Python
    with pytest.raises(UserError, match=r"old.pth is not read: its tuples, their shared references expanded, would "
                                        r"hold more than 4,000,000 items"):
        load(str(tmp_path / "old.pth"))
    faulthandler.cancel_dump_traceback_later()
    assert time.perf_counter() - start < 5
