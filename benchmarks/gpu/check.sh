#!/usr/bin/env bash
# The GPU correctness check on one H100 / H200: what only a GPU runs (the CUDA graph, the compiled default path,
# preloading there, nvJPEG, fp16's GradScaler) does what the CPU tests show for its CPU stand-ins. The checks that
# compile nothing come first; the CIFAR-10 runs are bounded by Inductor's cold compile (the first run's limit).
# A table at the end; exit 1 naming the checks that failed, 2 when the budget (BUDGET_S, default 420) left a
# check out. Each call starts afresh (LOG_DIR's runs are removed). The performance rows are benchmarks/gpu/bench.sh.
#   bash benchmarks/gpu/check.sh [LOG_DIR]        (default LOG_DIR: runs/gpu_check)
# 1. graph_equals_eager: 8 steps of RECIPES.md's CIFAR-10 model as a CUDA graph give the eager step's numbers; so
#    do the linear probe's steps (its trunk eager, then compiled).
# 2. decode_pixels: the GPU's JPEG decoder against libjpeg-turbo.
# 3-5. fp16 with LARS (GradScaler, --no-compile) on the demo's digits: 1 epoch, resumed, checked.
# 6-8. cifar_*: main_pretrain.py on CIFAR-10 with the defaults of a GPU (preloaded, compiled, CUDA graph) and the
#   recipe's flags, bf16: 1 epoch, then resumed for a 2nd, with the kNN monitor; checked (finite, trained, position).
# 9-10. main_lincls.py: 2 epochs of the linear probe, then --knn, whose top-1 must be the monitor's.
# CIFAR-10: data/cifar10/{train,val} in the checkout, or unpacked here from data/cifar10-jpeg.tar.gz (carried:
# 20 MB); without it, the cifar_* checks are left out and the exit is 2.
set -u
LOG=$(realpath -m "${1:-$(dirname "$0")/../../runs/gpu_check}")  # a path given is the caller's, not the repo's
cd "$(dirname "$0")/../.."
mkdir -p "$LOG"
BUDGET_S=${BUDGET_S:-420}
rm -rf "$LOG"/{cifar,cifar_lincls,cifar_knn,fp16,checks.log}  # a rerun checks again: no run found complete
# shellcheck source=benchmarks/gpu/lib.sh
source benchmarks/gpu/lib.sh  # PYTHON, RECIPE, CIFAR, check, finish
unpack_cifar

gpu_name | tee "$LOG/checks.log"
"$PYTHON" -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)" \
    | tee -a "$LOG/checks.log"
check graph_equals_eager 90 "$PYTHON" benchmarks/checks/check_graph.py
check decode_pixels 30 "$PYTHON" benchmarks/checks/check_decode.py
# the demo's ImageFolder (scikit-learn's digits, 1437 train images): fp16 through GradScaler and LARS, batch 56
DIGITS=$LOG/digits
"$PYTHON" -c "import sys; from sce.data import digits_imagefolder; digits_imagefolder(sys.argv[1])" "$DIGITS" \
    >> "$LOG/checks.log" 2>&1
FP16="main_pretrain.py --data $DIGITS --arch resnet18 --small-input --crop-size 16 --proj-hidden-dims 512
      --batch-size 56 --queue-size 4032 --epochs 2 --amp fp16 --optimizer lars --no-compile --print-freq 5
      --output-dir $LOG/fp16"
# shellcheck disable=SC2086
check fp16_epoch1 30 "$PYTHON" $FP16 --stop-after-epochs 1
# shellcheck disable=SC2086
check fp16_resumed 30 "$PYTHON" $FP16
# GradScaler skips its first steps while it lowers its scale
check fp16_checked 15 "$PYTHON" benchmarks/checks/check_run.py "$LOG/fp16" --epoch 2 --step 50 --max-skipped 10
if [ -d "$CIFAR/train" ]; then
    # RECIPES.md's CIFAR-10 setting, 2 epochs, the kNN monitor after each
    RUN="main_pretrain.py --data $CIFAR --knn-data $CIFAR $RECIPE --epochs 2 --amp bf16 --channels-last --print-freq 50
         --output-dir $LOG/cifar"
    # shellcheck disable=SC2086
    check cifar_epoch1 240 "$PYTHON" $RUN --stop-after-epochs 1
    # shellcheck disable=SC2086
    check cifar_resumed 120 "$PYTHON" $RUN
    check cifar_lincls 90 "$PYTHON" main_lincls.py --data "$CIFAR" --pretrained "$LOG/cifar/checkpoint_last.pth" \
        --epochs 2 --output-dir "$LOG/cifar_lincls"
    check cifar_knn 60 "$PYTHON" main_lincls.py --data "$CIFAR" --pretrained "$LOG/cifar/checkpoint_last.pth" --knn \
        --output-dir "$LOG/cifar_knn"
    check cifar_checked 20 "$PYTHON" benchmarks/checks/check_run.py "$LOG/cifar" --epoch 2 --knn "$LOG/cifar_knn/results_knn.json"
else
    NOT_RUN+=("cifar (no data/cifar10 nor data/cifar10-jpeg.tar.gz)")
fi

echo
grep -h "=> data:\|=> preloaded\|first step took\|CUDA graph from\|Epoch \[2/2\]\[195/195\]" "$LOG"/cifar_*.log \
    2>/dev/null | sed "s/^/cifar: /"
grep -h "Acc@1" "$LOG"/cifar_lincls.log "$LOG"/cifar_knn.log 2>/dev/null | tail -2 | sed "s/^/cifar: /"
for name in graph_equals_eager cifar_checked fp16_checked decode_pixels; do
    [ -f "$LOG/$name.log" ] && tail -3 "$LOG/$name.log" | sed "s/^/$name: /"
done
grep -h "augmentation failed\|capture of the training step failed\|compile.*failed" "$LOG"/*.log | sort -u | head -3
finish
