#!/usr/bin/env bash
# The GPU proof: the CUDA, cuDNN and NCCL paths, run, checked and timed on a real GPU, in one call.
#
#   bash scripts/gpu-check.sh stage   here: build the release binaries with CUDA, strip and xz them,
#                                     check that what travels stays under 64 MiB, stage them in
#                                     .gpu-stage/ (with the PyTorch comparison script)
#   bash scripts/gpu-check.sh run [G] on the GPU machine (carry .gpu-stage): the checks of group G
#                                     below (default all), each
#                                     bounded in time, a log and a table to $OUT
#   bash scripts/gpu-check.sh         both; without a GPU the run half says so and exits 0
#
# On the GPU machine, from the repository root with .gpu-stage copied there:
#   bash scripts/gpu-check.sh run [numerics|train|speed|all]
# Not part of the tests or CI. Each group fits one 10-minute call on one H200 (limits measured
# on the first run, 2026-12-04: a cold process compiles 200-330 kernels, 0.1-0.5 s each);
# compiled kernels and autotune results are cached under ~/.cache/burn-horovod/cubecl, and
# CUBECL_AUTOTUNE_LEVEL=minimal. Every group starts with
#   0. `train --check-env`: driver, GPUs, libraries (found where pip, the toolkit or the
#      distribution put them), what a run uses.
# numerics (560 s):
#   1. NCCL contents at world size 1 through our communicator (store, unique id, non-blocking init,
#      device pointers at offsets, f32/f16/bf16, deadline, broken state); then under
#      compute-sanitizer memcheck when the tool is there (NCCL's deliberate failing API probes are
#      not errors: --report-api-errors no).
#   2. CUDA-vs-CPU numerics of ResNet-18: cuDNN f32, Burn's conv (TF32 bounds), cuDNN bf16.
# train (580 s):
#   3. The real `train` loop: the data pipeline, NCCL forced at world size 1, two short epochs
#      with validation, mid-epoch and epoch checkpoints (written under /tmp), a resumed third
#      epoch, and torchvision's recipe (augmentations, Mixup/CutMix, AdamW, EMA).
# speed (570 s):
#   4. Throughput: train_step ResNet-50 at batch 64 (cuDNN fp32 and bf16, Burn's conv), then
#      PyTorch on the same card.
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
    # `|| true`: a step that prints nothing (or only blank lines) must not end the whole check
    # under `set -euo pipefail` (grep exits 1 when nothing matches).
    last=$( (grep -v '^[[:space:]]*$' "$out/step.txt" || true) | tail -1 | tr '|' '/' | cut -c1-300)
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
    local bin
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
    nvidia-smi || true
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "nccl", torch.cuda.nccl.version())' || true
    table="$out/table.md"
    status=0
    echo "| check | result | last line |" > "$table"
    echo "|---|---|---|" >> "$table"

    # 0. What the binaries find. train re-executes itself with the libraries arranged and prints
    #    the LD_LIBRARY_PATH and CUDA_PATH it then runs with: the other rows (and allreduce,
    #    PyTorch, compute-sanitizer) get the same.
    LIMIT_S=20 row "train --check-env" "$bin/train" --check-env
    local ld cuda_path
    ld=$( (sed -n 's/^LD_LIBRARY_PATH: //p' "$out/step.txt" || true) | head -1)
    cuda_path=$( (sed -n 's/^CUDA_PATH (NVRTC headers): //p' "$out/step.txt" || true) | head -1)
    if [ -n "$ld" ]; then export LD_LIBRARY_PATH="$ld"; fi
    if [ -n "$cuda_path" ] && [ "$cuda_path" != "not found" ]; then export CUDA_PATH="$cuda_path"; fi
    export CUBECL_AUTOTUNE_LEVEL=minimal
    local ckpt
    ckpt=$(mktemp -d /tmp/gpu-check-ckpt.XXXXXX)

    local group=${1:-all}
    if [ "$group" = all ] || [ "$group" = numerics ]; then
        # 1. NCCL contents through our communicator.
        LIMIT_S=60 row "NCCL at world size 1 (nccl_check)" "$bin/nccl_check"
        if command -v compute-sanitizer >/dev/null 2>&1; then
            LIMIT_S=60 row "nccl_check under compute-sanitizer memcheck" \
                compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 7 \
                "$bin/nccl_check" --quick
        else
            echo "| compute-sanitizer | not on this machine | |" >> "$table"
        fi
        # 2. Numerics, each conv path with its own bounds. A cold process compiles ~200 kernels
        #    (72 s for the first on an H200, 2026-12-04).
        LIMIT_S=150 row "CUDA vs CPU numerics, cuDNN f32 (ResNet-18)" "$bin/gpu_numerics" --conv fast
        LIMIT_S=150 row "CUDA vs CPU numerics, Burn conv (ResNet-18)" "$bin/gpu_numerics" --conv burn
        LIMIT_S=120 row "CUDA vs CPU numerics, cuDNN bf16 (ResNet-18)" "$bin/gpu_numerics" --amp bf16
    fi
    if [ "$group" = all ] || [ "$group" = train ]; then
        # 3. The real loop: data pipeline, NCCL gradient sync (forced at world size 1), two
        #    epochs, a checkpoint every 10 steps too: the mid-epoch state (model, optimizer,
        #    metric sums) is read back from the device and saved while the epoch goes on.
        local loop=(--model resnet50 --image-size 224 --batch-size 64 --max-steps-per-epoch 20
            --workers 16 --log-dir "$out/logs" --checkpoint-format "$ckpt/ckpt-{epoch}.ckpt")
        LIMIT_S=240 row "train, data, NCCL, 2 epochs x 20 steps, checkpoint every 10" \
            env BURN_DIST_BACKEND=nccl "$bin/train" "${loop[@]}" --epochs 2 --checkpoint-every 10
        #    The checkpoint loaded back onto the GPU: a third epoch resumes from the second's end.
        LIMIT_S=120 row "train resumed from its checkpoint, epoch 3" \
            env BURN_DIST_BACKEND=nccl "$bin/train" "${loop[@]}" --epochs 3
        #    torchvision's recipe on the device: TrivialAugment, RandomErasing, RA sampler, Mixup
        #    and CutMix on the normalised batch, label smoothing, AdamW, weight-decay groups, EMA.
        LIMIT_S=200 row "train, torchvision recipe with AdamW and EMA, 2 epochs x 6 steps" \
            "$bin/train" --recipe torchvision-resnet50-v2 --model resnet50 --batch-size 64 \
            --epochs 2 --lr-warmup-epochs 1 --max-steps-per-epoch 6 --val-crop-size 224 \
            --workers 16 --opt adamw --lr 0.002 --model-ema-steps 2 --output-dir "$ckpt/recipe"
    fi
    if [ "$group" = all ] || [ "$group" = speed ]; then
        # 4. Throughput, ours then PyTorch's. Fusion keeps compiling new kernels for several
        #    steps: 10 untimed steps first, and every step's time is printed to show it settled.
        local ts=("$bin/train_step" --model resnet50 --image-size 224 --batch 64 --steps 20
            --warmup 10 --no-data --json)
        LIMIT_S=150 row "train_step b64 fp32 cuDNN conv, fusion" "${ts[@]}" --backend cuda --conv fast
        LIMIT_S=130 row "train_step b64 bf16 cuDNN conv, fusion" "${ts[@]}" --backend cuda --conv fast --amp bf16
        LIMIT_S=150 row "train_step b64 fp32 Burn conv, fusion" "${ts[@]}" --backend cuda --conv burn
        #    Importing torch takes ~11 s there, and cudnn.benchmark tries algorithms per layer.
        LIMIT_S=120 row "PyTorch b64 (fp32; tf32; bf16 autocast + channels_last)" \
            python3 "$STAGE/compare_train_step_gpu.py" --batch 64 --steps 20 --warmup 5
    fi
    rm -rf "$ckpt"
    echo
    cat "$table"
    return $status
}

