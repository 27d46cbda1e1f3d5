#!/usr/bin/env bash
# The small-and-medium part of the paper's baselines table (Sec. 4.2): SCE, ReSSL and MoCo v2 (the last two the
# authors' reproductions) on CIFAR-10, CIFAR-100, STL-10 or Tiny-ImageNet, each with the paper's setting for the
# dataset (its row of sce/recipes.py): 200 epochs of pretraining (the kNN monitor every 20 epochs and after the last:
# the table's kNN), then the linear probe (100 epochs, lr 30, x0.1 at 60 and 80); one table beside the paper's
# numbers, results.json, and two figures: curves.png (each method's kNN and online probe per epoch against its paper
# number, its loss and schedules) and time_split.png (each stage's wall time by part).
#
#   bash benchmarks/reproduction/reproduce.sh DATASET DATA_DIR [OUT_DIR]    DATASET: cifar10, cifar100, stl10 or tiny-imagenet
#                                                               (OUT_DIR: runs/reproduce/DATASET)
#   METHODS="sce moco" bash benchmarks/reproduction/reproduce.sh ...         some of: sce ressl moco (default: all three); the
#                                                               table holds every method finished in OUT_DIR
#   SMOKE=1 bash benchmarks/reproduction/reproduce.sh ...                    the whole script on CPU in a minute or two: 1 epoch
#                                                               each, 16 px crops, a tiny head, on a small ImageFolder
#                                                               written from DATA_DIR (10 classes, 16 train and 8
#                                                               val images a class)
#   DRY_RUN=1 bash benchmarks/reproduction/reproduce.sh ...                  check DATA_DIR, print each stage's command, run none
#   PYTHON=/path/to/python bash benchmarks/reproduction/reproduce.sh ...     the interpreter (default: .venv/bin/python of this
#                                                               repository if there is one, else python3)
# DATA_DIR: the official download (cifar-10-batches-py/, cifar-100-python/, stl10_binary/, tiny-imagenet-200/
# with val/val_annotations.txt), that folder itself, or for CIFAR train/ and val/ class folders of image files.
# Before any training, every file of an official layout is read (and its images counted against its labels), and
# every image Tiny-ImageNet's val_annotations.txt lists must exist; an ImageFolder's files are listed, not decoded.
# STL-10 pretrains on train + unlabeled (105,000 images) and its linear probe trains on train (5,000).
# After a pretraining's first epoch (no restart: that stage goes on), a line gives each stage's estimated time on this
# machine; each stage shows a line per epoch here and its time split at its end, its whole output going to
# OUT_DIR/METHOD.STAGE.log. Interrupted (SIGTERM, SIGINT, SIGUSR1: the running stage saves and stops, or the script
# stops before the next stage; killed outright: the stage stops by itself within seconds), the same command continues
# where it stopped. One invocation at a time may use an OUT_DIR, and an OUT_DIR holds one DATASET from one DATA_DIR
# (SMOKE's runs or real ones).
# On a GPU the images are preloaded there and the step runs in bf16 from a CUDA graph; the loss itself runs in
# fp32 (sce/builder.py). Lossy JPEG folders give somewhat lower numbers than the official pixels.
set -euo pipefail
usage="usage: bash benchmarks/reproduction/reproduce.sh cifar10|cifar100|stl10|tiny-imagenet DATA_DIR [OUT_DIR]"
DATASET=${1:?$usage}
DATA=$(realpath -m "${2:?$usage}")  # the caller's paths, before the cd
OUT=$(realpath -m "${3:-$(dirname "$0")/../../runs/reproduce/$DATASET$([ "${SMOKE:-0}" = 1 ] && echo _smoke)}")
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
fi
command -v "${PYTHON%% *}" > /dev/null || { echo "error: no Python interpreter '$PYTHON': pass PYTHON=/path/to/python" \
    "(the one requirements.txt was installed into)" >&2; exit 1; }

