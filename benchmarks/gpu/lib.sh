# What the GPU machine's scripts share (sourced by benchmarks/gpu/*.sh after `cd` to the repository):
#   PYTHON               the interpreter (python, else python3), output unbuffered
#   RECIPE               the CIFAR-10 row's flags (python -m sce.recipes cifar10 --flags: sce/recipes.py, their one
#                        copy; --dataset left out, the data here being an ImageFolder)
#   unpack_cifar         data/cifar10/{train,val} from data/cifar10-jpeg.tar.gz where missing (carry the archive
#                        alone, 20 MB; unpacked it is 237 MB); returns 1 when neither is there
#   limit_s ARG          LIMIT_S checked (whole seconds), in $LIMIT, or exit 2
#   machine DEST         DEST/machine.txt (the GPU, torch, the commit: COMMIT where the copy has no .git) and
#                        nvidia-smi sampled every 2 s into DEST/nvidia-smi.csv in the background ($sampler)
#   join DEST_FILE FILE...   the files that exist, each after a '##### path' line, into one (the device tool
#                        brings back 8 files at most)
#   check NAME LIMIT_S CMD..., finish   a table of checks within BUDGET_S (LOG: where their logs go)
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
START=${START:-$SECONDS}
RECIPE=$("$PYTHON" -m sce.recipes cifar10 --flags)
ROWS=() FAILED=() NOT_RUN=()
CIFAR=data/cifar10

unpack_cifar() {
    [ -d "$CIFAR/train" ] && return 0
    [ -f data/cifar10-jpeg.tar.gz ] || return 1
    mkdir -p "$CIFAR" && tar -xzf data/cifar10-jpeg.tar.gz -C "$CIFAR"
}

limit_s() {
    [[ ${1:-} =~ ^[0-9]{1,6}$ ]] || { echo "error: LIMIT_S is whole seconds (got '${1:-}')" >&2; exit 2; }
    LIMIT=$(( 10#$1 ))
}

gpu_name() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
}

machine() {
    unpack_cifar || return 1
    { gpu_name
      "$PYTHON" -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
      echo "commit ${COMMIT:-$(git log --oneline -1 2>/dev/null || echo 'unknown (no .git here: pass COMMIT=)')}"
    } > "$1/machine.txt" 2>&1
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,clocks.sm,power.draw --format=csv -l 2 \
        >> "$1/nvidia-smi.csv" 2>/dev/null &
    sampler=$!
}

join() {
    local dest=$1 f
    shift
    for f in "$@"; do [ -f "$f" ] && { echo "##### $f"; cat "$f"; }; done > "$dest"
}

# check NAME LIMIT_S CMD...: CMD under LIMIT_S, its output in $LOG/NAME.log and $LOG/checks.log; skipped when the
# budget has less left (a run cut short would read as a failure), and when ONLY (names, blank-separated) omits it
check() {
    local name=$1 limit=$2 left t0 rc status
    shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
        return
    fi
    left=$(( BUDGET_S - (SECONDS - START) ))
    if (( left < limit )); then
        ROWS+=("| $name | skipped (budget: ${left}s left) | 0 |")
        NOT_RUN+=("$name")
        return
    fi
    echo "=== $name: $*" | tee -a "$LOG/checks.log"
    t0=$SECONDS
    timeout -k 15 "$limit" "$@" > "$LOG/$name.log" 2>&1  # SIGTERM (a run saves and stops), SIGKILL 15 s later
    rc=$?
    cat "$LOG/$name.log" >> "$LOG/checks.log"
    case $rc in
        0) status=ok ;;
        124|137) status="TIMEOUT after ${limit}s" ;;
        *) status="FAILED ($rc): $(tail -1 "$LOG/$name.log" | cut -c1-100)" ;;
    esac
    [ "$status" = ok ] || FAILED+=("$name")
    ROWS+=("| $name | $status | $(( SECONDS - t0 )) |")
}

# the table of the checks; exit 1 naming those that failed, 2 those the budget left out
finish() {
    echo
    echo "| check | status | seconds |"
    echo "|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    echo "total $(( SECONDS - START )) s"
    if (( ${#FAILED[@]} )); then
        echo "FAILED: ${FAILED[*]}"
        exit 1
    fi
    if (( ${#NOT_RUN[@]} )); then
        echo "NOT RUN: ${NOT_RUN[*]}: raise BUDGET_S or run them alone"
        exit 2
    fi
}
