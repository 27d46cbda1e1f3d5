"""main_pretrain.py's settings, resolved once, in named layers, each later one winning: the parser's defaults, the
method's record (sce.losses.METHODS), the recipe's row (sce.recipes), the resumed run's started settings (what its
args.json says was given or set by a row, never what its device decided), this machine's device, then the flags
typed. The result is a read-only Settings: its flat values (args.json's and the checkpoints') and `sources`, the
layer of each value, which args.json keeps beside them and a resume reads back."""
import argparse
import json
import os

from sce import UserError, cli, losses, recipes
from sce.recipes import as_typed, flag_of
from sce.layouts import DATASETS

UNSET = object()
DEVICE = "device"  # this machine's: its cores, its GPU
# this invocation's, not the run's: a resume takes them from its own command line, never from args.json
INVOCATION = {"data", "output_dir", "resume", "stop_after_epochs", "preview_views", "print_settings",
              "dist_timeout", "workers", "print_freq", "preload", "decode", "augment", "compile", "cuda_graph",
              "channels_last", "max_nonfinite_steps", "max_bad_images", "keep_checkpoints"}
STARTED = "run"  # the started run's layer: "run: <the source it had>"
# a setting that does nothing in some runs: (keys, when(values, world_size) it does nothing, why, the fix of a typed
# one, whether it is then recorded as None: not where a module reads it whatever the run)
NO_EFFECT = [
    (("bn_splits", "split_bn"), lambda v, w: not v["shuffle_bn"] or w > 1,
     lambda v, w: "BN is split only under --shuffle-bn on one process" + (f" ({w} ranks shuffle for real)"
                                                                            if w > 1 else ""),
     "add --shuffle-bn or drop it", True),
    (("class_list",), lambda v, w: v["dataset"] != "imagenet100",
     lambda v, w: "it picks the classes of --dataset imagenet100", "drop it or use --dataset imagenet100", True),
    (("online_probe_lr",), lambda v, w: not v["online_probe"],
     lambda v, w: "it is the online probe's, off under --no-online-probe", "drop one of them", True),
    (("knn_data",), lambda v, w: not v["knn_every"] and v["recipe"] != "demo",
     lambda v, w: "the kNN monitor is off under --knn-every 0", "drop it or give --knn-every N", True),
    (("knn_k", "knn_t", "knn_max_train"),
     lambda v, w: not v["knn_data"] or not (v["knn_every"] or v["recipe"] == "demo"),
     lambda v, w: "no kNN monitor runs (it needs --knn-data and --knn-every N)", "drop it or add --knn-data DIR", True),
    (("lambda_end",), lambda v, w: v["lambda_schedule"] == "constant",
     lambda v, w: "lambda stays constant without --lambda-schedule", "drop it or add --lambda-schedule", True),
    (("lambda_warmup_start",), lambda v, w: not v["lambda_warmup_steps"],
     lambda v, w: "lambda has no warmup without --lambda-warmup-steps", "drop it or add --lambda-warmup-steps N",
     True),
    (("local_aug",), lambda v, w: not v["local_crop_sizes"],
     lambda v, w: "there are no local crops without --local-crop-sizes", "drop it or add --local-crop-sizes", False),
]


class Settings(argparse.Namespace):
    """A run's settings, read-only once built: vars() gives the flat values and `sources` ({key: layer}); `notes`
    (outside vars) the lines the run says of them."""
    __slots__ = ("notes",)

    def __init__(self, values, sources, notes):
        self.__dict__.update(values, sources=sources)
        object.__setattr__(self, "notes", notes)

    def __setattr__(self, key, value):
        raise AttributeError(f"the settings are resolved once (sce.settings): {key} cannot be set afterwards")


def typed_flags(parser, argv):
    """{key: value} of the flags typed on the command line (a namespace preset to UNSET: argparse sets the defaults
    only of keys it lacks)."""
    preset = argparse.Namespace(**{a.dest: UNSET for a in parser._actions if a.dest != "help"})
    return {k: v for k, v in vars(parser.parse_args(argv, preset)).items() if v is not UNSET}


