#!/usr/bin/env bash
# The authors' SCE code (CEA-LIST/SCE, their CIFAR-10 configuration resnet18_cifar10.yaml, unedited, from a checkout
# named here) and ours (RECIPES.md's CIFAR-10 line) pretrained on the same ImageFolder for the same epochs, each
# trunk then read by our kNN (k 200, T 0.07: main_lincls.py --knn on theirs, the kNN monitor after the last epoch on
# ours, which reads main_lincls.py --knn's number); both figures side by side with their wall times,
# a table and one JSON line each (also in OUT_DIR/results.json). If theirs reads what ours does, a gap to the paper
# is the data's; if theirs reads higher, it is ours.
#
#   bash benchmarks/fidelity/authors_reference.sh AUTHORS_DIR DATA_DIR EPOCHS [OUT_DIR]   (OUT_DIR: runs/authors_reference)
#   PYTHON_AUTHORS=/path/python     their environment's interpreter (default: $PYTHON): PINS below, torch,
#                                   torchvision, tensorboard, numpy, pillow, pyyaml (docs/benchmarks.md)
#   AUTHORS_WHEELS=DIR              unpack those pins from DIR/*.whl first (no index: the GPU machine's way), into
#                                   OUT_DIR/authors_site, on their runs' PYTHONPATH only
#   PYTHON=/path/python             ours (default: .venv/bin/python of this repository if there is one, else python3)
#   ORDER="ours authors"            which runs, in this order (default: both, ours first)
#   SEED=42                         both runs' seed (their config's)
#   LIMIT_S=N                       stop N s after the start: ours at the limit (it saves), their training at the end
#                                   of the last epoch that ends 60 s before it (their trunk and kNN after it), no
#                                   stage started past it; the same command later continues both
#   AUTHORS_OVERRIDES="..."         more Hydra overrides for their run (e.g. datamodule.train.loader.num_workers=8)
#   SMOKE=1                         a check on CPU: 10 classes of 32 train and 16 val images from DATA_DIR, batch 32
#   DRY_RUN=1                       check the arguments, print each stage's command, run none
# On a GPU: theirs in fp16 AMP as their config says, ours with --amp bf16 --channels-last (RECIPES.md); on a CPU both
# in fp32. A rerun continues: their Lightning from the last checkpoint in OUT_DIR/authors/pretrain_checkpoints (saved
# at every epoch's end), ours with --resume auto; finished stages are skipped. Each stage's output: OUT_DIR/*.log.
#
#   bash benchmarks/fidelity/authors_reference.sh bundle AUTHORS_DIR [BUNDLE_DIR]   (BUNDLE_DIR: .authors, git-ignored)
# writes what a GPU machine without a package registry needs: their tree (BUNDLE_DIR/SCE, its HEAD where AUTHORS_DIR
# is a git repository, bare or not) and the pins as wheels (BUNDLE_DIR/wheels, 3.4 MB): run there with
# AUTHORS_WHEELS=BUNDLE_DIR/wheels.
set -euo pipefail
PINS="pytorch-lightning==1.7.7 torchmetrics==0.10.3 setuptools==80.9.0 hydra-core==1.3.2 omegaconf==2.3.1
      antlr4-python3-runtime==4.9.3 kornia==0.6.12 pyDeprecate==0.3.2 tqdm==4.67.1"
