#!/usr/bin/env bash
# Stages Weft's real-NCCL GPU check (docs/gpu.md) into
# target/gpu-check/: NCCL from the PyPI wheels (2.18.3, 2.23.4 and the
# newest, or WEFT_GPU_CHECK_NCCL="x.y.z ..."), the CUDA runtime from its
# wheel (its headers with the nvcc wheel's), libfabric 2.1 built here with
# CUDA loaded at run time, Weft's release .so built against it (and that
# library's own non-system dependencies), the check program built here
# against the wheels' headers, and run.sh. NCCL's device code is cut to the
# one GPU architecture of the target machine (WEFT_GPU_CHECK_ARCH, default 90:
# H100/H200) by fatbin.py, and its debug sections are stripped. Packs one
# archive per NCCL version, each with everything the check needs, into
# target/gpu-check/carry/ (a device run carries at most 64 MiB). Unpack one on
# a GPU machine and run its run.sh there (tools/gpu-check/device.sh does
# both). Prints what it staged and the archives' sizes.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=target/gpu-check
versions=${WEFT_GPU_CHECK_NCCL:-"2.18.3 2.23.4 2.32.3"}
cudart=${WEFT_GPU_CHECK_CUDART:-12.9.79}
nvcc=${WEFT_GPU_CHECK_NVCC:-12.9.86}
cccl=${WEFT_GPU_CHECK_CCCL:-12.9.27}
nvml=${WEFT_GPU_CHECK_NVML:-12.9.79}
arch=${WEFT_GPU_CHECK_ARCH:-90}
pipdl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
    --platform manylinux_2_18_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    --python-version 3.11 -d "$out/wheels" "$@"
}
rm -rf "$out/stage"
mkdir -p "$out/wheels" "$out/stage/lib" "$out/stage/bin" "$out/build"
pipdl "nvidia-cuda-runtime-cu12==$cudart" "nvidia-cuda-nvcc-cu12==$nvcc" "nvidia-cuda-cccl-cu12==$cccl"
unzip -q -o "$out"/wheels/nvidia_cuda_runtime_cu12-"$cudart"-*.whl 'nvidia/cuda_runtime/*' -d "$out/build"
# nccl.h includes cuda_runtime.h and cuda_fp16.h, which need the crt headers of
# the nvcc wheel and libcu++'s of the cccl wheel (headers only: nothing of them
# is staged).
unzip -q -o "$out"/wheels/nvidia_cuda_nvcc_cu12-"$nvcc"-*.whl 'nvidia/cuda_nvcc/include/*' -d "$out/build"
unzip -q -o "$out"/wheels/nvidia_cuda_cccl_cu12-"$cccl"-*.whl 'nvidia/cuda_cccl/include/*' -d "$out/build"
cp -L "$out/build/nvidia/cuda_runtime/lib/libcudart.so.12" "$out/stage/lib/"
# libfabric's CUDA support dlopens the runtime by its unversioned name.
ln -sf libcudart.so.12 "$out/stage/lib/libcudart.so"
newest=""
for v in $versions; do
  pipdl "nvidia-nccl-cu12==$v"
  rm -rf "$out/build/nccl-$v" && mkdir -p "$out/build/nccl-$v" "$out/stage/nccl-$v"
  unzip -q -o "$out"/wheels/nvidia_nccl_cu12-"$v"-*.whl 'nvidia/nccl/*' -d "$out/build/nccl-$v"
  python3 tools/gpu-check/fatbin.py prune "$out/build/nccl-$v/nvidia/nccl/lib/libnccl.so.2" \
    "$out/stage/nccl-$v/libnccl.so.2" "$arch"
  strip --strip-debug "$out/stage/nccl-$v/libnccl.so.2"
  newest=$v
done
# The check program: NCCL's stable API only, so one build serves every version
# (the newest header; libnccl.so.2 is found through LD_LIBRARY_PATH at run time).
inc="$out/build/nccl-$newest/nvidia/nccl/include"
ln -sf libnccl.so.2 "$out/build/nccl-$newest/nvidia/nccl/lib/libnccl.so"
ln -sf libcudart.so.12 "$out/build/nvidia/cuda_runtime/lib/libcudart.so"
gcc -O2 -Wall -o "$out/stage/bin/nccl_check" tools/gpu-check/nccl_check.c \
  -I "$out/build/nvidia/cuda_runtime/include" -I "$out/build/nvidia/cuda_nvcc/include" -I "$out/build/nvidia/cuda_cccl/include" -I "$inc" \
  -L "$out/build/nvidia/cuda_runtime/lib" -L "$out/build/nccl-$newest/nvidia/nccl/lib" -lcudart -lnccl
# libfabric with CUDA: Debian's has none, so GPUDirect needs our own build.
# Debian 13's libfabric 2.1 (./weft build-libfabric2), CUDA loaded at run time
# (--enable-cuda-dlopen), compiled against the wheels' headers (nvml.h from
# the nvml-dev wheel). Weft is built against its headers, so DMA-BUF and
# FI_OPT_CUDA_API_PERMITTED are in.
pipdl "nvidia-nvml-dev-cu12==$nvml"
unzip -q -o "$out"/wheels/nvidia_nvml_dev_cu12-"$nvml"-*.whl 'nvidia/nvml_dev/include/*' -d "$out/build"
lf="$PWD/$out/libfabric-cuda"
./weft build-libfabric2 "$lf" --with-cuda="$PWD/$out/build/nvidia/cuda_runtime" --enable-cuda-dlopen \
  CPPFLAGS="-I$PWD/$out/build/nvidia/cuda_nvcc/include -I$PWD/$out/build/nvidia/nvml_dev/include"
# Weft, and what it links beyond the C library (libfabric and its providers' dependencies).
PKG_CONFIG_PATH="$lf/lib/pkgconfig" CARGO_TARGET_DIR="$PWD/$out/cargo" cargo build -q --release -p weft
cp "$out/cargo/release/libnccl_net_weft.so" "$out/stage/lib/libnccl-net-weft.so"
LD_LIBRARY_PATH="$lf/lib" ldd "$out/stage/lib/libnccl-net-weft.so" | awk '/=> \// { print $3 }' |
  grep -Ev '/(libc|libm|libdl|libpthread|librt|libgcc_s|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$out/stage/lib/"; done
cp tools/gpu-check/run.sh "$out/stage/run.sh"
chmod +x "$out/stage/run.sh"
echo "gpu-check: staged into $out/stage (NCCL cut to sm_$arch; the freed bytes are zeros, which the archives drop):"
(cd "$out/stage" && du -sh -- * lib/* nccl-*/* 2>/dev/null | sort -k2)
rm -rf "$out/carry" && mkdir -p "$out/carry"
status=0
for v in $versions; do
  a="$out/carry/nccl-$v.tar.xz"
  tar -C "$out/stage" -cf - bin lib run.sh "nccl-$v" | xz -T0 -6 >"$a"
  mib=$(du -m "$a" | cut -f1)
  echo "gpu-check: $a: $mib MiB"
  if [ "$mib" -ge 60 ]; then
    echo "gpu-check: $a is too large for a device run (64 MiB with the working tree)" >&2
    status=1
  fi
done
echo "gpu-check: on a GPU machine, per archive: tools/gpu-check/device.sh target/gpu-check/carry/nccl-<version>.tar.xz"
exit $status
