"""sce.cli and the scripts' command lines: --help defaults and metavars, MoCo spellings, --amp, no
script importing another, the entry-point wrapper under torchrun, progress lines, the feature cache."""
import argparse
import ast
import glob
import os
import re

import numpy as np
import pytest
import torch

from conftest import REPO, run_script
from sce import cli
from sce.knn import split_features
from sce.progress import Progress, format_eta

SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "main_*.py")))


def script_parser(name):
    module = __import__(name[:-3])
    return module.get_parser() if hasattr(module, "get_parser") else module.parser


def flag_help(help_text, flag):
    """The help of `flag` in --help output, on one line."""
    m = re.search(rf"^  (?:-\w \S+, )?{re.escape(flag)}\b.*?(?=^  -|^\S|\Z)", help_text, re.M | re.S)
    assert m, f"{flag} not in --help"
    return " ".join(m.group(0).split())


def test_formatter_shows_zero_defaults_words_and_metavars():
    p = argparse.ArgumentParser(description="Title.\n\n    indented  example\nkept as written", formatter_class=cli.HelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="seed")
    p.add_argument("--wd", type=float, default=0.0, help="weight decay")
    p.add_argument("--lambda", dest="lambda_", type=float, default=0.5, help="weight")
    p.add_argument("--shots", nargs="+", default=[16, 32, "full"], help="shots")
    p.add_argument("--ratio", default="50%", help="a percent sign")
    p.add_argument("--none", default=None, help="unset")
    p.add_argument("--flag", action="store_true", help="switch")
    p.add_argument("--empty", default="", help="empty")
    p.add_argument("--listed", nargs="*", default=[], help="empty list")
    p.add_argument("--told", type=int, default=3, help="count (default: per method)")
    text = p.format_help()
    assert "    indented  example\nkept as written" in text  # the description is not re-wrapped
    assert flag_help(text, "--seed") == "--seed SEED seed (default: 0)"
    assert flag_help(text, "--wd") == "--wd WD weight decay (default: 0.0)"
    assert flag_help(text, "--lambda") == "--lambda LAMBDA weight (default: 0.5)"
    assert "(default: 16 32 full)" in flag_help(text, "--shots")
    assert "(default: 50%)" in flag_help(text, "--ratio")
    for flag in ("--none", "--flag", "--empty", "--listed"):
        assert "default" not in flag_help(text, flag), flag
    assert flag_help(text, "--told").endswith("count (default: per method)")


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_of_every_script_shows_seed_default(script):
    assert "(default: 0)" in flag_help(script_parser(script).format_help(), "--seed")


@pytest.mark.parametrize("script", ["main_lincls.py", "main_lowshot.py"])
def test_every_flag_has_a_description(script):
    p = script_parser(script)
    text = p.format_help()
    for action in p._actions:
        words = re.sub(r"\(default: [^)]*\)", "", action.help or "").strip()
        assert len(words) > 3, f"{action.option_strings} has no description"
    assert not re.search(r"\b[A-Z]+_\b|\[\d", text)  # no LAMBDA_ metavar, no Python list
    if script == "main_lincls.py":
        assert "(default: 0)" in flag_help(text, "--warmup-epochs")
        assert "(default: 0.0)" in flag_help(text, "--weight-decay")
        assert "auto:" in flag_help(text, "--resume") and "none:" in flag_help(text, "--resume")
    else:
        assert "--shots K [K ...]" in text and "(default: 16 32 64 full)" in text


def test_no_script_imports_another():
    for script in SCRIPTS:
        with open(os.path.join(REPO, script)) as f:
            tree = ast.parse(f.read())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m for m in imported if m.split(".")[0].startswith("main_")}, script


def test_moco_spellings_map_to_ours():
    import main_lincls
    import main_lowshot
    base = ["--data", "d", "--pretrained", "p"]
    p = main_lincls.get_parser()
    ours = p.parse_args(base + ["--arch", "resnet18", "--batch-size", "64", "--workers", "2", "--weight-decay",
                                "1e-4", "--sgd-momentum", "0.8", "--print-freq", "5", "--evaluate", "--lr", "0.3"])
    moco = p.parse_args(base + ["-a", "resnet18", "-b", "64", "-j", "2", "--wd", "1e-4", "--momentum", "0.8",
                                "-p", "5", "-e", "--learning-rate", "0.3"])
    assert vars(ours) == vars(moco)
    assert (ours.arch, ours.batch_size, ours.workers, ours.weight_decay, ours.sgd_momentum) == ("resnet18", 64, 2, 1e-4, 0.8)
    p = main_lowshot.get_parser()
    ours = p.parse_args(base + ["--arch", "resnet18", "--batch-size", "64", "--workers", "2"])
    moco = p.parse_args(base + ["-a", "resnet18", "-b", "64", "-j", "2"])
    assert vars(ours) == vars(moco)
    # one name per idea across the two scripts and main_pretrain.py
    lincls = {a.dest: a.option_strings for a in main_lincls.get_parser()._actions}
    assert {"weight_decay", "sgd_momentum", "amp", "output_dir"} <= set(lincls)
    assert "--weight-decay" in lincls["weight_decay"] and "--sgd-momentum" in lincls["sgd_momentum"]