if [ "${1:-}" = bundle ]; then
    [ -f "${2:-}/run/pretrain.py" ] || git -C "${2:-.}" cat-file -e HEAD:run/pretrain.py 2>/dev/null || {
        echo "error: '${2:-}' is not a checkout of CEA-LIST/SCE (no run/pretrain.py): pass the folder their" \
            "repository was cloned into" >&2; exit 2; }
    BUNDLE=$(realpath -m "${3:-$(dirname "$0")/../../.authors}")
    rm -rf "$BUNDLE/SCE" "$BUNDLE/wheels" && mkdir -p "$BUNDLE/SCE" "$BUNDLE/wheels"
    if git -C "$2" rev-parse HEAD > /dev/null 2>&1; then
        git -C "$2" archive HEAD | tar -x -C "$BUNDLE/SCE" && git -C "$2" rev-parse HEAD > "$BUNDLE/SCE/COMMIT"
    else
        cp -r "$2"/. "$BUNDLE/SCE/"
    fi
    # pip 24.1 and later refuse pytorch-lightning 1.7.7's metadata ("torch (>=1.9.*)"): an older pip, in a
    # throwaway virtualenv, downloads the pins (pure Python: one wheel fits all)
    pip_env=$(mktemp -d)
    trap 'rm -rf "$pip_env"' EXIT
    ${PYTHON:-python3} -m venv "$pip_env" && "$pip_env/bin/python" -m pip install -q "pip<24.1"
    # shellcheck disable=SC2086
    "$pip_env/bin/python" -m pip download -q --no-deps -d "$BUNDLE/wheels" $PINS
    for sdist in "$BUNDLE"/wheels/*.tar.gz; do  # antlr4-python3-runtime 4.9.3 exists as a source archive only
        [ -f "$sdist" ] && "$pip_env/bin/python" -m pip wheel -q --no-deps -w "$BUNDLE/wheels" "$sdist" && rm "$sdist"
    done
    du -sh "$BUNDLE"/SCE "$BUNDLE"/wheels
    exit 0
fi
usage="usage: bash benchmarks/fidelity/authors_reference.sh AUTHORS_DIR DATA_DIR EPOCHS [OUT_DIR] (or bundle AUTHORS_DIR)"
[ $# -ge 3 ] && [ $# -le 4 ] || { echo "$usage" >&2; exit 2; }
AUTHORS=$(realpath -m "$1")
DATA=$(realpath -m "$2")
EPOCHS=$3
OUT=$(realpath -m "${4:-$(dirname "$0")/../../runs/authors_reference$([ "${SMOKE:-0}" = 1 ] && echo _smoke)}")
cd "$(dirname "$0")/../.."
START=$SECONDS

[ -f "$AUTHORS/run/pretrain.py" ] && [ -f "$AUTHORS/sce/configs/run/pretrain/sce/resnet18/resnet18_cifar10.yaml" ] || {
    echo "error: $AUTHORS is not a checkout of CEA-LIST/SCE (no run/pretrain.py and resnet18_cifar10.yaml): pass the" \
        "folder their repository was cloned into" >&2; exit 2; }
[ -d "$DATA/train" ] && [ -d "$DATA/val" ] || {
    echo "error: $DATA has no train/ and val/ class folders: pass the CIFAR-10 ImageFolder (tar -xzf" \
        "cifar10-jpeg.tar.gz -C DIR)" >&2; exit 2; }
[[ $EPOCHS =~ ^[0-9]{1,6}$ ]] && (( 10#$EPOCHS > 0 )) || {  # 6 digits at most: bash's arithmetic wraps at 2**63
    echo "error: EPOCHS must be a whole number from 1 to 999999 (got '$EPOCHS')" >&2; exit 2; }
EPOCHS=$(( 10#$EPOCHS ))
[[ ${LIMIT_S:-0} =~ ^[0-9]+$ ]] || { echo "error: LIMIT_S is whole seconds (got '$LIMIT_S')" >&2; exit 2; }
ORDER=${ORDER:-ours authors}
for run in $ORDER; do
    [[ $run == ours || $run == authors ]] || {
        echo "error: unknown run '$run' in ORDER: use ours and/or authors" >&2; exit 2; }
done
if [ -n "${AUTHORS_WHEELS:-}" ] && ! ls "$AUTHORS_WHEELS"/*.whl > /dev/null 2>&1; then
    echo "error: AUTHORS_WHEELS=$AUTHORS_WHEELS holds no .whl files: pass the bundle's wheels folder" >&2; exit 2
fi
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
fi
PYTHON_AUTHORS=${PYTHON_AUTHORS:-$PYTHON}
SEED=${SEED:-42}
mkdir -p "$OUT"

if [ "${SMOKE:-0}" = 1 ]; then  # a small copy of DATA_DIR: the first 32 train and 16 val images of 10 classes
    for split in train:32 val:16; do
        classes=("$DATA/${split%:*}"/*/)
        for class in "${classes[@]:0:10}"; do
            files=("$class"*)
            mkdir -p "$OUT/smoke_data/${split%:*}/$(basename "$class")"
            ln -sf "${files[@]:0:${split#*:}}" "$OUT/smoke_data/${split%:*}/$(basename "$class")/"
        done
    done
    DATA=$OUT/smoke_data
