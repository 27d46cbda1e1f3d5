#!/usr/bin/env bash
# Every GPU check of the project in one run on one lent GPU, in under 8 minutes; a summary table at the end.
#   bash benchmarks/gpu_check.sh [LOG_DIR]        (default LOG_DIR: runs/gpu_check)
# 1-3: benchmarks/bench_pretrain.py at ResNet-50 224 px, batch 256, bf16, channels_last: asymmetric (also with
#      half the loader workers) and symmetric, CPU vs GPU augmentation, eager; then compiled (last: it compiles
#      for minutes).
# 4-5: main_pretrain.py 50 steps in fp16 (with LARS) and in bf16 (SGD) on the demo's digits ImageFolder, each
#      stopped after an epoch and resumed; 6: --sync-bn on one GPU under torchrun; 7: main_lincls.py for one epoch.
set -u
cd "$(dirname "$0")/.."
LOG=${1:-runs/gpu_check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
WORKERS=$(( $(nproc) - 1 ))
BUDGET_S=${BUDGET_S:-450}
START=$(date +%s)
ROWS=()

# check NAME LIMIT_S CMD...: runs CMD under the smaller of LIMIT_S and what is left of the budget
check() {
    local name=$1 limit=$2 left t0 rc
    shift 2
    left=$(( BUDGET_S - ($(date +%s) - START) ))
    (( left < limit )) && limit=$left
    if (( limit < 20 )); then ROWS+=("| $name | skipped (budget) | 0 |"); return; fi
    echo "=== $name: $*" | tee -a "$LOG/checks.log"
    t0=$(date +%s)
    timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
    rc=$?
    cat "$LOG/$name.log" >> "$LOG/checks.log"
    case $rc in 0) status=ok ;; 124) status="TIMEOUT after ${limit}s" ;; *) status="FAILED ($rc): $(tail -1 "$LOG/$name.log" | cut -c1-100)" ;; esac
    ROWS+=("| $name | $status | $(( $(date +%s) - t0 )) |")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG/checks.log"
python -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)" | tee -a "$LOG/checks.log"

# SMOKE=1: tiny sizes, to try this script on a machine without a GPU
R50="--arch resnet50 --batch-size 256 --crop-size 224 --amp bf16 --channels-last --workers $WORKERS"
NET="--arch resnet50 --crop-size 96"
STEPS=(--steps 30) STEPS_SHORT=(--steps 20)
if [ "${SMOKE:-0}" = 1 ]; then
    R50="--arch resnet18 --small-input --batch-size 8 --crop-size 32 --queue-size 64 --images 16 --workers $WORKERS"
    NET="--arch resnet18 --small-input --crop-size 16 --proj-hidden-dims 64"
    STEPS=(--steps 2 --warmup 1) STEPS_SHORT=(--steps 2 --warmup 1)
fi
# end to end again with half the workers: more cores left to the training process, if that is the limit
check bench_asymmetric 200 python benchmarks/bench_pretrain.py $R50 "${STEPS[@]}" --profile \
    --e2e-workers $(( (WORKERS + 1) / 2 ))
check bench_symmetric 120 python benchmarks/bench_pretrain.py $R50 "${STEPS_SHORT[@]}" --symmetric

# the demo's ImageFolder (scikit-learn's digits; 1437 train / 360 val images) for the script checks
DATA=$LOG/digits
python -c "import sys; from sce.loader import digits_imagefolder; digits_imagefolder(sys.argv[1])" "$DATA" \
    >> "$LOG/checks.log" 2>&1
# batch 56: 25 steps an epoch, 2 epochs = 50 steps, stopped after the first and resumed
RUN="main_pretrain.py --data $DATA $NET --batch-size 56 --queue-size 4032 --epochs 2 --workers $WORKERS
     --channels-last --print-freq 5"
for amp in fp16 bf16; do
    optimizer=$([ $amp = fp16 ] && echo lars || echo sgd)  # fp16: GradScaler's skipped steps through LARS
    check "pretrain_${amp}_epoch1" 90 python $RUN --amp $amp --optimizer $optimizer --output-dir "$LOG/$amp" \
        --stop-after-epochs 1
    check "pretrain_${amp}_resumed" 90 python $RUN --amp $amp --optimizer $optimizer --output-dir "$LOG/$amp"
done
check sync_bn_one_gpu 60 torchrun --standalone --nproc_per_node 1 $RUN --amp bf16 --sync-bn --epochs 1 \
    --output-dir "$LOG/syncbn"
check lincls_one_epoch 60 python main_lincls.py --data "$DATA" --pretrained "$LOG/bf16/checkpoint_last.pth" \
    --epochs 1 --batch-size 64 --workers "$WORKERS" --output-dir "$LOG/lincls"
check bench_compiled 240 python benchmarks/bench_pretrain.py $R50 "${STEPS_SHORT[@]}" --compile --augment gpu

echo
echo "## benchmark tables"
for name in bench_asymmetric bench_symmetric bench_compiled; do
    [ -f "$LOG/$name.log" ] && { echo "### $name"; sed -n '/^| measurement/,$p' "$LOG/$name.log"; }
done
echo
echo "## script checks"
for amp in fp16 bf16; do
    grep -h "resuming from\|Epoch \[2/2\]\[25/25\]" "$LOG/pretrain_${amp}_resumed.log" 2>/dev/null | sed "s/^/$amp: /"
done
grep -h "Acc@1" "$LOG/lincls_one_epoch.log" 2>/dev/null | tail -1 | sed "s/^/lincls: /"
grep -h "augmentation failed" "$LOG"/*.log | sort -u | head -3  # compiled augmentation fell back to eager
echo
echo "| check | status | seconds |"
echo "|---|---|---|"
printf '%s\n' "${ROWS[@]}"
echo "total $(( $(date +%s) - START )) s"
