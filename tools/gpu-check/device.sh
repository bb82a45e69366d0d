#!/usr/bin/env bash
# Unpacks one archive that stage.sh packed (target/gpu-check/carry/nccl-<v>.tar.xz)
# into a scratch directory and runs the GPU check from it (run.sh). Meant for
# the device machine, from the repository root, with the archive carried:
#   tools/gpu-check/device.sh target/gpu-check/carry/nccl-2.32.3.tar.xz
set -euo pipefail
archive=${1:?usage: device.sh target/gpu-check/carry/nccl-<version>.tar.xz}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
tar -C "$dir" -xJf "$archive"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || true
"$dir/run.sh"
