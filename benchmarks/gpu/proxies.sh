#!/usr/bin/env bash
# One GPU command of the CIFAR-10 proxies (benchmarks/fidelity/proxies.py: 30-epoch runs of the row's setting, one a variant)
# under a time limit, nvidia-smi sampled every 2 s, the logs copied to OUT in four files (machine.txt,
# nvidia-smi.csv, proxies.txt: the runner's output with its JSON lines and table, variants.log: each variant's
# output). Run it again at once with the time left: the proxies finished are read back, a stopped one resumes
# (runs/ stays while the machine is held; a fresh machine starts them again).
#   bash benchmarks/gpu/proxies.sh LIMIT_S [OUT]    (OUT: default $OUT, else runs/gpu_out; VARIANTS: some of
#                                                   proxies.py's, in its order by default; DRY_RUN=1: print the
#                                                   commands, run none; COMMIT: the commit to record, where the
#                                                   copy has no .git)
# LIMIT_S counts from this script's start (the unpack included): no variant starts that the median of those
# finished would not fit in, the running one is asked to save and stop at the limit, killed 30 s later; give the
# command LIMIT_S + 60 s. The variants share proxies.py's compile caches (runs/proxies/compile_cache). The data:
# data/cifar10/{train,val}, or unpacked here from data/cifar10-jpeg.tar.gz (carry that file alone, 20 MB); the
# re-encoded copies are made here (runs/proxies/data-qN).
set -u
START=$SECONDS
DEST=$(realpath -m "${2:-${OUT:-runs/gpu_out}}")  # a path given is the caller's
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/gpu/lib.sh
source benchmarks/gpu/lib.sh  # PYTHON, limit_s, machine, join
limit_s "${1:-}"
mkdir -p "$DEST"
variants=(); [ -n "${VARIANTS:-}" ] && read -r -a variants <<< "--variants $VARIANTS"
machine "$DEST" || exit 1  # the data unpacked, machine.txt, nvidia-smi sampled ($sampler)
if [ "${DRY_RUN:-0}" = 1 ]; then
    kill "$sampler" 2>/dev/null
    exec "$PYTHON" benchmarks/fidelity/proxies.py --data data/cifar10 --out runs/proxies --dry-run ${variants[@]+"${variants[@]}"}
fi
left=$(( LIMIT - (SECONDS - START) ))  # the unpack counted; spent, 1 s (0 would be proxies.py's "no limit")
"$PYTHON" benchmarks/fidelity/proxies.py --data data/cifar10 --out runs/proxies --time-limit $(( left > 0 ? left : 1 )) \
    ${variants[@]+"${variants[@]}"} 2>&1 | tee -a "$DEST/proxies.txt"
code=${PIPESTATUS[0]}
kill "$sampler" 2>/dev/null
join "$DEST/variants.log" runs/proxies/*.log
echo "exit $code" | tee -a "$DEST/proxies.txt"
exit "$code"