# the dataset's row of sce/recipes.py (its one copy), without SCE's temperatures: PRETRAIN; SCE_TEMPS (supp. Table
# 10's best); an unknown dataset is one line naming the known ones
recipe=$($PYTHON benchmarks/reproduction/reproduce_tools.py recipe "$DATASET") || exit 1
eval "$recipe"
PRETRAIN="$PRETRAIN --knn-every 20"
# the methods of the paper's table (benchmarks/reproduction/reproduce_tools.py's PAPER), all of them when METHODS
# is unset; each runs with its own defaults (main_pretrain.py --method: MoCo v2 tau 0.2, two strong views; ReSSL tau
# 0.1, tau_m 0.04), SCE with the dataset's temperatures
METHODS=$($PYTHON benchmarks/reproduction/reproduce_tools.py methods ${METHODS+"$METHODS"}) || exit 1
LINEAR=""  # the linear probe's flags beyond its defaults (100 epochs, lr 30, x0.1 at 60 and 80, batch 256)

# SIGTERM / SIGINT / SIGUSR1 go to the running stage, which saves and stops; the script exits with its code. One
# that comes while no stage runs (the data check, between two stages) stops the script before the next.
child=0
forward() {  # never fails (set -e): a stage just reaped leaves nothing to signal
    stopping=1
    if (( child > 0 )); then kill -TERM "$child" 2>/dev/null || true; fi
}
stopping=0
trap forward TERM INT USR1
stop_if_asked() {
    if (( stopping )); then
        echo "=> interrupted: run the same command again to continue" >&2
        exit 75
    fi
}

mkdir -p "$OUT"
# one invocation per OUT_DIR: the lock dies with this shell (the stages and the display close it: fd 9 is this
# shell's alone, so a rerun right after `kill -9` of this shell proceeds, whatever the orphaned stage does)
if command -v flock > /dev/null; then
    exec 9>> "$OUT/.lock"
    flock -n 9 || { echo "error: $OUT is in use by another reproduce.sh ($(cat "$OUT/.lock.pid" 2>/dev/null ||
        echo "its PID unknown")): wait for it to end or stop it, or pass another OUT_DIR" >&2; exit 1; }
    echo "PID $$" > "$OUT/.lock.pid"
fi
# an OUT_DIR holds the runs of one dataset from one DATA_DIR, SMOKE's or real ones: another is refused before
# anything runs
source_id="$DATASET $DATA"
if [ "${SMOKE:-0}" = 1 ]; then source_id="$source_id (SMOKE=1)"; fi
if [ -f "$OUT/source" ] && [ "$(cat "$OUT/source")" != "$source_id" ]; then
    echo "error: $OUT holds the runs of $(cat "$OUT/source"), not of $source_id: pass that DATASET and DATA_DIR" \
        "(and SMOKE) to continue them, or another OUT_DIR" >&2
    exit 1
fi
# which layout DATA_DIR holds, checked whole (a missing or truncated file is named) before any training
# (SMOKE=1 checks the script, not the numbers: it trains on a small ImageFolder written from the data)
# A stop during the check ends it and the script (75, one line): the check runs in the background, where Ctrl-C is
# ignored (a traceback otherwise), and SIGTERM (forward's, or a group's) or a group's SIGUSR1 ends it silently; what
# it writes (data.env, the SMOKE folder) is written again by the next invocation.
smoke_dir=(); [ "${SMOKE:-0}" = 1 ] && smoke_dir=("$OUT/smoke_data")
$PYTHON benchmarks/reproduction/reproduce_tools.py check "$DATASET" "$DATA" "$OUT/data.env" \
    ${smoke_dir[@]+"${smoke_dir[@]}"} 9>&- &
child=$!
wait "$child" 2> /dev/null && code=0 || code=$?
while kill -0 "$child" 2>/dev/null; do  # a trapped signal ended the wait, not the check
    wait "$child" 2> /dev/null && code=0 || code=$?
done
child=0
stop_if_asked
(( code == 0 )) || exit 1
[ "${DRY_RUN:-0}" = 1 ] || echo "$source_id" > "$OUT/source"
# shellcheck disable=SC1091
source "$OUT/data.env"  # FORMAT (the --dataset of the scripts), ROOT, split sizes, DEVICE (cpu or the GPU's name)
if [ "${SMOKE:-0}" = 1 ]; then
    PRETRAIN="$PRETRAIN --epochs 1 --crop-size 16 --batch-size 8 --bn-splits 2 --queue-size 32 --proj-hidden-dims 32
              --proj-dim 16 --knn-every 1 --workers 0 --print-freq 1 --no-compile"
    LINEAR="--epochs 1 --batch-size 8 --workers 0 --no-compile"
