"""The paper's settings as rows (sce/recipes.py): RECIPES.md spells each out value by value, main_pretrain.py's
--recipe runs it, its settings resolved once in layers (sce.settings), each value's source said and kept."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from conftest import REPO
import main_pretrain
from sce import UserError, losses, recipes, settings
from sce.layouts import DATASETS

sys.path.insert(0, os.path.join(REPO, "benchmarks", "reproduction"))
import reproduce_tools  # noqa: E402

OWN = ("data", "output_dir")  # a command's own, not its row's


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


def row_of(argv):
    """The row a spelled-out command of RECIPES.md names by its --output-dir runs/NAME..., or None."""
    folder = os.path.basename(argv[argv.index("--output-dir") + 1])
    return max((name for name in recipes.ROWS if folder.startswith(name)), key=len, default=None)


def values(args):
    return {k: v for k, v in vars(args).items() if k not in ("sources", "recipe")}


def test_recipes_md_is_the_rows_value_by_value():
    """Each spelled-out line of RECIPES.md, read without a row (--recipe none), is its row's settings (with the
    method and the swept flags it names) value by value; every row but the demo has its lines, every point of a
    table's sweep one; reproduce_tools.py (reproduce.sh, the GPU scripts) reads the same row."""
    covered = {}
    for argv in COMMANDS:
        if "--recipe" in argv or "--lambda-schedule" in argv:  # the short forms; the authors' later lambda schedule
            main_pretrain.parse_args(argv)
            continue
        name = row_of(argv)
        assert name, f"no row for {' '.join(argv)}"
        typed = settings.typed_flags(main_pretrain.parser, argv)
        swept = {k for point in recipes.ROWS[name].sweep for k in point}
        point = {k: typed[k] for k in swept if k in typed}
        own = recipes.as_flags({k: typed[k] for k in (*OWN, "method") if k in typed})
        from_row = main_pretrain.parse_args(own + recipes.as_flags(point) + ["--recipe", name])
        spelled = main_pretrain.parse_args(argv + ["--recipe", "none"])
        assert values(spelled) == values(from_row), name
        row = recipes.row(name, typed.get("method", "sce"))
        assert all(from_row.sources[k].startswith(f"recipe {name}: ") for k in row if k not in point), name
        covered.setdefault(name, []).append({k: point.get(k, getattr(from_row, k)) for k in swept})
    assert set(covered) == set(recipes.ROWS) - {"demo"}
    for name, recipe in recipes.ROWS.items():
        if recipe.sweep:
            assert sorted(repr(sorted(p.items())) for p in covered[name]) == sorted(
                repr(sorted(p.items())) for p in recipe.sweep), name
    said = subprocess.run([sys.executable, "-m", "sce.recipes", "imagenet100-lambda", "--sweep"], cwd=REPO,
                          capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert [shlex.split(line)[-1] for line in said] == [recipes.typed(x / 10) for x in range(11)]
    for name in reproduce_tools.PAPER["sce"][1]:
        line = next(c for c in COMMANDS if f"--dataset {name} " in " ".join(c))
        assert reproduce_tools.recipe_flags(name) == recipes.flags(name)
        assert main_pretrain.parse_args(line).crop_size == DATASETS[name].native_size, name


def test_every_row_is_valid_and_the_baselines_take_their_records():
    """Every row with each of its methods passes main_pretrain.py's checks on the GPUs the paper used (8 for
    ImageNet's, one for the small datasets); a baseline's row values are its record's (Sec. 4.2), which
    reproduce.sh leaves to the record; every value has a source."""
    for name, recipe in recipes.ROWS.items():
        for method in recipe.methods:
            args = main_pretrain.parse_args(["--data", "d", "--recipe", name, "--method", method])
            main_pretrain.check_args(args, min(max(recipe.gpus, 1), 8), torch.device("cuda"))
            assert all(source for _, source in recipes.row(name, method).values())
            record = main_pretrain.parse_args(["--data", "d", "--recipe", "none", "--method", method])
            if method != "sce" and name != "imagenet":
                for key in recipe.methods[method]:
                    assert getattr(args, key) == getattr(record, key), (name, method, key)
    import main_lincls
    for recipe in recipes.ROWS.values():  # the linear probe's values are main_lincls.py's flags
        linear = {k: v for k, (v, _) in recipe.linear.items()}
        parsed = main_lincls.get_parser().parse_args(["--data", "d", "--pretrained", "p", *recipes.as_flags(linear)])
        assert all(getattr(parsed, k) == v for k, v in linear.items())
        assert all(source for _, source in recipe.linear.values())


@pytest.fixture(autouse=True)
def sizes_fit(monkeypatch):
    monkeypatch.setattr(main_pretrain.cli.du, "device_memory", lambda device: 80 * 2 ** 30)  # each fits an H100


def test_recipe_flag_wins_and_is_said_and_a_row_turns_flags_either_way(monkeypatch):
    args = main_pretrain.parse_args(["--data", "d", "--recipe", "cifar10", "--lr", "0.1", "--no-shuffle-bn"])
    assert (args.lr, args.sources["lr"], args.batch_size) == (0.1, "flag", 256)
    assert "--lr 0.1 (not 0.06, recipe cifar10)" in args.notes[0] and "--shuffle-bn off (not on" in args.notes[0]
    # BN split by the row, no longer split: said, and recorded as having no effect
    assert args.bn_splits is None and args.split_bn is None and args.sources["bn_splits"].startswith("no effect")
    assert any(n.startswith("--bn-splits 2 (recipe cifar10) has no effect here") for n in args.notes)
    off = recipes.Recipe("a row turning flags off", {"online_probe": (False, "x"), "small_input": (False, "y")},
                         {"sce": {}})
    monkeypatch.setitem(recipes.ROWS, "off", off)
    args = main_pretrain.parse_args(["--data", "d", "--recipe", "off"])
    assert (args.online_probe, args.small_input) == (False, False) and args.sources["online_probe"] == "recipe off: x"
    assert recipes.flags("off") == ["--no-online-probe", "--no-small-input"]
    assert main_pretrain.parse_args(["--data", "d", "--recipe", "off", "--online-probe"]).online_probe is True
    with pytest.raises(UserError, match="--recipe imagenet-100 is run with --method sce in the paper, not moco"):
        main_pretrain.parse_args(["--data", "d", "--recipe", "imagenet-100", "--method", "moco"])


def test_dataset_alone_takes_its_row_for_a_fresh_run():
    """--dataset cifar10 alone: the CIFAR-10 row (not ImageNet's numbers under a 32 px crop), said; --recipe none:
    the defaults, the values not the paper's named in one line; --method moco: the row with MoCo v2's tau."""
    args = main_pretrain.parse_args(["--data", "d", "--dataset", "cifar10"])
    assert (args.recipe, args.arch, args.lr, args.batch_size, args.queue_size, args.tau) == (
        "cifar10", "resnet18", 0.06, 256, 4096, 0.2)
    assert args.notes == ["--dataset cifar10: the paper's setting of it (--recipe cifar10; --recipe none for the "
                          "parser's defaults); --print-settings shows every value and its source"]
    bare = main_pretrain.parse_args(["--data", "d", "--dataset", "cifar10", "--recipe", "none"])
    assert (bare.arch, bare.lr, bare.crop_size, bare.small_input) == ("resnet50", 0.5, 32, True)
    assert len(bare.notes) == 1 and "not the paper's: --arch resnet50 (paper: resnet18)" in bare.notes[0]
    moco = main_pretrain.parse_args(["--data", "d", "--dataset", "cifar10", "--method", "moco"])
    assert (moco.tau, moco.lr, moco.online_aug, moco.target_aug) == (0.2, 0.06, "strong", "strong")


def test_a_resume_reads_the_values_and_their_sources_back(tmp_path):
    """args.json holds the flat values and their sources; a resume takes back what was given or set by a row (not
    the device's, nor this invocation's), a flag given winning; a resumed --dataset run keeps its own setting."""
    device = torch.device("cpu")
    args = main_pretrain.parse_args(["--data", "d", "--recipe", "cifar10", "--lr", "0.1", "--workers", "0",
                                     "--output-dir", str(tmp_path)], device)
    assert args.sources["compile"].startswith("device (this machine: cpu)") and args.compile is False
    assert args.sources["workers"] == "flag"  # the device's layer keeps a value it leaves as it was
    (tmp_path / "args.json").write_text(json.dumps(vars(args)))  # as main_pretrain.py writes it
    (tmp_path / "checkpoint_last.pth").write_bytes(b"")
    with pytest.raises(AttributeError, match="resolved once"):
        args.lr = 1.0
    again = main_pretrain.parse_args(["--data", "d", "--dataset", "cifar100", "--output-dir", str(tmp_path)], device)
    assert (again.lr, again.sources["lr"], again.recipe) == (0.1, "run: flag", "cifar10")
    assert (again.tau, again.sources["tau"].split(":")[:2]) == (0.2, ["run", " recipe cifar10"])
    assert again.workers >= 1 and again.sources["workers"].startswith("device")  # this invocation's, not the run's
    assert again.dataset == "cifar100" and again.sources["dataset"] == "flag"
    assert main_pretrain.parse_args(["--data", "d", "--lr", "0.2", "--output-dir", str(tmp_path)]).lr == 0.2


@pytest.mark.parametrize("argv, message", [
    (["--bn-splits", "4"], "--bn-splits has no effect here: BN is split only under --shuffle-bn on one process"),
    (["--split-bn", "all"], "--split-bn has no effect here: BN is split only under --shuffle-bn"),
    (["--class-list", "f"], "--class-list has no effect here: it picks the classes of --dataset imagenet100"),
    (["--no-online-probe", "--online-probe-lr", "1"], "--online-probe-lr has no effect here"),
    (["--knn-data", "k", "--knn-every", "0"], "--knn-data has no effect here: the kNN monitor is off"),
    (["--knn-k", "5"], "--knn-k has no effect here: no kNN monitor runs"),
    (["--lambda-end", "1"], "--lambda-end has no effect here: lambda stays constant without --lambda-schedule"),
    (["--local-aug", "weak"], "--local-aug has no effect here: there are no local crops"),
    (["--no-online-probe", "--online-probe-lr", "-1"], "--online-probe-lr must be positive"),  # the value first
    (["--recipe", "cifar10", "--bn-splits", "4"], None),
])
def test_a_typed_flag_that_does_nothing_is_refused(argv, message):
    """Refused in one line where typed (after the value's own checks); the same set by a row: said, recorded None."""
    args = main_pretrain.parse_args(["--data", "d"] + argv)
    if message:
        with pytest.raises(UserError, match=re.escape(message)):
            main_pretrain.check_args(args)
    else:
        assert main_pretrain.check_args(args) == 4
    args = main_pretrain.parse_args(["--data", "d", "--recipe", "cifar10", "--bn-splits", "4"], torch.device("cpu"), 8)
    with pytest.raises(UserError, match="has no effect here: BN is split only under --shuffle-bn on one process "
                                        r"\(8 ranks shuffle for real\)"):
        main_pretrain.check_args(args, 8)
    row = main_pretrain.parse_args(["--data", "d", "--recipe", "cifar10"], torch.device("cpu"), 8)
    assert row.bn_splits is None and "--bn-splits 2 (recipe cifar10) has no effect here" in " ".join(row.notes)
    main_pretrain.check_args(row, 8)


def test_print_settings_shows_every_value_with_its_layer(tmp_path):
    """--print-settings: a line per flag, value and layer (the row's sources, this machine's device values marked),
    then the run's notes (a typed flag over the row), then exit with nothing written."""
    out = subprocess.run([sys.executable, "main_pretrain.py", "--data", str(tmp_path), "--recipe", "cifar10",
                          "--epochs", "3", "--output-dir", str(tmp_path / "run"), "--print-settings"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    notes = [line for line in out.stdout.splitlines() if line.startswith("=> ")]
    assert notes == ["=> given, over the recipe's: --epochs 3 (not 200, recipe cifar10)"], notes
    lines = dict(re.match(r"(\S+ .*?)\s{2,}(.*)$", line).groups() for line in out.stdout.splitlines()
                 if not line.startswith("=> "))
    assert lines["--epochs 3"] == "flag"
    for key, (value, source) in recipes.row("cifar10").items():
        line = f"{recipes.flag_of(key)} {recipes.as_typed(value)}"
        assert key == "epochs" or lines[line] == f"recipe cifar10: {source}", key
    assert lines["--compile off"].startswith("device (this machine: cpu)")
    assert lines["--method sce"] == "default" and lines["--online-aug strong"] == "method sce"
    assert not os.path.exists(tmp_path / "run")


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


def test_the_readmes_pretraining_commands_run_their_rows():
    """README.md's main_pretrain.py commands, as a user types them: each passes the checks on its GPUs (torchrun's
    --nproc_per_node) and takes the row it names; --method moco keeps the row and takes MoCo v2's temperature."""
    lines = [line.split("#")[0] for line in open(os.path.join(REPO, "README.md")).read().splitlines()
             if line.startswith("    ") and " main_pretrain.py --data " in line]
    assert len(lines) >= 4, lines
    for line in lines:
        words = shlex.split(line)
        gpus = int(next((w.split("=")[1] for w in words if w.startswith("--nproc_per_node=")), 1))
        argv = words[words.index("main_pretrain.py") + 1:]
        args = main_pretrain.parse_args(argv, None, gpus)  # the device layer left unresolved: no GPU here
        main_pretrain.check_args(args, gpus, torch.device("cuda") if gpus > 1 else torch.device("cpu"))
        name = argv[argv.index("--recipe") + 1]
        method = argv[argv.index("--method") + 1] if "--method" in argv else "sce"
        for key, (value, _) in recipes.row(name, method).items():
            assert getattr(args, key) == value, (line, key)
        assert args.sources["lr"].startswith(f"recipe {name}"), line


def test_the_recipes_command_prints_what_the_scripts_read(capsys):
    """python -m sce.recipes: the rows listed; a row as main_pretrain.py flags (what reproduce.sh and the GPU scripts
    run), parsed back to its values; its linear probe's flags, parsed by main_lincls.py; each value with its source;
    an unknown row in one line."""
    import main_lincls
    recipes.main([])
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == list(recipes.ROWS)
    recipes.main(["cifar10", "--method", "moco", "--flags"])
    args = main_pretrain.parse_args(["--data", "d", "--recipe", "none", "--dataset", "cifar10",
                                     *shlex.split(capsys.readouterr().out), "--method", "moco"])
    for key, (value, _) in recipes.row("cifar10", "moco").items():
        assert getattr(args, key) == value, key
    recipes.main(["cifar10", "--linear-flags"])
    linear = main_lincls.get_parser().parse_args(["--data", "d", "--pretrained", "p",
                                                  *shlex.split(capsys.readouterr().out)])
    assert (linear.lr, linear.epochs, linear.milestones, linear.schedule) == (30.0, 100, [60, 80], "step")
    recipes.main(["cifar10", "--sources"])
    said = capsys.readouterr().out.splitlines()
    assert len(said) == len(recipes.row("cifar10")) and all(
        line.endswith(source) for line, (_, source) in zip(said, recipes.row("cifar10").values()))
    with pytest.raises(UserError):
        recipes.main(["cifar11", "--flags"])
