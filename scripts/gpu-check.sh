#!/usr/bin/env bash
# The GPU proof: the CUDA, cuDNN and NCCL paths, run, checked and timed on a real GPU, in one call.
#
#   bash scripts/gpu-check.sh stage   here: build the release binaries with CUDA, strip and xz them,
#                                     check that what travels stays under 64 MiB, stage them in
#                                     .gpu-stage/ (with the PyTorch comparison script)
#   bash scripts/gpu-check.sh run     on the GPU machine (carry .gpu-stage): every check below, each
#                                     bounded in time, a log and a table to $OUT
#   bash scripts/gpu-check.sh         both; without a GPU the run half says so and exits 0
#
# The device tool's call, once staged (one H200: well under 8 minutes):
#   run(command="bash scripts/gpu-check.sh run", carry=[".gpu-stage"], timeout_s=540)
# Not part of the tests or CI. Checks, in order of what they prove:
#   1. NCCL at world size 1 through our communicator (store, unique id, non-blocking init, device
#      pointers at offsets, f32/f16/bf16, deadline, broken state), contents checked; then again
#      under compute-sanitizer memcheck when the tool is there.
#   2. The allreduce bench with --backend nccl (device buffers).
#   3. Numerics: ResNet-18 on CUDA vs Flex (logits, every gradient, one SGD step), autotune on.
#   4. train_step ResNet-50 fp32 at batch 64 and 128: Burn's conv (autotuned) with and without
#      fusion, cuDNN fp32 and bf16 (--amp bf16); and PyTorch on the same card (fp32; bf16
#      autocast + channels_last).
#   5. train with the data pipeline (16 workers), NCCL forced, a bounded number of steps.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=.gpu-stage
LIMIT=$((64 * 1024 * 1024))
BINS="train allreduce train_step gpu_numerics nccl_check"

stage() {
    command -v cargo >/dev/null || { echo "stage: no cargo here; run it on the build machine"; exit 1; }
    cargo build --release -p train -p benches --bins
    local target="${CARGO_TARGET_DIR:-target}/release"
    rm -rf "$STAGE" && mkdir -p "$STAGE"
    # Stripped, each is ~40 MiB; xz brings it to ~6 MiB, so all of them fit the 64 MiB carry.
    for bin in $BINS; do
        cp "$target/$bin" "$STAGE/$bin"
        strip "$STAGE/$bin"
        xz -T2 -6 -f "$STAGE/$bin"
    done
    cp benches/compare_train_step_gpu.py "$STAGE/"
    local size
    size=$(du -cb "$STAGE" | tail -1 | cut -f1)
    echo "staged $(ls "$STAGE" | tr '\n' ' ')in $STAGE: $((size / 1024 / 1024)) MiB (limit 64 MiB)"
    if [ "$size" -ge "$LIMIT" ]; then
        echo "stage: $STAGE is $size bytes, over the 64 MiB the device tool carries" >&2
        exit 1
    fi
}

# Finds lib<name>.so.<major> and makes lib<name>.so resolvable (cudarc dlopens the unversioned
# name first). Looks in ldconfig's cache, the usual prefixes and Python's site-packages (where
# PyTorch's wheels keep NCCL, cuDNN and NVRTC).
link_library() {
    local name=$1 dir=$2 found=""
    found=$( (ldconfig -p 2>/dev/null | awk -v n="lib$name.so" '$1 ~ "^"n {print $NF}' | head -1) || true)
    if [ -z "$found" ]; then
        local site
        site=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)
        # shellcheck disable=SC2086
        found=$(find /usr /opt /usr/local $site -name "lib$name.so*" -type f 2>/dev/null | sort | head -1 || true)
    fi
    if [ -z "$found" ]; then
        echo "lib$name: not found (tried ldconfig, /usr, /opt, python site-packages)"
        return 1
    fi
    ln -sf "$found" "$dir/lib$name.so"
    echo "lib$name: $found -> $dir/lib$name.so"
}

# row NAME COMMAND...: runs COMMAND with a time limit (LIMIT_S, default 120 s), its output to the
# log, and one table row: pass / FAIL / TIMEOUT with the last line it printed.
row() {
    local name=$1; shift
    local limit=${LIMIT_S:-120} rc=0 start end last
    start=$(date +%s)
    echo "== $name: $*"
    timeout --kill-after=10 "$limit" "$@" > "$out/step.txt" 2>&1 || rc=$?
    end=$(date +%s)
    cat "$out/step.txt"
    last=$(grep -v '^\s*$' "$out/step.txt" | tail -1 | tr '|' '/' | cut -c1-300)
    if [ $rc -eq 0 ]; then
        echo "| $name | pass ($((end - start)) s) | $last |" >> "$table"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        echo "| $name | TIMEOUT after ${limit} s | $last |" >> "$table"; status=1
    else
        echo "| $name | FAIL (exit $rc) | $last |" >> "$table"; status=1
    fi
}

