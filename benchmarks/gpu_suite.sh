#!/usr/bin/env bash
# Issue #47 on a lent GPU: benchmarks/gpu_suite.py with what the GPU image lacks (it has torch,
# Triton and transformers, but no network, no ucxx and no pydantic). Two steps:
#
#   bash benchmarks/gpu_suite.sh pack   # here: UCX for CUDA 13 (ucxx-cu13 and the libraries it loads)
#                                       # and pydantic, as cp312 manylinux wheels, unpacked, stripped of
#                                       # static libraries, headers and tools, as .gpusuite/site.tar.xz
#                                       # (~7.5 MB; the wheels are ~57 MB)
#   bash benchmarks/gpu_suite.sh run    # there, with .gpusuite carried: unpack, name the GPU and the
#                                       # transports UCX finds, run the suite
#
# `run` writes gpu_suite.json, gpu_suite.md, tests.log and suite.log under $OUT (or ./gpu-out). The suite is
# stopped after SUITE_TIMEOUT_S (480) seconds, inside the device tool's limit, so that whatever it
# measured until then comes back; its JSON is rewritten after every figure. UCX_PROTO_INFO=y makes
# UCX print the protocol and transports each transfer chose (is the KV pull on cuda_ipc?).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
site=/tmp/gpusuite-site

pack() {
    # ucxx 0.52 needs libucx < 1.22; libucxx loads librmm's and rapids-logger's libraries first.
    # rmm itself (the Python package) is not imported by ucxx outside its tests.
    local pins=(ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0 librmm-cu13==26.10.0
                rapids-logger==0.3.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
                typing-inspection==0.4.2)
    local platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
             manylinux2014_x86_64; do platforms+=(--platform "$p"); done
    rm -rf "$site" && python3 -m pip install -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" --target "$site" "${pins[@]}" || exit 1
    # What nothing loads at run time: static libraries, headers, CMake files, UCX's perftest and
    # demos (ucx_info stays: it lists the transports UCX finds there).
    find "$site" \( -name '*.a' -o -name '*.la' -o -name include -o -name cmake -o -name pkgconfig \
                    -o -name '*perftest*' -o -name __pycache__ \) -prune -exec rm -rf {} +
    rm -rf "$site"/libucx/share "$site"/libucx/bin/io_demo "$site"/libucx/bin/ucx_read_profile
    # A wheel stores libX.so, libX.so.0 and libX.so.0.0.0 as three copies: keep one, link the others.
    local lib base alias
    while IFS= read -r lib; do
        base=${lib%.so.*}
        for alias in "$base.so" "$base.so.0"; do
            if [ -f "$alias" ] && [ ! -L "$alias" ] && cmp -s "$alias" "$lib"; then
                ln -sf "$(basename "$lib")" "$alias"
            fi
        done
    done < <(find "$site" -name '*.so.*.*.*')
    mkdir -p "$here/.gpusuite"
    grep -qx '/.gpusuite/' "$here/.git/info/exclude" 2>/dev/null || echo /.gpusuite/ >>"$here/.git/info/exclude"
    tar -cf - -C "$(dirname "$site")" "$(basename "$site")" | xz -T2 -6 >"$here/.gpusuite/site.tar.xz" || exit 1
    ls -la "$here/.gpusuite/site.tar.xz"
}

run() {
    local out=${OUT:-$here/gpu-out}
    mkdir -p "$out" /tmp/pdserve-path
    tar -xJf "$here/.gpusuite/site.tar.xz" -C /tmp || exit 1
    ln -sfn "$here/platform" /tmp/pdserve-path/pdserve  # the package's folder is `platform`
    export PYTHONPATH=$site:/tmp/pdserve-path PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        python3 -c "import torch, triton, transformers, ucxx, pydantic; print('torch', torch.__version__, 'cuda',
                    torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__,
                    'ucxx', ucxx.__version__, 'ucx', ucxx.get_ucx_version())"
        LD_LIBRARY_PATH=$site/libucx/lib "$site/libucx/bin/ucx_info" -d | grep -E '^#\s+Transport:' | sort | uniq -c
    } 2>&1 | tee "$out/env.log"
    # The GPU-only tests first (the kernels compiled for this GPU against the torch path, CUDA graphs,
    # CUDA IPC between two processes), bounded by TESTS_TIMEOUT_S (120; 0 skips them). GPU_TESTS
    # (pytest arguments) runs some of them instead, e.g. "tests/unit/engine/test_triton_paged.py -k copy".
    if [ "${TESTS_TIMEOUT_S:-120}" != 0 ]; then
        local tests=${GPU_TESTS:-$(cd "$here" && ls tests/unit/engine/test_triton_*.py tests/unit/engine/test_cuda_*.py \
                                   tests/integration/engine/test_cuda_ipc.py)}
        # shellcheck disable=SC2086  # $tests is a list of pytest arguments
        (cd "$here" && timeout -k 10 "${TESTS_TIMEOUT_S:-120}" python3 -m pytest -q -p no:cacheprovider $tests) \
            2>&1 | tail -40 | tee "$out/tests.log"
    fi
    UCX_PROTO_INFO=y timeout -k 10 "${SUITE_TIMEOUT_S:-480}" python3 "$here/benchmarks/gpu_suite.py" --out "$out" "$@" \
        2>&1 | tee "$out/suite.log"
}

case "${1:-}" in
    pack) pack ;;
    run) shift; run "$@" ;;
    *) echo "usage: bash benchmarks/gpu_suite.sh pack | run [gpu_suite.py options, e.g. --sections machine,pd]" >&2; exit 2 ;;
esac
