"""Every command of RECIPES.md parses through main_pretrain.py's parser and is a valid setting."""
import os
import re
import shlex

import pytest

from conftest import REPO
import main_pretrain


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
    assert len(COMMANDS) >= 4 + 1 + 11 + 10 + 8 + 16 + 3 + 5 + 1
    datasets = {c[c.index("--dataset") + 1] for c in COMMANDS if "--dataset" in c}
    assert datasets == {"cifar10", "cifar100", "stl10", "tiny-imagenet", "imagenet100"}


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c)[-60:] for c in COMMANDS])
def test_recipe_parses(argv):
    args = main_pretrain.parse_args(argv)
    keys_per_step = args.batch_size * (2 if args.symmetric else 1)
    assert args.queue_size % keys_per_step == 0
    assert args.tau_m <= args.tau or args.loss == "infonce"
    if "--symmetric" in argv and "--pred-hidden-dims" in argv:  # the state-of-the-art rows: the authors' configs
        assert args.optimizer == "lars" and args.batch_size == 4096 and args.warmup_epochs == 10
        assert args.sync_bn and args.proj_last_bn == "no-affine"
    if "--small-input" in argv:  # one GPU, shuffle-BN as a split BN of 8 groups that divide the batch
        assert args.shuffle_bn and args.bn_splits == 8 and args.batch_size % 8 == 0


def reproduction_settings():
    """The pretraining flags of benchmarks/reproduce_cifar10.sh per method, as the script builds them
    (its PRETRAIN, then SMOKE's additions, then the method's FLAGS)."""
    text = open(os.path.join(REPO, "benchmarks", "reproduce_cifar10.sh")).read()
    common = re.search(r'^PRETRAIN="(.*?)"', text, re.S | re.M)[1]
    smoke = re.search(r'^    PRETRAIN="\$PRETRAIN (.*?)"', text, re.M)[1]
    methods = dict(re.findall(r'\[(\w+)\]="([^"]*)"', text))
    return common.split(), smoke.split(), methods


def test_the_reproduction_script_runs_recipes_settings(tmp_path):
    import subprocess
    common, smoke, methods = reproduction_settings()
    assert set(methods) == {"sce", "ressl", "moco"}
    cifar = next(c for c in COMMANDS if "cifar10" in c)  # RECIPES.md's CIFAR-10 line
    for method, flags in methods.items():
        args = main_pretrain.parse_args(["--data", "d"] + common + flags.split())
        recipe = main_pretrain.parse_args(cifar + flags.split())
        keys = ["arch", "small_input", "batch_size", "epochs", "lr", "weight_decay", "queue_size", "proj_dim",
                "proj_hidden_dims", "proj_last_bn", "ema_momentum", "ema_schedule", "bn_splits", "shuffle_bn", "tau"]
        for key in keys + (["tau_m"] if args.loss != "infonce" else []):  # InfoNCE has no target temperature
            assert getattr(args, key) == getattr(recipe, key), (method, key)
        main_pretrain.parse_args(["--data", "d"] + common + smoke + flags.split())  # SMOKE=1 parses too
    assert methods["sce"].split() == ["--method", "sce", "--tau", "0.2", "--tau-m", "0.1"]  # Table 10's best
    script = os.path.join(REPO, "benchmarks", "reproduce_cifar10.sh")
    proc = subprocess.run(["bash", script, str(tmp_path)], capture_output=True, text=True, env=dict(os.environ))
    assert proc.returncode == 1 and "needs train/ and val/" in proc.stderr
    os.makedirs(tmp_path / "train"), os.makedirs(tmp_path / "val")
    proc = subprocess.run(["bash", script, str(tmp_path)], capture_output=True, text=True,
                          env=dict(os.environ, METHODS="sce simclr"))
    assert proc.returncode == 1 and "unknown method 'simclr'" in proc.stderr
