#!/usr/bin/env bash
# The GPU proof: the CUDA and NCCL paths, run and timed on a real GPU.
#
#   bash scripts/gpu-check.sh stage   here: build the release binaries with CUDA, strip them, check
#                                     that what travels stays under 64 MiB, stage them in .gpu-stage/
#   bash scripts/gpu-check.sh run     on the GPU machine (carry .gpu-stage): nvidia-smi, make NCCL and
#                                     NVRTC loadable, run the checks, write a log and a table to $OUT
#   bash scripts/gpu-check.sh         both; without a GPU the run half says so and exits 0
#
# The device tool's call, once staged:  run(command="bash scripts/gpu-check.sh run",
#                                           carry=[".gpu-stage"], timeout_s=540)
# Not part of the tests or CI.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=.gpu-stage
LIMIT=$((64 * 1024 * 1024))

stage() {
    command -v cargo >/dev/null || { echo "stage: no cargo here; run it on the build machine"; exit 1; }
    cargo build --release -p train -p benches --bins
    local target="${CARGO_TARGET_DIR:-target}/release"
    rm -rf "$STAGE" && mkdir -p "$STAGE"
    # Stripped, each is ~37 MiB; xz brings it to ~6 MiB, so all four fit the 64 MiB carry.
    for bin in train allreduce train_step gpu_numerics; do
        cp "$target/$bin" "$STAGE/$bin"
        strip "$STAGE/$bin"
        xz -T2 -6 -f "$STAGE/$bin"
    done
    cp benches/compare_train_step.py "$STAGE/" 2>/dev/null || true
    local size
    size=$(du -cb "$STAGE" | tail -1 | cut -f1)
    echo "staged $(ls "$STAGE" | tr '\n' ' ')in $STAGE: $((size / 1024 / 1024)) MiB (limit 64 MiB)"
    if [ "$size" -ge "$LIMIT" ]; then
        echo "stage: $STAGE is $size bytes, over the 64 MiB the device tool carries" >&2
        exit 1
    fi
}

# Finds lib<name>.so.<major> and makes lib<name>.so resolvable (cudarc dlopens the unversioned name).
link_library() {
    local name=$1 dir=$2 found=""
    found=$( (ldconfig -p 2>/dev/null | awk -v n="lib$name.so" '$1 ~ "^"n {print $NF}' | head -1) || true)
    if [ -z "$found" ]; then
        found=$(find /usr /opt /usr/local "$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || echo /nonexistent)" \
            -name "lib$name.so*" -type f 2>/dev/null | sort | head -1 || true)
    fi
    if [ -z "$found" ]; then
        echo "lib$name: not found (tried ldconfig, /usr, /opt, python site-packages)"
        return 1
    fi
    ln -sf "$found" "$dir/lib$name.so"
    echo "lib$name: $found -> $dir/lib$name.so"
}

run_checks() {
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        echo "gpu-check: no NVIDIA GPU on this machine: skipped the device checks (nothing failed)"
        return 0
    fi
    local out="${OUT:-$(mktemp -d)}" libs bin
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
    link_library nccl "$libs" || true
    link_library nvrtc "$libs" || true
    export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
    local table="$out/table.md" status=0
    echo "| check | result |" > "$table"
    echo "|---|---|" >> "$table"

    echo "== numerics: ResNet-18 on CUDA vs Flex (logits, gradients, one SGD step)"
    if "$bin/gpu_numerics" --json > "$out/numerics.json"; then
        echo "| CUDA vs CPU numerics | pass: $(cat "$out/numerics.json") |" >> "$table"
    else
        echo "| CUDA vs CPU numerics | FAIL (see log) |" >> "$table"; status=1
    fi

    echo "== NCCL from raw device pointers, world size 1 (all-reduce sweep, contents checked)"
    if "$bin/allreduce" --nproc 1 --backend nccl --max-bytes $((64 * 1024 * 1024)) > "$out/allreduce.txt"; then
        echo "| NCCL allreduce (1 GPU) | pass, see allreduce.txt |" >> "$table"
    else
        echo "| NCCL allreduce (1 GPU) | FAIL |" >> "$table"; status=1
    fi
    cat "$out/allreduce.txt" || true

    echo "== ResNet-50 train step img/s, ours (fp32) vs PyTorch (fp32, bf16 autocast, channels_last)"
    for batch in 32 64 128; do
        ours=$("$bin/train_step" --backend cuda --model resnet50 --batch "$batch" --steps 10 --warmup 3 --json 2>>"$out/train_step.err" | tail -1 || echo '{}')
        theirs=$(python3 - "$batch" <<'PY' 2>>"$out/torch.err" || echo "torch failed"
import sys, time, torch, torchvision
b = int(sys.argv[1]); torch.backends.cudnn.benchmark = True
m = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(b, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
y = torch.randint(0, 1000, (b,), device="cuda")
res = []
for dtype in (None, torch.bfloat16):
    for i in range(15):
        if i == 5: torch.cuda.synchronize(); t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward(); opt.step()
    torch.cuda.synchronize(); res.append(10 * b / (time.perf_counter() - t))
print(f"fp32 {res[0]:.1f} bf16 {res[1]:.1f}")
PY
)
        echo "| ResNet-50 batch $batch img/s | ours $ours; PyTorch $theirs |" >> "$table"
    done

    echo "== train with the data pipeline (synthetic data, 20 steps)"
    if "$bin/train" --model resnet50 --image-size 224 --batch-size 64 --epochs 1 --max-steps-per-epoch 20 \
        --log-dir "$out/logs" --checkpoint-format "$out/ckpt-{epoch}.ckpt" --workers 12 > "$out/train.txt" 2>&1; then
        echo "| train (data included), batch 64 | $(grep '^epoch 1' "$out/train.txt" | tail -1) |" >> "$table"
    else
        echo "| train (data included) | FAIL (see train.txt) |" >> "$table"; status=1
    fi
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
