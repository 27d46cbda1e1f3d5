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

from conftest import REPO
from sce import cli
from sce.frozen import Frozen, split_features
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
    p = argparse.ArgumentParser(description="Title.\n\n    indented  example\nkept as written",
                                formatter_class=cli.HelpFormatter)
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


@pytest.mark.parametrize("script", SCRIPTS)
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
    elif script == "main_lowshot.py":
        assert "--shots K [K ...]" in text and "(default: 16 32 64 full)" in text
    else:  # each method's defaults, from its record; its own flags in a group of their own
        from sce import cli, losses  # the records' values, not a copy of them
        assert flag_help(text, "--tau").endswith(f"(default: the method's: {cli.per_method(lambda m: m.tau)})")
        assert flag_help(text, "--target-aug").endswith(f"(default: the method's: "
                                                        f"{cli.per_method(lambda m: m.views.target)})")
        assert set(losses.METHODS) == {"sce", "moco", "ressl"} and "moco 0.2" in flag_help(text, "--tau")
        assert "moco: MoCo v2's InfoNCE, eq. 1" in flag_help(text, "--method")
        assert text.index("\n--method sce:\n") < text.index("  --mask-positive") < text.index("\noptimisation:")


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
    ours = (ours.arch, ours.batch_size, ours.workers, ours.weight_decay, ours.sgd_momentum)
    assert ours == ("resnet18", 64, 2, 1e-4, 0.8)
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






def test_progress_lines():
    progress = Progress(100)
    assert progress.report().startswith("0/100 images") and progress.report().endswith("ETA ?")
    progress.update(40)
    assert re.fullmatch(r"40/100 images, \d+ images/s, ETA \d+:\d\d:\d\d", progress.report())
    assert format_eta(3725.9) == "1:02:05"


class Split:
    """An sce.data.EvalSplit's face, as split_features reads it: six 2-d 'images' times `transform`."""

    def __init__(self, transform):
        self.x, self.transform = torch.arange(12.0).view(6, 2), transform

    def __len__(self):
        return len(self.x)

    def describe(self):
        return f"loader x{self.transform}"

    def batches(self, batch_size):
        class Batches(list):
            sampler = range(len(self.x))
        return Batches((x * self.transform, torch.zeros(len(x))) for x in self.x.split(batch_size))


def test_split_features_cache(tmp_path, capsys):
    trunk = torch.nn.Linear(2, 3)
    ckpt = tmp_path / "trunk.pth"
    torch.save(trunk.state_dict(), ckpt)
    frozen = Frozen(trunk, 3, {}, "linear", False)

    def feats(transform=1.0, **kw):
        x = split_features(frozen, Split(transform), "train", str(tmp_path), checkpoint=str(ckpt), batch_size=4, **kw)
        return x, capsys.readouterr().out

    first, out = feats(arch="a")
    assert np.allclose(first, trunk(Split(1.0).x).detach().numpy(), atol=1e-6) and "6/6 images" in out
    again, out = feats(arch="a")
    assert "features read from" in out and np.array_equal(again, first)
    for changed in [dict(transform=2.0, arch="a"), dict(arch="b"), dict(arch="a", amp_dtype=torch.bfloat16)]:
        assert "features read from" not in feats(**changed)[1], changed
    os.utime(ckpt, ns=(0, 0))  # another checkpoint file at the same path
    assert "features read from" not in feats(arch="a")[1]
    cache = [f for f in os.listdir(tmp_path) if f.startswith("features_train_")]
    assert len(cache) == 5


# the floors of the package: the primitives, then the data path (one package, its face sce/data/__init__.py), then
# what the scripts orchestrate with; a module imports only from its floor or below, the data path only from the
# primitives, and no module outside sce/data from the data path (the scripts import its face)
PRIMITIVES = ["__init__", "builder", "losses", "optim", "checkpoint", "distributed", "preemption", "compiling",
              "cuda_graph", "progress", "metrics", "outdir", "timing", "layouts", "entry", "events", "recipes",
              "unpickling", "torchzip", "foreign"]
ORCHESTRATION = ["step", "epoch", "tally", "resume", "knn", "frozen", "probe", "transfer", "cli", "plot", "settings"]
MAX_DEPTH = 6  # the longest chain of project imports, files counted, scripts included


