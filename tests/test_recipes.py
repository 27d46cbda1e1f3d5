"""Every command of RECIPES.md parses through main_pretrain.py's parser and is a valid setting."""
import os
import re
import shlex
import sys

import pytest
import torch

from conftest import REPO
import main_pretrain
from sce.layouts import DATASETS

sys.path.insert(0, os.path.join(REPO, "benchmarks", "reproduction"))
import reproduce_tools  # noqa: E402


def recipe_commands():
    """Expand the shell variables and one-line for-loops of the ```bash blocks into argv lists."""
    text = open(os.path.join(REPO, "RECIPES.md")).read()
    commands, variables = [], {}
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.strip().splitlines():
            assign = re.fullmatch(r'(\w+)="(.*)"', line)
            if assign:
                variables[assign[1]] = assign[2]
                continue
            loop = re.fullmatch(r"for (\w+) in (.*?); do (.*); done", line)
            values, body = (shlex.split(loop[2]), loop[3]) if loop else ([None], line)
            for value in values:
                expanded = body.replace(f"${loop[1]}", value) if loop else body
                for name, val in variables.items():
                    expanded = expanded.replace(f"${name}", val)
                argv = shlex.split(expanded)
                commands.append(argv[argv.index("main_pretrain.py") + 1:])
    assert commands, "no commands found in RECIPES.md"
    return commands


COMMANDS = recipe_commands()


def test_recipes_cover_the_paper():
    """Every dataset of the baselines table (reproduce_tools.py's PAPER, what reproduce.sh runs) has its line here,
    at the row's crop (its native size); reproduce_tools.py reads these lines as this test does."""
    assert len(COMMANDS) >= 4 + 1 + 11 + 10 + 8 + 16 + 3 + 5 + 1
    datasets = {c[c.index("--dataset") + 1] for c in COMMANDS if "--dataset" in c}
    table = list(reproduce_tools.PAPER["sce"][1])
    assert datasets == {"cifar10", "cifar100", "stl10", "tiny-imagenet", "imagenet100"} == {*table, "imagenet100"}
    for name in table:
        line = next(c for c in COMMANDS if f"--dataset {name} " in " ".join(c))
        args = main_pretrain.parse_args(line)
        assert args.crop_size == DATASETS[name].native_size, name
        flags = reproduce_tools.recipe_flags(name)
        given = ["--data", args.data, "--dataset", name, "--output-dir", args.output_dir]
        assert main_pretrain.parse_args(flags + given) == main_pretrain.parse_args(line), name


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c)[-60:] for c in COMMANDS])
def test_recipe_parses(argv, monkeypatch):
    monkeypatch.setattr(main_pretrain.cli.du, "device_memory", lambda device: 80 * 2 ** 30)  # each fits an H100
    args = main_pretrain.parse_args(argv)
    one_gpu = "--small-input" in argv  # the small datasets' runs; the others on 8 GPUs or more
    main_pretrain.check_args(args, 1 if one_gpu else 8, torch.device("cuda"))  # the script's own checks
    keys_per_step = args.batch_size * (2 if args.symmetric else 1)
    assert args.queue_size % keys_per_step == 0
    assert args.tau_m <= args.tau or args.loss == "infonce"
    if "--symmetric" in argv and "--pred-hidden-dims" in argv:  # the state-of-the-art rows: the authors' configs
        assert args.optimizer == "lars" and args.batch_size == 4096 and args.warmup_epochs == 10
        assert args.sync_bn and args.proj_last_bn == "no-affine"
    if "--small-input" in argv:  # the paper's 2 GPUs of 128 on one: every BN layer split in 2, the keys shuffled
        assert args.shuffle_bn and args.split_bn == "all" and args.bn_splits == 2 and args.batch_size == 256


def test_readme_setup_commands_leave_the_interpreter_every_later_command_uses():
    """The README's first two lines, run in a fresh shell, are what its later `python ...` commands need: the
    virtualenv they install into is active afterwards (a bare `python` then has torch)."""
    lines = open(os.path.join(REPO, "README.md")).read().splitlines()
    setup = [line.strip() for line in lines[1:5] if line.startswith("    ")]
    assert len(setup) == 2, setup
    for command in setup:
        steps = [step.strip() for step in command.split("&&")]
        assert steps[:3] == ["python3 -m venv .venv", ". .venv/bin/activate", "pip install -r requirements.txt"], steps
        assert steps[3].startswith("python "), steps
