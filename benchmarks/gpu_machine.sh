# What gpu_reproduce.sh and gpu_proxies.sh do first (sourced, after `cd` to the repository, PYTHON set):
# `machine DEST` unpacks CIFAR-10 from data/cifar10-jpeg.tar.gz where data/cifar10 lacks it (returns 1 if that
# fails), writes DEST/machine.txt (the GPU, torch, the commit: COMMIT, where the copy has no .git) and samples
# nvidia-smi every 2 s into DEST/nvidia-smi.csv, in the background (its PID in $sampler).
machine() {
    if [ ! -d data/cifar10/train ]; then
        mkdir -p data/cifar10 && tar -xzf data/cifar10-jpeg.tar.gz -C data/cifar10 || return 1
    fi
    { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
      "$PYTHON" -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
      echo "commit ${COMMIT:-$(git log --oneline -1 2>/dev/null || echo 'unknown (no .git here: pass COMMIT=)')}"
    } > "$1/machine.txt" 2>&1
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,clocks.sm,power.draw --format=csv -l 2 \
        >> "$1/nvidia-smi.csv" 2>/dev/null &
    sampler=$!
}