run_checks() {
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        echo "gpu-check: no NVIDIA GPU on this machine: skipped the device checks (nothing failed)"
        return 0
    fi
    out="${OUT:-$(mktemp -d)}"
    local libs bin
    libs=$(mktemp -d)
    bin=$(mktemp -d)
    exec > >(tee "$out/gpu-check.log") 2>&1
    for packed in "$STAGE"/*.xz; do
        if command -v xz >/dev/null; then
            xz -dc "$packed" > "$bin/$(basename "$packed" .xz)"
        else
            python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
                "$packed" > "$bin/$(basename "$packed" .xz)"
        fi
        chmod +x "$bin/$(basename "$packed" .xz)"
    done
    nvidia-smi
    for lib in nccl nvrtc cudnn; do link_library "$lib" "$libs" || true; done
    export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "nccl", torch.cuda.nccl.version())' || true
    table="$out/table.md"
    status=0
    echo "| check | result | last line |" > "$table"
    echo "|---|---|---|" >> "$table"

    # 1. NCCL through our communicator, contents checked.
    LIMIT_S=120 row "NCCL at world size 1 (nccl_check)" "$bin/nccl_check"
    if command -v compute-sanitizer >/dev/null 2>&1; then
        LIMIT_S=180 row "nccl_check under compute-sanitizer memcheck" \
            compute-sanitizer --tool memcheck --error-exitcode 7 "$bin/nccl_check" --quick
    else
        echo "| compute-sanitizer | not on this machine | |" >> "$table"
    fi
    # 2. The allreduce bench on device buffers.
    LIMIT_S=90 row "allreduce --backend nccl --nproc 1" \
        "$bin/allreduce" --nproc 1 --backend nccl --max-bytes $((256 * 1024 * 1024))
    # 3. Numerics (autotune on).
    LIMIT_S=180 row "CUDA vs CPU numerics (ResNet-18)" "$bin/gpu_numerics"
    LIMIT_S=90 row "CUDA bf16 convs vs CPU f32 numerics (ResNet-18)" "$bin/gpu_numerics" --amp bf16

    # 4. ResNet-50 training step: ours, each variant, then PyTorch. The first run autotunes
    #    (cached in ~/.cache/burn-horovod/cubecl for the others); warm-up steps are untimed.
    local ts=("$bin/train_step" --model resnet50 --image-size 224 --steps 20 --warmup 5 --no-data --json)
    for batch in 64 128; do
        LIMIT_S=150 row "train_step b$batch fp32 Burn conv, fusion" "${ts[@]}" --batch "$batch" --backend cuda --conv burn
        LIMIT_S=120 row "train_step b$batch fp32 Burn conv, no fusion" "${ts[@]}" --batch "$batch" --backend cuda-raw --conv burn
        LIMIT_S=120 row "train_step b$batch fp32 cuDNN conv, fusion" "${ts[@]}" --batch "$batch" --backend cuda --conv fast
        LIMIT_S=90 row "train_step b$batch bf16 cuDNN conv, fusion" "${ts[@]}" --batch "$batch" --backend cuda --conv fast --amp bf16
        LIMIT_S=120 row "PyTorch b$batch (fp32; bf16 autocast + channels_last)" \
            python3 "$STAGE/compare_train_step_gpu.py" --batch "$batch" --steps 20 --warmup 5
    done

    # 5. The real loop: data pipeline, NCCL gradient sync (forced at world size 1), metrics.
    LIMIT_S=180 row "train, data pipeline, 16 workers, NCCL, 40 steps" \
        env BURN_DIST_BACKEND=nccl "$bin/train" --model resnet50 --image-size 224 --batch-size 64 \
        --epochs 1 --max-steps-per-epoch 40 --workers 16 \
        --log-dir "$out/logs" --checkpoint-format "$out/ckpt-{epoch}.ckpt"
    echo
    cat "$table"
    return $status
}

case "${1:-all}" in
    stage) stage ;;
    run) run_checks ;;
    all)
        if command -v cargo >/dev/null; then stage; fi
        run_checks ;;
    *) echo "usage: $0 [stage|run]" >&2; exit 2 ;;
esac