@pytest.mark.parametrize("script", ["main_lincls.py", "main_lowshot.py"])
def test_amp_values_and_output_dir(script):
    p = script_parser(script)
    base = ["--data", "d", "--pretrained", "p"]
    assert p.parse_args(base).amp == "none"
    assert p.parse_args(base + ["--amp", "bf16"]).amp == "bf16"
    # the former on/off switch: autocast's own dtype for the device
    assert p.parse_args(base + ["--amp"]).amp == ("fp16" if torch.cuda.is_available() else "bf16")
    assert p.parse_args(base).output_dir == os.path.join("runs", script[5:-3])
    with cli.autocast(torch.device("cpu"), "bf16"):
        assert torch.ones(2, 2).mm(torch.ones(2, 2)).dtype == torch.bfloat16
    with cli.autocast(torch.device("cpu"), "none"):
        assert torch.ones(2, 2).mm(torch.ones(2, 2)).dtype == torch.float32


FAILING = """
import sys
sys.path.insert(0, {repo!r})
import torch.distributed as dist
from sce import UserError, cli

def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise UserError("rank one refuses: pass --fix")
    dist.barrier()  # rank 0 waits; rank 1's exit breaks it

cli.run(main)
"""


def test_user_error_under_torchrun_is_one_line_and_named_in_summary(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING.format(repo=REPO))
    proc = run_script(["torchrun", "--standalone", "--nproc_per_node", "2", str(script)], check=False)
    assert proc.returncode != 0
    assert "error: rank one refuses: pass --fix" in proc.stderr.splitlines()
    assert 'raise UserError("rank one refuses' not in proc.stderr  # no traceback of the UserError anywhere
    root = proc.stderr.split("Root Cause")[1]  # torchrun's summary: the first failure in time
    assert re.search(r"rank\s*: 1 ", root) and "error: rank one refuses: pass --fix" in root


def test_progress_lines():
    progress = Progress(100)
    assert progress.report().startswith("0/100 images") and progress.report().endswith("ETA ?")
    progress.update(40)
    assert re.fullmatch(r"40/100 images, \d+ images/s, ETA \d+:\d\d:\d\d", progress.report())
    assert format_eta(3725.9) == "1:02:05"


class Images(torch.utils.data.Dataset):
    def __init__(self, transform):
        self.x, self.transform = torch.arange(12.0).view(6, 2), transform

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] * self.transform, 0


def test_split_features_cache(tmp_path, capsys):
    trunk = torch.nn.Linear(2, 3)
    ckpt = tmp_path / "trunk.pth"
    torch.save(trunk.state_dict(), ckpt)
    device = torch.device("cpu")

    def feats(transform=1.0, **kw):
        x = split_features(trunk, Images(transform), "train", str(tmp_path), device, checkpoint=str(ckpt),
                               batch_size=4, **kw)
        return x, capsys.readouterr().out

    first, out = feats(arch="a")
    assert np.allclose(first, trunk(Images(1.0).x).detach().numpy(), atol=1e-6) and "6/6 images" in out
    again, out = feats(arch="a")
    assert "features read from" in out and np.array_equal(again, first)
    for changed in [dict(transform=2.0, arch="a"), dict(arch="b"), dict(arch="a", amp_dtype=torch.bfloat16)]:
        assert "features read from" not in feats(**changed)[1], changed
    os.utime(ckpt, ns=(0, 0))  # another checkpoint file at the same path
    assert "features read from" not in feats(arch="a")[1]
    cache = [f for f in os.listdir(tmp_path) if f.startswith("features_train_")]
    assert len(cache) == 5


FLOORS = [["builder", "losses", "optim", "checkpoint", "distributed", "preemption", "compiling", "progress", "metrics",
           "outdir"],
          ["datasets", "loader", "augment", "device_decode", "device_augment", "preload"],
          ["engine", "epoch", "resume", "knn", "evaldata", "transfer", "preview", "cli"]]


def test_sce_modules_import_only_from_their_floor_or_below():
    """The README's layout: primitives, data path, orchestration; no module imports a floor above its own, and
    within a floor imports form no cycle."""
    floor = {m: i for i, names in enumerate(FLOORS) for m in names}
    modules = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "sce", "*.py")))
    assert set(modules) - {"__init__"} == set(floor), "a module of sce/ is missing from the README's floors"
    imports = {}
    for m in floor:
        tree = ast.parse(open(os.path.join(REPO, "sce", f"{m}.py")).read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "sce":
                found |= {a.name for a in node.names if a.name in floor}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sce."):
                found.add(node.module.split(".")[1])
        imports[m] = found - {m}
        above = [d for d in imports[m] if floor[d] > floor[m]]
        assert not above, f"sce/{m}.py imports {above} from a floor above its own"

    def reach(m, seen=()):
        assert m not in seen, "import cycle: " + " -> ".join(seen + (m,))
        for d in imports[m]:
            reach(d, seen + (m,))
    for m in floor:
        reach(m)
