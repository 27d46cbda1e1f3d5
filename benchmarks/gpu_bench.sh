#!/usr/bin/env bash
# The GPU performance rows on one H100 / H200, as far as the budget goes (BUDGET_S, default 290; a cold Inductor
# compile is most of each run): rows of benchmarks/bench_pretrain.py (JSON lines, then a table;
# docs/benchmarks.md says what each means). Exit 1 naming a run that failed, 2 when the budget left one out.
#   bash benchmarks/gpu_bench.sh [LOG_DIR]        (default LOG_DIR: runs/gpu_bench)
# 1. cifar_graph / cifar_no_graph: RECIPES.md's CIFAR-10 setting (ResNet-18 small-input, batch 256, split BN 8,
#    bf16, channels_last, compiled), the step as a CUDA graph and without one, end to end from preloaded images,
#    beside the supervised and ideal-asymmetric references (data/cifar10 when present, else random images).
# 2. imagenet: ResNet-50 at 224 px, the defaults (compiled): the loader pipelines cpu / gpu / decode, also with
#    4 workers, and main_lincls.py's training and feature extraction against a no-grad forward.
# 3. symmetric: the same step with both global views as targets; 4. imagenet_eager: not compiled.
set -u
LOG=$(realpath -m "${1:-$(dirname "$0")/../runs/gpu_bench}")
cd "$(dirname "$0")/.."
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-$(command -v python || command -v python3)}  # python, else python3
BUDGET_S=${BUDGET_S:-290}
START=$(date +%s)
ROWS=() FAILED=() SKIPPED=()
bench() {  # bench NAME LIMIT_S ARGS...: one benchmark run, skipped when the budget has less than LIMIT_S left
    local name=$1 limit=$2 left t0 rc
    shift 2
    left=$(( BUDGET_S - ($(date +%s) - START) ))
    if (( left < limit )); then
        ROWS+=("| $name | skipped (budget: ${left}s left) | 0 |")
        SKIPPED+=("$name")
        return
    fi
    echo "=== $name: $*"
    t0=$(date +%s)
    timeout -k 15 "$limit" "$PY" benchmarks/bench_pretrain.py "$@" > "$LOG/$name.log" 2>&1
    rc=$?
    (( rc == 0 )) || FAILED+=("$name")
    ROWS+=("| $name | $([ $rc = 0 ] && echo ok || echo "FAILED ($rc): $(tail -1 "$LOG/$name.log" | cut -c1-90)") \
| $(( $(date +%s) - t0 )) |")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
CIFAR=data/cifar10
if [ ! -d "$CIFAR/train" ] && [ -f data/cifar10-jpeg.tar.gz ]; then
    mkdir -p "$CIFAR" && tar -xzf data/cifar10-jpeg.tar.gz -C "$CIFAR"
fi
SMALL="--arch resnet18 --small-input --crop-size 32 --batch-size 256 --queue-size 4096 --shuffle-bn --bn-splits 8
       --proj-hidden-dims 512 --proj-dim 256 --proj-last-bn none --amp bf16 --channels-last --compile --preload
       --skip-data --steps 50 --warmup 5 $([ -d "$CIFAR/train" ] && echo "--data $CIFAR/train")"
R50="--arch resnet50 --batch-size 256 --crop-size 224 --amp bf16 --channels-last --workers $(( $(nproc) - 1 ))"
# shellcheck disable=SC2086
bench cifar_graph 200 $SMALL --cuda-graph --profile
# shellcheck disable=SC2086
bench cifar_no_graph 120 $SMALL
# shellcheck disable=SC2086
bench imagenet 240 $R50 --steps 30 --compile --augment cpu gpu decode --e2e-workers 4 --lincls
# shellcheck disable=SC2086
bench symmetric 150 $R50 --steps 20 --compile --symmetric --augment decode
# shellcheck disable=SC2086
bench imagenet_eager 120 $R50 --steps 20 --augment gpu decode

for name in cifar_graph cifar_no_graph imagenet symmetric imagenet_eager; do
    [ -f "$LOG/$name.log" ] && { echo "### $name"; sed -n '/^| measurement/,$p' "$LOG/$name.log"; }
done
echo
echo "| run | status | seconds |"
echo "|---|---|---|"
printf '%s\n' "${ROWS[@]}"
echo "total $(( $(date +%s) - START )) s"
(( ${#FAILED[@]} == 0 )) || { echo "FAILED: ${FAILED[*]}"; exit 1; }
(( ${#SKIPPED[@]} == 0 )) || { echo "NOT RUN (budget): ${SKIPPED[*]}: raise BUDGET_S or run them alone"; exit 2; }