fi
if [ "$DEVICE" != cpu ]; then
    PRETRAIN="$PRETRAIN --amp bf16 --channels-last"
elif [ "${SMOKE:-0}" != 1 ]; then
    echo "warning: no GPU: 200 epochs on a CPU take days (SMOKE=1 checks the script in a minute)" >&2
fi

# stage NAME LOG METHOD CMD...: runs CMD with its output in LOG (its epoch lines, kNN, estimate and time split shown
# here, with each stage's estimated time after the first epoch), adds its wall time (ms) to $OUT/times
stage() {
    local name=$1 log=$2 method=$3 start code lines shown
    shift 3
    stop_if_asked
    echo "=== $name: $*"
    [ "${DRY_RUN:-0}" = 1 ] && return
    start=$(date +%s%N)
    touch "$log"
    lines=$(wc -l < "$log")
    SCE_PARENT_PID=$$ "$@" >> "$log" 2>&1 9>&- &
    child=$!
    # shellcheck disable=SC2086
    $PYTHON benchmarks/reproduction/reproduce_tools.py show "$log" "$child" "$lines" "$OUT" "$OUT/data.env" "$method" "$LINEAR" \
        $METHODS 9>&- &
    shown=$!
    wait "$child" && code=0 || code=$?
    while kill -0 "$child" 2>/dev/null; do  # a trapped signal ended the first wait: let the stage save
        wait "$child" && code=0 || code=$?
    done
    child=0
    wait "$shown" 2> /dev/null || true
    echo "$name $(( ($(date +%s%N) - start) / 1000000 ))" >> "$OUT/times"
    # asked to stop: the stage saved and stopped (75), ended (0), or died of a stop signal before it could take it
    # (143 TERM, 130 INT, 138 USR1: still in its imports, nothing begun): all of them an interruption
    if (( stopping && (code == 0 || code == 75 || code == 143 || code == 130 || code == 138) )); then
        echo "=> $name stopped (exit $code); interrupted: run the same command again to continue" >&2
        exit 75
    fi
    if (( code != 0 )); then
        echo "error: $name stopped (exit $code); the end of $log:" >&2
        tail -3 "$log" >&2
        (( stopping )) && echo "=> interrupted: run the same command again to continue" >&2
        exit "$code"
    fi
}

# the run's stages, resumed where an earlier invocation stopped (--resume auto; a finished stage is skipped)
EPOCHS=$(grep -o -- "--epochs [0-9]*" <<< "$PRETRAIN" | tail -1 | cut -d" " -f2)
epochs_done() { [ -f "$1/log.txt" ] && grep -o '"epoch": [0-9]*' "$1/log.txt" | tail -1 | cut -d" " -f2 || echo 0; }
for method in $METHODS; do
    run=$OUT/$method temps=""
    if [ "$method" = sce ]; then temps=$SCE_TEMPS; fi
    # shellcheck disable=SC2086
    pretrain=($PYTHON main_pretrain.py --dataset "$FORMAT" --data "$ROOT" --knn-data "$ROOT" $PRETRAIN
              --method "$method" $temps --output-dir "$run")
    if [ "$(epochs_done "$run")" != "$EPOCHS" ]; then
        stage "$method pretrain" "$OUT/$method.pretrain.log" "$method" "${pretrain[@]}"
    fi
    if [ ! -f "$run/linear/results_linear.json" ]; then
        # shellcheck disable=SC2086
        stage "$method linear" "$OUT/$method.linear.log" "$method" $PYTHON main_lincls.py --dataset "$FORMAT" \
            --data "$ROOT" --pretrained "$run/checkpoint_last.pth" $LINEAR --resume auto --output-dir "$run/linear"
    fi
done
stop_if_asked
[ "${DRY_RUN:-0}" = 1 ] || $PYTHON benchmarks/reproduction/reproduce_tools.py table "$DATASET" "$OUT" $METHODS 9>&-
[ "${DRY_RUN:-0}" = 1 ] || $PYTHON benchmarks/reproduction/reproduce_tools.py figure "$DATASET" "$OUT" $METHODS 9>&-