def started_settings(path):
    """{key: (value, source)} of the run that wrote `path` (its args.json): the values given or set by a row (those
    of a run older than the map: all but this invocation's and the device's, as it started with them)."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}, the settings of the run to resume ({e}): restore it or pass "
                        "another --output-dir") from None
    sources = saved.pop("sources", None)
    kept = {}
    for key, value in saved.items():
        origin = sources.get(key, "") if sources else "its args.json"
        origin = origin.removeprefix(f"{STARTED}: ")
        given = not sources or origin.startswith(("flag", "recipe", "demo"))
        if key not in INVOCATION and value is not None and given:
            kept[key] = (value, f"{STARTED}: {origin}")
    return kept


def resume_path(output_dir, resume):
    """The checkpoint a run would continue (sce.resume.find_resume's rule, without its refusals), or None."""
    if resume == "none":
        return None
    last = os.path.join(output_dir, "checkpoint_last.pth")
    return (last if os.path.exists(last) else None) if resume == "auto" else resume


class Layers:
    """values and sources, a layer at a time."""

    def __init__(self, defaults):
        self.values, self.sources = dict(defaults), dict.fromkeys(defaults, "default")

    def put(self, source, values):
        for key, value in values.items():
            self.values[key], self.sources[key] = value, source


def resolve(parser, argv=None, device=None, world_size=1, demo_data=None, resolve_device=None):
    """The settings of main_pretrain.py's command line `argv` (sce.settings' layers). device: this machine's (None:
    its layer left out, the device's values unresolved); resolve_device(values, device, world_size): {key: value}
    of the device's layer; demo_data(): the demo's data folder, without --data."""
    typed = typed_flags(parser, argv)
    layers = Layers({a.dest: a.default for a in parser._actions if a.dest != "help"})
    layers.sources["workers"] = DEVICE  # its default is this machine's cores
    notes = []
    demo = typed.get("data") is None
    path, started_json, started = started_run(typed, layers.values, demo)
    method = typed.get("method") or started.get("method", ("sce",))[0]
    layers.put(f"method {method}", method_values(method))
    name = recipe_name(typed, started, demo, bool(path))
    dataset = typed.get("dataset") or started.get("dataset", (None,))[0] or (
        recipes.row(name, method).get("dataset", (None,))[0] if name else None) or layers.values["dataset"]
    row_layer(layers, name, method, dataset)
    for key, (value, source) in started.items():
        if key in layers.values:
            layers.put(source, {key: value})
    if started:
        notes.append(f"resuming the run in {os.path.dirname(started_json)}: its settings as it started (args.json)"
                     ", the flags given winning")
    notes.append(given_over(parser, layers, typed, started))
    layers.put("flag", typed)
    if demo:  # the digits, which the kNN monitor reads too
        layers.put("demo", {"data": demo_data() if demo_data else None})
        if "knn_data" not in typed:
            layers.put("demo", {"knn_data": layers.values["data"]})
    layers.put("derived: --method and --loss-coeffs", {"loss": losses.loss_name(argparse.Namespace(
        **layers.values))})
    layers.put("derived", {"demo": demo})
    if device is not None and resolve_device:
        for key, value in resolve_device(argparse.Namespace(**layers.values), device, world_size).items():
            if value != layers.values[key] or layers.sources[key] in ("default", DEVICE):  # else the value kept
                layers.put(f"{DEVICE} (this machine: {device.type}{f', {world_size} ranks' if world_size > 1 else ''})",
                           {key: value})
    idle_settings(parser, layers, world_size, notes)
    if not name and not path and dataset in recipes.OF_DATASET:
        notes.append(not_the_papers(parser, layers.values, dataset, method))
    elif name and "recipe" not in typed and not started and not demo:
        notes.append(f"--dataset {dataset}: the paper's setting of it (--recipe {name}; --recipe none for the "
                     "parser's defaults); --print-settings shows every value and its source")
    return Settings(layers.values, layers.sources, [n for n in notes if n])


def started_run(typed, defaults, demo):
    """(the checkpoint this invocation continues, its run's args.json, started_settings of it), or Nones and {}."""
    output_dir = typed.get("output_dir") or (recipes.ROWS["demo"].values["output_dir"][0] if demo
                                             else defaults["output_dir"])
    path = resume_path(output_dir, typed.get("resume", defaults["resume"]))
    started_json = os.path.join(os.path.dirname(os.path.abspath(path)), "args.json") if path else None
    if not started_json or not os.path.isfile(started_json):
        return path, None, {}
    return path, started_json, started_settings(started_json)


def row_layer(layers, name, method, dataset):
    """The recipe's row `name` run with `method` (without one: --dataset's native size for the crop and stem)."""
    native = getattr(DATASETS.get(dataset), "native_size", None)
    layers.put(f"default (--dataset {dataset}'s native size)" if native else "default",
               {"crop_size": native or 224, "small_input": bool(native and native <= 96)})
    for key, (value, source) in (recipes.row(name, method) if name else {}).items():
        if key != "queue_size" or losses.METHODS[method].queue:
            layers.put(f"recipe {name}: {source}", {key: value})
    layers.put("recipe" if name else "default", {"recipe": name})


def given_over(parser, layers, typed, started):
    """The line of the typed flags that override a row's or the resumed run's value (None without any)."""
    over = [f"{flag_of(k)} {as_typed(v)} (not {as_typed(layers.values[k])}, {layers.sources[k].split(':')[0]})"
            for k, v in typed.items() if v != layers.values[k] and layers.sources[k].startswith(("recipe", STARTED))]
    return ("given, over the " + ("run's and the " if started else "") + f"recipe's: {'; '.join(over)}"
            if over else None)


def method_values(method):
    """What a flag left unset takes from the method's record: its loss and the model's shape."""
    m = losses.METHODS[method]
    return dict(tau=m.tau, tau_m=m.tau_m, online_aug=m.views.online, target_aug=m.views.target,
                proj_hidden_dims=list(m.projector[0]), proj_dim=m.projector[1], proj_last_bn=m.projector[2],
                pred_hidden_dims=list(m.predictor), symmetric=m.symmetric,
                queue_size=cli.QUEUE_SIZE if m.queue else 0)


def recipe_name(typed, started, demo, resumed):
    """The row of the run: --recipe's; a resumed run's own (none for a run older than the rows); the demo's without
    --data; for a fresh run, --dataset's row if it has one."""
    if "recipe" in typed:
        return None if typed["recipe"] == "none" else typed["recipe"]
    if resumed and started:
        return started.get("recipe", (None,))[0]
    if demo:
        return "demo"
    return recipes.OF_DATASET.get(typed.get("dataset"))


def idle_settings(parser, layers, world_size, notes):
    """A value that does nothing in this run's setting, not typed (refuse_idle_flags refuses those): recorded as
    None (no effect), and said where a row set it."""
    values = layers.values
    for keys, idle, why, _, record in NO_EFFECT:
        if not idle(values, world_size):
            continue
        for key in keys:
            source = layers.sources[key]
            if source == "flag":
                continue
            if values[key] is not None and source.startswith(("recipe", "demo")):
                notes.append(f"{flag_of(key)} {as_typed(values[key])} ({source.split(':')[0]}) has no effect "
                             f"here: {why(values, world_size)}")
            if record:
                layers.put(f"no effect: {why(values, world_size)}", {key: None})


def refuse_idle_flags(args, world_size=1):
    """One line for a flag typed on the command line that does nothing in the run's setting (NO_EFFECT), run after
    the values' own checks (a value outside what a flag accepts is said first)."""
    sources, values = getattr(args, "sources", {}), vars(args)
    for keys, idle, why, fix, _ in NO_EFFECT:
        typed = [key for key in keys if sources.get(key) == "flag"]
        if typed and idle(values, world_size):
            raise UserError(f"{flag_of(typed[0])} has no effect here: {why(values, world_size)}: {fix}")


def not_the_papers(parser, values, dataset, method):
    """The line of a run on a dataset of the paper without its row: the values that are not the paper's."""
    name = recipes.OF_DATASET.get(dataset)
    if not name:
        return None
    row = recipes.row(name, method) if method in recipes.ROWS[name].methods else recipes.ROWS[name].values
    off = [f"{flag_of(k)} {as_typed(values[k])} (paper: {as_typed(v)})" for k, (v, _) in row.items()
           if values.get(k) != v]
    return (f"--dataset {dataset} without its row (--recipe none): not the paper's: {', '.join(off)}" if off
            else None)


def show(parser, settings):
    """Every value with the layer it came from, for --print-settings, then the run's notes (the lines a run starts
    with: a dataset's row taken, a flag over a row, values that are not the paper's)."""
    lines = []
    for action in parser._actions:
        if action.dest in ("help", "print_settings"):
            continue
        flag = flag_of(action.dest)
        lines.append(f"{flag + ' ' + as_typed(getattr(settings, action.dest)):42}  {settings.sources[action.dest]}")
    for key in ("loss", "demo"):
        lines.append(f"{f'({key}) ' + as_typed(getattr(settings, key)):42}  {settings.sources[key]}")
    return "\n".join(lines + [f"=> {note}" for note in settings.notes])