# Checks row() itself, on any machine: a step that prints nothing, one that prints only blank
# lines, a failing one and a slow one each get their row, and the check goes on to the end.
selftest() {
    out=$(mktemp -d)
    table="$out/table.md"
    status=0
    : > "$table"
    LIMIT_S=5 row "silent" true
    LIMIT_S=5 row "blank lines" printf '\n\n'
    LIMIT_S=5 row "fails" sh -c 'echo last words; exit 3'
    LIMIT_S=1 row "times out" sleep 5
    cat "$table"
    if grep -q '^| silent | pass' "$table" && grep -q '^| blank lines | pass' "$table" \
        && grep -q '^| fails | FAIL (exit 3) | last words |' "$table" \
        && grep -q '^| times out | TIMEOUT after 1 s' "$table" && [ "$status" -eq 1 ]; then
        echo "selftest: every row recorded"
    else
        echo "selftest: FAILED" >&2
        exit 1
    fi
    rm -rf "$out"
}

case "${1:-all}" in
    stage) stage ;;
    selftest) selftest ;;
    run) run_checks "${2:-all}" ;;
    all)
        if command -v cargo >/dev/null; then stage; fi
        run_checks ;;
    *) echo "usage: $0 [stage|run|selftest]" >&2; exit 2 ;;
esac
