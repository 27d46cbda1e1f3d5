#!/usr/bin/env bash
# Every GPU check of the project in one run on one lent GPU, in under 8 minutes; a summary table at the end;
# exit 1 naming the checks that failed, 2 when the budget (BUDGET_S) left a verification out.
#   bash benchmarks/gpu_check.sh [LOG_DIR]        (default LOG_DIR: runs/gpu_check)
# CIFAR-10 (data/cifar10/{train,val} in the checkout when present, or unpacked here from data/cifar10-jpeg.tar.gz;
# else the benchmark's random images and no CIFAR script checks), RECIPES.md's setting (ResNet-18 small-input,
# batch 256, split BN 8, queue 4096, bf16, channels_last, compiled):
#   1. bench_cifar: the step, as a CUDA graph, and end to end from preloaded images, beside the supervised and
#      ideal-asymmetric references; 2. bench_cifar_eager: the same without the graph;
#   3. cifar_pretrain_*: main_pretrain.py, 1 epoch, stopped and resumed for a 2nd (preload + graph), then checked
#      (finite losses, position); 4. cifar_lincls / cifar_knn: 2 epochs of the linear probe, the kNN, preloaded.
# 5. decode_pixels: the GPU's JPEG decoder against libjpeg-turbo.
# The demo's digits (eager, --no-compile: these check correctness): 6-7. main_pretrain.py 50 steps in fp16 (LARS)
#   and bf16 (SGD), each stopped after an epoch, resumed and checked; 8. main_lincls.py for 3 epochs, above chance.
#   (--sync-bn needs 2 GPUs: one process has no peer to synchronise with, and its BN is plain.)
# ResNet-50 at 224 px, the default flags (compiled), what the budget leaves: 9. bench_imagenet: asymmetric, loader
#   pipelines cpu / gpu / decode (JPEGs decoded on the GPU), also with 4 loader workers, main_lincls.py's training
#   and feature extraction against a no-grad forward; 10. bench_symmetric; 11. bench_eager (not compiled).
set -u
LOG=$(realpath -m "${1:-$(dirname "$0")/../runs/gpu_check}")  # a path given is the caller's, not the repo's
cd "$(dirname "$0")/.."
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
WORKERS=$(( $(nproc) - 1 ))
BUDGET_S=${BUDGET_S:-470}
START=$(date +%s)
ROWS=()
FAILED=()
NOT_RUN=()  # verifications (*_checked, *_chance, decode_pixels) the budget left out: the run proves less

# check NAME LIMIT_S CMD...: runs CMD under LIMIT_S, or skips it when the budget has less left (a check cut
# short would read as a failure)
check() {
    local name=$1 limit=$2 left t0 rc status
    shift 2
    left=$(( BUDGET_S - ($(date +%s) - START) ))
    if (( left < limit )); then
        ROWS+=("| $name | skipped (budget: ${left}s left) | 0 |")
        [[ $name == *_checked || $name == *_chance || $name == decode_pixels ]] && NOT_RUN+=("$name")
        return
    fi
    echo "=== $name: $*" | tee -a "$LOG/checks.log"
    t0=$(date +%s)
    timeout -k 15 "$limit" "$@" > "$LOG/$name.log" 2>&1  # SIGTERM (a run saves and stops), SIGKILL 15 s later
    rc=$?
    cat "$LOG/$name.log" >> "$LOG/checks.log"
    case $rc in
        0) status=ok ;;
        124|137) status="TIMEOUT after ${limit}s" ;;
        *) status="FAILED ($rc): $(tail -1 "$LOG/$name.log" | cut -c1-100)" ;;
    esac
    [ "$status" = ok ] || FAILED+=("$name")
    ROWS+=("| $name | $status | $(( $(date +%s) - t0 )) |")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG/checks.log"
python -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)" | tee -a "$LOG/checks.log"

CIFAR=data/cifar10
if [ ! -d "$CIFAR/train" ] && [ -f data/cifar10-jpeg.tar.gz ]; then  # the archive travels (20 MB), not its 240 MB
    mkdir -p "$CIFAR" && tar -xzf data/cifar10-jpeg.tar.gz -C "$CIFAR"
