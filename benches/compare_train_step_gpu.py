#!/usr/bin/env python3
"""PyTorch on the GPU: the anchor for `train_step --backend cuda` (run by scripts/gpu-check.sh).

    python3 benches/compare_train_step_gpu.py --batch 64 --steps 20 --warmup 5

torchvision's ResNet-50, SGD with momentum 0.9, cross-entropy on a fixed random batch at 224 px,
cudnn.benchmark on: eager fp32 (NCHW), then bf16 autocast with channels_last (what a tuned
PyTorch user runs). Times with CUDA events over the timed steps; prints one JSON line.
"""
import argparse
import json

import torch
import torchvision


def img_per_sec(batch, steps, warmup, bf16, channels_last):
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = torchvision.models.resnet50().cuda().to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=fmt)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(warmup + steps):
        if i == warmup:
            start.record()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    end.record()
    torch.cuda.synchronize()
    return steps * batch / (start.elapsed_time(end) / 1000.0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    fp32 = img_per_sec(a.batch, a.steps, a.warmup, bf16=False, channels_last=False)
    # PyTorch's own default lets cuDNN convs use TF32: report that too.
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    tf32 = img_per_sec(a.batch, a.steps, a.warmup, bf16=False, channels_last=False)
    bf16 = img_per_sec(a.batch, a.steps, a.warmup, bf16=True, channels_last=True)
    print(json.dumps({
        "model": "resnet50", "batch": a.batch, "torch": torch.__version__,
        "fp32_img_per_sec": round(fp32, 1), "tf32_img_per_sec": round(tf32, 1),
        "bf16_channels_last_img_per_sec": round(bf16, 1),
    }))


if __name__ == "__main__":
    main()
