#!/usr/bin/env bash
# One stretch of GPU time on the CIFAR-10 column: reproduce.sh for METHODS under a time limit, nvidia-smi sampled
# every 2 s, and what matters copied to $OUT (the device tool brings back at most 8 files: five, and the trunk of
# the first finished method in three parts). Run it again at once with the time left: reproduce.sh continues where
# the limit stopped it (runs/ stays while the machine is held).
#   bash benchmarks/gpu/reproduce.sh LIMIT_S [OUT]    (METHODS: default "sce moco"; OUT: default $OUT, else runs/gpu_out;
#                                                     RUNS: reproduce.sh's OUT_DIR, default runs/repro;
#                                                     COMMIT: the commit to record, where the copy has no .git)
# LIMIT_S counts from this script's start (the unpack included); the stop, its 20 s of grace and the trunk's export
# come after it: give the command about LIMIT_S + 60 s. The data: data/cifar10/{train,val}, or unpacked here from
# data/cifar10-jpeg.tar.gz (carry that file alone, 20 MB: an unpacked data/cifar10 is 237 MB).
set -u
START=$SECONDS
DEST=$(realpath -m "${2:-${OUT:-runs/gpu_out}}")  # a path given is the caller's
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/gpu/lib.sh
source benchmarks/gpu/lib.sh  # PYTHON, limit_s, machine, join
limit_s "${1:-}"
mkdir -p "$DEST"
export METHODS=${METHODS:-sce moco} PYTHON
RUNS=${RUNS:-runs/repro}
machine "$DEST" || exit 1  # the data unpacked, machine.txt, nvidia-smi sampled ($sampler)
# SIGTERM to reproduce.sh at the limit: it hands it to the running stage, which saves and stops while the display
# goes on showing its lines (the script then exits 75); 20 s later, if it has not ended, SIGKILL to its children
# (the stage, the display) and to it. Not `timeout`, which signals the display too.
: > "$DEST/reproduce.txt"  # there before tail opens it
left=$(( LIMIT - (SECONDS - START) ))  # the unpack and the checks above counted
if (( left < 1 )); then
    echo "=> gpu/reproduce.sh: the limit of $LIMIT s was spent before reproduce.sh started" \
        | tee -a "$DEST/reproduce.txt"
    kill "$sampler" 2>/dev/null
    exit 75
fi
bash benchmarks/reproduction/reproduce.sh cifar10 data/cifar10 "$RUNS" >> "$DEST/reproduce.txt" 2>&1 &
repro=$!
tail -n +1 -f --pid="$repro" "$DEST/reproduce.txt" &
( sleep "$left" && {
  echo "=> gpu/reproduce.sh: the limit of $LIMIT s: stopping" >> "$DEST/reproduce.txt"
  kill -TERM "$repro"; sleep 20 && { pkill -KILL -P "$repro"; kill -KILL "$repro"; }; } ) 2>/dev/null &
watchdog=$!
wait "$repro"
code=$?
pkill -P "$watchdog" 2>/dev/null; kill "$watchdog" "$sampler" 2>/dev/null  # the sleeps end, and the chain with them
wait 2>/dev/null  # tail shows the last lines
# each stage's whole output, then each run's log.txt, time split and estimate (concatenated: 8 files at most)
join "$DEST/stages.log" "$RUNS"/*.log
join "$DEST/runs.txt" "$RUNS"/*/{log.txt,timing.txt,estimate.json} \
    "$RUNS"/*/linear/{log.txt,timing.txt,results_linear.json} "$RUNS"/times
[ -f "$RUNS/results.md" ] && { echo "##### $RUNS/results.md"; cat "$RUNS/results.md"; } >> "$DEST/runs.txt"
# the trunk of the first finished method (fp32, ~45 MB for a ResNet-18) in three parts of at most 15 MiB, for the
# analyses a CPU can do with it (features without augmentation, the probe's optimiser against the convex optimum):
#   cat trunk.pth.part-* > trunk.pth
# only where the parts fit in the 8 files beside what OUT holds (a caller's own file there would push one out)
for method in $METHODS; do
    ckpt=$RUNS/$method/checkpoint_last.pth
    [ -f "$RUNS/$method/linear/results_linear.json" ] && [ -f "$ckpt" ] || continue
    rm -rf "$RUNS/trunk_parts" && mkdir -p "$RUNS/trunk_parts"
    "$PYTHON" -c "import sys, torch; from sce.checkpoint import load, trunk_state_dict
torch.save(trunk_state_dict(load(sys.argv[1])), sys.argv[2])" "$ckpt" "$RUNS/trunk_$method.pth" \
        && split -b 15M "$RUNS/trunk_$method.pth" "$RUNS/trunk_parts/trunk_$method.pth.part-" || break
    held=$(find "$DEST" -maxdepth 1 -type f | wc -l) parts=$(find "$RUNS/trunk_parts" -type f | wc -l)
    if (( held + parts <= 8 )); then
        mv "$RUNS"/trunk_parts/* "$DEST/"
    else
        echo "=> $RUNS/trunk_$method.pth not copied: its $parts parts and the $held files in OUT pass the 8 the" \
            "device tool brings back" | tee -a "$DEST/reproduce.txt"
    fi
    break
done
echo "exit $code" | tee -a "$DEST/reproduce.txt"
exit "$code"