fi
SMALL="--arch resnet18 --small-input --crop-size 32 --batch-size 256 --queue-size 4096 --shuffle-bn --bn-splits 8
       --proj-hidden-dims 512 --proj-dim 256 --proj-last-bn none --amp bf16 --channels-last"
R50="--arch resnet50 --batch-size 256 --crop-size 224 --amp bf16 --channels-last --workers $WORKERS"
NET="--arch resnet50 --crop-size 96"
STEPS=(--steps 30) STEPS_SHORT=(--steps 20) CIFAR_STEPS=(--steps 50 --warmup 5) AMPS="fp16 bf16"
CIFAR_RUN="--epochs 2 --lr 0.06 --weight-decay 5e-4 --ema-schedule constant --ema-momentum 0.99 --tau 0.2 --tau-m 0.1"
if [ "${SMOKE:-0}" = 1 ]; then  # tiny sizes, to try this script on a machine without a GPU
    SMALL="--arch resnet18 --small-input --crop-size 16 --batch-size 16 --queue-size 64 --shuffle-bn --bn-splits 4
           --proj-hidden-dims 64 --proj-dim 32 --proj-last-bn none --workers 0"
    R50="--arch resnet18 --small-input --batch-size 8 --crop-size 32 --queue-size 64 --images 16 --workers $WORKERS"
    NET="--arch resnet18 --small-input --crop-size 16 --proj-hidden-dims 64"
    STEPS=(--steps 2 --warmup 1) STEPS_SHORT=(--steps 2 --warmup 1) CIFAR_STEPS=(--steps 2 --warmup 1)
    CIFAR=none  # 50,000 images are not for a CPU
    AMPS=bf16  # fp16 convolutions crawl on a CPU
fi
GRAPH=$([ "${SMOKE:-0}" = 1 ] || echo --cuda-graph)  # the benchmark refuses a graph on a CPU
COMPILE=$([ "${SMOKE:-0}" = 1 ] || echo --compile)  # the default of main_pretrain.py on a GPU; minutes on a CPU
BENCH_DATA=$([ -d "$CIFAR/train" ] && echo "--data $CIFAR/train")
# shellcheck disable=SC2086
check bench_cifar 150 python benchmarks/bench_pretrain.py $SMALL $BENCH_DATA --preload $GRAPH $COMPILE --skip-data \
    "${CIFAR_STEPS[@]}" --profile
# shellcheck disable=SC2086
check bench_cifar_eager 120 python benchmarks/bench_pretrain.py $SMALL $BENCH_DATA --preload $COMPILE --skip-data \
    "${CIFAR_STEPS[@]}"
if [ -d "$CIFAR/train" ]; then
    # shellcheck disable=SC2086
    check cifar_pretrain_epoch1 100 python main_pretrain.py --data "$CIFAR" $SMALL $CIFAR_RUN --stop-after-epochs 1 \
        --print-freq 50 --output-dir "$LOG/cifar"
    # shellcheck disable=SC2086
    check cifar_pretrain_resumed 80 python main_pretrain.py --data "$CIFAR" $SMALL $CIFAR_RUN --print-freq 50 \
        --output-dir "$LOG/cifar"
    check cifar_pretrain_checked 30 python benchmarks/check_run.py "$LOG/cifar" --epoch 2
    check cifar_lincls 60 python main_lincls.py --data "$CIFAR" --pretrained "$LOG/cifar/checkpoint_last.pth" \
        --epochs 2 --output-dir "$LOG/cifar_lincls"
    check cifar_knn 40 python main_lincls.py --data "$CIFAR" --pretrained "$LOG/cifar/checkpoint_last.pth" --knn \
        --output-dir "$LOG/cifar_knn"
fi

DECODE_CHECK=$([ "${SMOKE:-0}" = 1 ] && echo "--device cpu --images 8")
# shellcheck disable=SC2086
check decode_pixels 60 python benchmarks/check_decode.py $DECODE_CHECK