def project_imports(path):
    """The project files `path` imports: sce/X.py, sce/data/Y.py, sce/data/__init__.py, sce/__init__.py."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "sce":
            parts = node.module.split(".")
            for alias in node.names:  # `from sce import data` is sce/data; `from sce import UserError` sce/__init__
                target = os.path.join(REPO, *parts, alias.name)
                names.append(target if os.path.isdir(target) or os.path.isfile(target + ".py") else None)
            if not any(names):
                names = [os.path.join(REPO, *parts)]
        elif isinstance(node, ast.Import):
            names = [os.path.join(REPO, *a.name.split(".")) for a in node.names if a.name.split(".")[0] == "sce"]
        for name in filter(None, names):
            found.add(os.path.join(name, "__init__.py") if os.path.isdir(name) else name + ".py")
    return found


def test_the_layers_and_the_import_depth():
    files = ([os.path.join(REPO, s) for s in SCRIPTS] + glob.glob(os.path.join(REPO, "sce", "*.py"))
             + glob.glob(os.path.join(REPO, "sce", "data", "*.py")))
    graph = {f: project_imports(f) for f in files}
    modules = {os.path.basename(f)[:-3] for f in glob.glob(os.path.join(REPO, "sce", "*.py"))}
    assert modules == set(PRIMITIVES + ORCHESTRATION), "a module of sce/ is missing from the floors"
    data = os.path.join(REPO, "sce", "data")

    def floor(f):
        name = os.path.relpath(f, REPO)
        return (0 if name[4:-3] in PRIMITIVES else 1 if name.startswith("sce/data/") else
                2 if name[4:-3] in ORCHESTRATION else 3)
    for f, targets in graph.items():
        for t in targets:
            where = os.path.relpath(f, REPO)
            assert floor(t) <= floor(f) or floor(f) == 3, f"{where} imports {os.path.relpath(t, REPO)}, a floor above"
            assert floor(f) != 2 or floor(t) != 1, f"{where} imports the data path: the scripts hand it over"
            if not f.startswith(data) and t.startswith(data):
                assert t == os.path.join(data, "__init__.py"), f"{where} reaches into {os.path.relpath(t, REPO)}"

    def depth(f, seen=()):
        assert f not in seen, "import cycle: " + " -> ".join(os.path.relpath(s, REPO) for s in seen + (f,))
        return 1 + max((depth(t, seen + (f,)) for t in graph.get(f, ())), default=0)
    deepest = max(depth(os.path.join(REPO, s)) for s in SCRIPTS)
    assert deepest <= MAX_DEPTH, f"a chain of {deepest} files"


def test_the_scripts_read_as_flows():
    """Each main_*.py reads top to bottom: main_pretrain.py within 380 lines, no function of a script over 65 (their
    input checks live in sce/cli.py: check_pretrain, PRETRAIN_RULES)."""
    import ast
    assert len(open(os.path.join(REPO, "main_pretrain.py")).read().splitlines()) <= 380
    for script in SCRIPTS:
        for node in ast.walk(ast.parse(open(os.path.join(REPO, script)).read())):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno + 1 <= 65, (script, node.name)


def project_sources():
    """The scripts', sce/'s, the benchmarks' and detection/'s Python files (the tests aside)."""
    return sorted(p for pattern in ("*.py", "sce/**/*.py", "benchmarks/**/*.py", "detection/**/*.py")
                  for p in glob.glob(os.path.join(REPO, pattern), recursive=True))


def test_no_call_passes_more_than_6_positional_arguments():
    """Past 6, arguments go by keyword (keyword-only parameters): a call cannot swap two of them silently. Calls of a
    variadic function (one defined with *args here, or a call that unpacks *args) aside."""
    trees = {path: ast.parse(open(path).read()) for path in project_sources()}
    variadic = {node.name for tree in trees.values() for node in ast.walk(tree)
                if isinstance(node, ast.FunctionDef) and node.args.vararg}
    long = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if len(node.args) > 6 and name not in variadic:
                long.append(f"{os.path.relpath(path, REPO)}:{node.lineno} {ast.unparse(node.func)}")
    assert not long, long


def test_one_name_for_one_thing():
    """A function or class of sce/ or the scripts is defined in one module only (the scripts' main and get_parser
    aside, and the older names below)."""
    known = {"main", "get_parser", "Samples", "run", "save", "_tensors"}
    where = {}
    for path in [os.path.join(REPO, s) for s in SCRIPTS] + glob.glob(os.path.join(REPO, "sce", "**", "*.py"),
                                                                        recursive=True):
        for node in ast.parse(open(path).read()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name not in known:
                where.setdefault(node.name, []).append(os.path.relpath(path, REPO))
    assert not {name: paths for name, paths in where.items() if len(paths) > 1}
    assert len(open(os.path.join(REPO, "sce", "epoch.py")).read().splitlines()) <= 300