fi
DEVICE=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')" \
    2>/dev/null) || { echo "error: '$PYTHON' cannot import torch: pass PYTHON=/path/to/python (the one" \
    "requirements.txt was installed into)" >&2; exit 2; }
CORES=$(nproc)

# ours: the CIFAR-10 row of sce/recipes.py (read by reproduce_tools.py), its data, epochs, seed and folder
# replaced below (the last of a repeated flag wins)
read -ra recipe <<< "$("$PYTHON" benchmarks/reproduction/reproduce_tools.py flags cifar10)" && (( ${#recipe[@]} )) || {
    echo "error: sce/recipes.py has no CIFAR-10 row" >&2; exit 2; }
ours=("$PYTHON" main_pretrain.py "${recipe[@]}" --dataset imagefolder --data "$DATA" --knn-data "$DATA"
      --epochs "$EPOCHS" --knn-every "$EPOCHS" --seed "$SEED" --output-dir "$OUT/ours")
# theirs: their config with our data, the epochs, a checkpoint at every epoch's end (last.ckpt: the resume point)
# and at the last (epoch=EPOCHS-1.ckpt), the seed; their loader's workers from the machine's cores
authors=("$PYTHON_AUTHORS" benchmarks/fidelity/authors_reference.py pretrain "$AUTHORS" "$DATA" "$OUT/authors"
         "trainer.max_epochs=$EPOCHS" "callbacks.model_checkpoint.every_n_epochs=$EPOCHS"
         callbacks.model_checkpoint.save_last=True "seed.seed=$SEED")
# one device: Lightning's single-device strategy, not their config's DDP (their step is the same: their gathers
# check for a process group, their split BN simulates 8 devices either way), but their loader's order is not:
# DDP's sampler shuffles, and without it their loader reads the folder in order, each batch one class, so
# shuffle=True as their config's DDP does (authors_reference.py stops a run whose first batches hold one class);
# their views' settings handed to torchvision as plain lists, not OmegaConf's (the same views, bit for bit, in
# ~60% of the loader's time)
authors+=("~trainer.strategy" "+datamodule.train.loader.shuffle=True" "+datamodule.train.transform._convert_=all")
if [ "$DEVICE" = cpu ]; then
    authors+=(trainer.gpus=0 model.num_devices=1 trainer.precision=32)
else
    ours+=(--amp bf16 --channels-last)
fi
if [ "${SMOKE:-0}" = 1 ]; then
    ours+=(--batch-size 32 --workers 1 --print-freq 1 --no-compile)
    authors+=(datamodule.train.global_batch_size=32 datamodule.train.loader.num_workers=1
              callbacks.progress_bar.refresh_rate=1)
else
    authors+=("datamodule.train.loader.num_workers=$(( CORES > 3 ? CORES - 2 : 1 ))"
              "+datamodule.train.loader.persistent_workers=True")
fi
# shellcheck disable=SC2206
authors+=(${AUTHORS_OVERRIDES:-})
# their trunk read by our kNN (k 200, T 0.07, at 32 px), as our monitor reads ours after the last epoch
knn=("$PYTHON" main_lincls.py --knn --dataset imagefolder --data "$DATA" --arch resnet18 --small-input --crop-size 32
     --pretrained "$OUT/authors/trunk.pth" --seed "$SEED" --output-dir "$OUT/authors/knn")
[ "${SMOKE:-0}" = 1 ] && knn+=(--workers 1)
site=()
[ -n "${AUTHORS_WHEELS:-}" ] && site=(env "PYTHONPATH=$OUT/authors_site${PYTHONPATH:+:$PYTHONPATH}")
# the deadline: ours is sent SIGTERM at it; their training stops at the end of the last epoch that ends 60 s
# before it, which leaves their trunk and its kNN the time they take on a GPU
DEADLINE=
if (( ${LIMIT_S:-0} > 0 )); then
    DEADLINE=$(( $(date +%s) + LIMIT_S - (SECONDS - START) ))
    export AUTHORS_DEADLINE=$(( DEADLINE - 60 ))
else
    unset AUTHORS_DEADLINE
fi

# stage NAME CMD...: CMD's output to OUT/NAME.log (shown here too), its wall time (ms) added to OUT/times; at
# the deadline, SIGTERM (ours saves and stops; theirs, which should have stopped at an epoch's end 60 s before,
# loses the epoch it is in), SIGKILL 30 s later: within the 40 s the device call leaves after LIMIT_S
stage() {
    local name=$1 start code
    shift
    echo "=== $name: $*"
    [ "${DRY_RUN:-0}" = 1 ] && return
    start=$(date +%s%N)
    if [ -n "$DEADLINE" ]; then
        local left=$(( DEADLINE - $(date +%s) ))
        (( left > 0 )) || {
            echo "=> the limit of $LIMIT_S s is spent: run the same command again to go on" >&2; exit 75; }
        timeout -s TERM -k 30 "$left" "$@" > >(tee -a "$OUT/$name.log") 2>&1 && code=0 || code=$?
    else
        "$@" > >(tee -a "$OUT/$name.log") 2>&1 && code=0 || code=$?
    fi
    echo "$name $(( ($(date +%s%N) - start) / 1000000 ))" >> "$OUT/times"
    (( code == 0 )) && return
    (( code == 75 || code == 124 || code == 143 )) && {
        echo "=> $name stopped at the limit (exit $code): run the same command again to go on" >&2; exit 75; }
    echo "error: $name failed (exit $code): see $OUT/$name.log" >&2
    exit "$code"
}

for run in $ORDER; do
    if [ "$run" = ours ]; then
        [ "$(grep -so '"epoch": [0-9]*' "$OUT/ours/log.txt" | tail -1)" = "\"epoch\": $EPOCHS" ] ||
            stage ours_pretrain "${ours[@]}"
    else
        if [ -n "${AUTHORS_WHEELS:-}" ] && [ "${DRY_RUN:-0}" != 1 ]; then  # unpacked, not pip: see the .py
            "$PYTHON_AUTHORS" benchmarks/fidelity/authors_reference.py unpack "$AUTHORS_WHEELS" "$OUT/authors_site"
        fi
        last="$OUT/authors/pretrain_checkpoints/epoch=$(( EPOCHS - 1 )).ckpt"
        [ -f "$last" ] || stage authors_pretrain ${site[@]+"${site[@]}"} "${authors[@]}"
        if [ ! -f "$last" ] && [ "${DRY_RUN:-0}" != 1 ]; then
            echo "=> authors_pretrain stopped before epoch $EPOCHS: run the same command again to go on" >&2; exit 75
        fi
        [ -f "$OUT/authors/trunk.pth" ] || stage authors_trunk ${site[@]+"${site[@]}"} "$PYTHON_AUTHORS" \
            benchmarks/fidelity/authors_reference.py trunk "$last" "$OUT/authors/trunk.pth"
        [ -f "$OUT/authors/knn/results_knn.json" ] || stage authors_knn "${knn[@]}"
    fi
done
[ "${DRY_RUN:-0}" = 1 ] && exit 0
"$PYTHON" - "$OUT" "$EPOCHS" "$DEVICE" $ORDER <<'EOF'
import json, os, sys
out, epochs, device, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
times = {}
for line in open(os.path.join(out, "times")).read().splitlines():
    name, ms = line.rsplit(" ", 1)
    times[name] = times.get(name, 0) + int(ms) / 1000
rows = []
for run in runs:
    if run == "ours":  # the kNN monitor after the last epoch: main_lincls.py --knn's number on the same trunk
        knn = json.loads(open(os.path.join(out, "ours", "log.txt")).read().splitlines()[-1])["knn_top1"]
    else:
        knn = json.load(open(os.path.join(out, "authors", "knn", "results_knn.json")))["acc1"]
    rows.append(dict(code=run, epochs=epochs, knn_top1=round(knn, 2), device=device,
                     pretrain_s=round(times.get(f"{run}_pretrain", 0), 1),
                     wall_s=round(sum(s for n, s in times.items() if n.startswith(run)), 1)))
print("\n| code | epochs | kNN top-1 (k 200, T 0.07) | pretrain wall | all stages | device |")
print("|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['code']} | {epochs} | {r['knn_top1']:.2f} | {r['pretrain_s']:.0f} s | {r['wall_s']:.0f} s | "
          f"{device} |")
for r in rows:
    print(json.dumps(r))
json.dump(rows, open(os.path.join(out, "results.json"), "w"), indent=1)
EOF