# the demo's ImageFolder (scikit-learn's digits; 1437 train / 360 val images) for the script checks
DATA=$LOG/digits
python -c "import sys; from sce.loader import digits_imagefolder; digits_imagefolder(sys.argv[1])" "$DATA" \
    >> "$LOG/checks.log" 2>&1
# batch 56: 25 steps an epoch, 2 epochs = 50 steps, stopped after the first and resumed
RUN="main_pretrain.py --data $DATA $NET --batch-size 56 --queue-size 4032 --epochs 2 --workers $WORKERS
     --channels-last --print-freq 5 --no-compile"
for amp in $AMPS; do
    optimizer=$([ $amp = fp16 ] && echo lars || echo sgd)  # fp16: GradScaler's skipped steps through LARS
    check "pretrain_${amp}_epoch1" 90 python $RUN --amp $amp --optimizer $optimizer --output-dir "$LOG/$amp" \
        --stop-after-epochs 1
    check "pretrain_${amp}_resumed" 90 python $RUN --amp $amp --optimizer $optimizer --output-dir "$LOG/$amp"
    # fp16: GradScaler skips its first steps while it lowers its scale
    check "pretrain_${amp}_checked" 30 python benchmarks/check_run.py "$LOG/$amp" --epoch 2 --step 50 \
        --max-skipped "$([ $amp = fp16 ] && echo 10 || echo 0)"
done
check lincls_3_epochs 60 python main_lincls.py --data "$DATA" --pretrained "$LOG/bf16/checkpoint_last.pth" \
    --epochs 3 --batch-size 64 --workers "$WORKERS" --no-compile --output-dir "$LOG/lincls"
# 10 classes: chance is 10% (SMOKE=1 on 2 CPU cores, a 2-epoch ResNet-18: 26%)
check lincls_above_chance 20 python -c "import json, sys; acc = json.load(open(sys.argv[1]))['acc1']; print('Acc@1', acc);
sys.exit(acc <= 15)" "$LOG/lincls/results_linear.json"

# shellcheck disable=SC2086
check bench_imagenet 300 python benchmarks/bench_pretrain.py $R50 "${STEPS[@]}" $COMPILE --augment cpu gpu decode \
    --e2e-workers 4 --lincls --profile
# shellcheck disable=SC2086
check bench_symmetric 150 python benchmarks/bench_pretrain.py $R50 "${STEPS_SHORT[@]}" $COMPILE --symmetric \
    --augment decode
# shellcheck disable=SC2086
check bench_eager 120 python benchmarks/bench_pretrain.py $R50 "${STEPS_SHORT[@]}" --augment gpu decode

echo
echo "## benchmark tables"
for name in bench_cifar bench_cifar_eager bench_imagenet bench_symmetric bench_eager; do
    [ -f "$LOG/$name.log" ] && { echo "### $name"; sed -n '/^| measurement/,$p' "$LOG/$name.log"; }
done
echo
echo "## script checks"
grep -h "=> preloaded\|CUDA graph\|compiling took\|Epoch \[2/2\]\[.*/195\]" "$LOG"/cifar_pretrain_*.log 2>/dev/null | sed "s/^/cifar: /"
grep -h "Acc@1" "$LOG"/cifar_lincls.log "$LOG"/cifar_knn.log 2>/dev/null | tail -2 | sed "s/^/cifar: /"
for name in decode_pixels cifar_pretrain_checked pretrain_fp16_checked pretrain_bf16_checked lincls_above_chance; do
    [ -f "$LOG/$name.log" ] && sed "s/^/$name: /" "$LOG/$name.log"
done
grep -h "augmentation failed\|capture of the training step failed" "$LOG"/*.log | sort -u | head -3  # fell back
echo
echo "| check | status | seconds |"
echo "|---|---|---|"
printf '%s\n' "${ROWS[@]}"
echo "total $(( $(date +%s) - START )) s"
if (( ${#FAILED[@]} )); then
    echo "FAILED: ${FAILED[*]}"
    exit 1
fi
if (( ${#NOT_RUN[@]} )); then
    echo "NOT RUN (budget): ${NOT_RUN[*]}: raise BUDGET_S or run them alone"
    exit 2
fi
