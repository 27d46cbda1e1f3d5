# What gpu_check.sh and gpu_bench.sh share (sourced, after `cd` to the repository, LOG and BUDGET_S set): the
# interpreter, CIFAR-10 unpacked from data/cifar10-jpeg.tar.gz, and `check`, which runs a command within the
# time budget, and `finish`, which prints the table and exits 1 naming what failed, 2 what the budget left out.
export PYTHONUNBUFFERED=1
PY=${PYTHON:-$(command -v python || command -v python3)}  # python, else python3
START=$(date +%s)
ROWS=() FAILED=() NOT_RUN=()
CIFAR=data/cifar10
if [ ! -d "$CIFAR/train" ] && [ -f data/cifar10-jpeg.tar.gz ]; then  # the archive travels (20 MB), its files not
    mkdir -p "$CIFAR" && tar -xzf data/cifar10-jpeg.tar.gz -C "$CIFAR"
fi

# check NAME LIMIT_S CMD...: CMD under LIMIT_S, its output in $LOG/NAME.log and $LOG/checks.log; skipped when the
# budget has less left (a run cut short would read as a failure), and when ONLY (names, blank-separated) omits it
check() {
    local name=$1 limit=$2 left t0 rc status
    shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
        return
    fi
    left=$(( BUDGET_S - ($(date +%s) - START) ))
    if (( left < limit )); then
        ROWS+=("| $name | skipped (budget: ${left}s left) | 0 |")
        NOT_RUN+=("$name")
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

finish() {
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
        echo "NOT RUN: ${NOT_RUN[*]}: raise BUDGET_S or run them alone"
        exit 2
    fi
}
