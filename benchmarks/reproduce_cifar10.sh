#!/usr/bin/env bash
# The paper's CIFAR-10 column: benchmarks/reproduce.sh cifar10 (its header has the options).
exec bash "$(dirname "$0")/reproduce.sh" cifar10 "$@"
