#!/usr/bin/env bash
# The GPU performance rows on one H100 / H200, as far as the budget goes (BUDGET_S, default 290; a cold Inductor
# compile is most of each run): rows of benchmarks/speed/bench_pretrain.py and bench_lincls.py (JSON lines, then a table;
# docs/benchmarks.md says what each means). Exit 1 naming a run that failed, 2 when the budget left one out.
#   bash benchmarks/gpu/bench.sh [LOG_DIR]        (default LOG_DIR: runs/gpu_bench)
# 1. cifar_graph / cifar_no_graph: RECIPES.md's CIFAR-10 setting (--recipe cifar10: ResNet-18 small-input, batch
#    256, the paper's BN split in 2; bf16, channels_last, compiled), the step as a CUDA graph and without one, end
#    to end from preloaded images, beside the supervised and ideal-asymmetric references (data/cifar10 when
#    present, else random images); cifar_graph also with the online probe (its share of the step).
# 2. imagenet: ResNet-50 at 224 px, the defaults (compiled): the loader pipelines cpu / gpu / decode, also with
#    4 workers; lincls: main_lincls.py's training and feature extraction against a no-grad forward
#    (bench_lincls.py).
# 3. symmetric: the same step with both global views as targets; 4. imagenet_eager: not compiled.
# 5. cifar_blocks: cifar_graph with each residual block compiled apart: its cold compile (first_step_s) against
#    cifar_graph's whole trunks (the warm Inductor cache of cifar_graph does not serve it: other graphs).
# 6. cifar_graph_eager: cifar_graph without compiling (the CUDA graph of eager kernels): what the compile buys
#    per step against what it costs cold (74 s of a CIFAR-10 stage on an H200).
# ONLY="cifar_graph cifar_blocks cifar_graph_eager" runs those rows only (lib.sh's check).
set -u
LOG=$(realpath -m "${1:-$(dirname "$0")/../../runs/gpu_bench}")
cd "$(dirname "$0")/../.."
mkdir -p "$LOG"
BUDGET_S=${BUDGET_S:-290}
# shellcheck source=benchmarks/gpu/lib.sh
source benchmarks/gpu/lib.sh  # PYTHON, CIFAR, check, finish
unpack_cifar
gpu_name | tee "$LOG/checks.log"
SMALL="--recipe cifar10 --amp bf16 --channels-last --compile --preload --skip-data --steps 50 --warmup 5
       $([ -d "$CIFAR/train" ] && echo "--data $CIFAR/train")"
R50="--arch resnet50 --batch-size 256 --crop-size 224 --amp bf16 --channels-last --workers $(( $(nproc) - 1 ))"
# shellcheck disable=SC2086
check cifar_graph 200 "$PYTHON" benchmarks/speed/bench_pretrain.py $SMALL --cuda-graph --profile --online-probe
# shellcheck disable=SC2086
check cifar_no_graph 120 "$PYTHON" benchmarks/speed/bench_pretrain.py $SMALL
# shellcheck disable=SC2086
check imagenet 200 "$PYTHON" benchmarks/speed/bench_pretrain.py $R50 --steps 30 --compile --augment cpu gpu decode \
    --e2e-workers 4
check lincls 150 "$PYTHON" benchmarks/speed/bench_lincls.py --arch resnet50 --amp bf16 --compile
# shellcheck disable=SC2086
check symmetric 150 "$PYTHON" benchmarks/speed/bench_pretrain.py $R50 --steps 20 --compile --symmetric --augment decode
# shellcheck disable=SC2086
check imagenet_eager 120 "$PYTHON" benchmarks/speed/bench_pretrain.py $R50 --steps 20 --augment gpu decode
# shellcheck disable=SC2086
check cifar_blocks 200 "$PYTHON" benchmarks/speed/bench_pretrain.py $SMALL --cuda-graph --compile-blocks
# shellcheck disable=SC2086
check cifar_graph_eager 90 "$PYTHON" benchmarks/speed/bench_pretrain.py ${SMALL/--compile /} --cuda-graph

for name in cifar_graph cifar_no_graph imagenet lincls symmetric imagenet_eager cifar_blocks cifar_graph_eager; do
    [ -f "$LOG/$name.log" ] && { echo "### $name"; sed -n '/^| measurement/,$p' "$LOG/$name.log"; }
done
finish
