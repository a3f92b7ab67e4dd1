#!/usr/bin/env bash
# Builds kernels/csrc/cutlass_decode_gemm.cu into .bench_cutlass/libcutlass_decode_gemm.so (issue 13, eleventh
# pass). No GPU needed: sm_90a code only, the CUDA runtime linked statically, the driver's cuTensorMapEncodeTiled
# found at run time (cudaGetDriverEntryPointByVersion), so the library loads wherever torch's CUDA does.
#
#   benchmarks/build_cutlass_gemm.sh [WHEEL] [JOBS]
#
# WHEEL: the nvidia-cutlass wheel (PyPI nvidia-cutlass 4.2.0.0; headers only are used), unzipped into
# .bench_cutlass/ once. JOBS: parallel compiles of the file's 4 config groups (default 2).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEEL=${1:-/tmp/whl/cutlass/nvidia_cutlass-4.2.0.0-py3-none-any.whl}
JOBS=${2:-2}
DEST=$ROOT/.bench_cutlass
NVCC=${NVCC:-nvcc}
mkdir -p "$DEST/obj"
if [ ! -d "$DEST/cutlass_library/source/include/cutlass" ]; then
    (cd "$DEST" && unzip -q -o "$WHEEL" 'cutlass_library/source/include/*' 'cutlass_library/source/tools/util/include/*')
fi
INC=$DEST/cutlass_library/source
FLAGS=(-std=c++17 -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a -Xcompiler=-fPIC --expt-relaxed-constexpr
       -I"$INC/include" -I"$INC/tools/util/include")
SRC=$ROOT/kernels/csrc/cutlass_decode_gemm.cu
printf '%s\n' 0 1 2 3 | xargs -P "$JOBS" -I{} \
    "$NVCC" "${FLAGS[@]}" -DCFG_GROUP={} -c "$SRC" -o "$DEST/obj/group{}.o"
"$NVCC" -shared -gencode=arch=compute_90a,code=sm_90a -cudart static "$DEST"/obj/group{0,1,2,3}.o \
    -o "$DEST/libcutlass_decode_gemm.so"
echo "built $DEST/libcutlass_decode_gemm.so"
