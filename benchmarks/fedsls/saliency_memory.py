"""Peak memory of computing one client's saliency weight R_k: ResNet-18, 500 CIFAR-sized images.

FedSLS's §3.4 is about the cost of the saliency maps: kept for a whole client, G_{l,k} ∈ R^{N×C×H×W} of
every convolution takes memory that grows with the client's size. fedlight never keeps them: each
convolution's map is reduced to one norm per image as soon as backpropagation reaches it
(:func:`fedlight.metrics.functional.saliency.saliency_norms`), so the memory is that of one batch's
guided backward pass. This script measures, side by side, in one fresh process per setting:

- ``streamed``: fedlight's pass, in batches of 1, 50 and 500 images (500: the whole client at once);
- ``channel-mean maps kept``: the same pass, but Ḡ_l (the channel means, the paper's Eq. 12) of every
  image and layer are kept until the end, then reduced;
- ``full maps kept``: G_l with all its channels kept for every image and layer (the paper's §3.4 setting);

and both ways again for a client of 2,000 images, to show which memory grows with the client.

Memory is the peak resident set size of the pass above the process's size just before it (the kernel's
high-water mark, reset before the pass); with CUDA the peak allocated GPU memory is measured instead.
Every setting must give the same R_k.

    python benchmarks/fedsls/saliency_memory.py            # CPU (about a minute)
    python benchmarks/fedsls/saliency_memory.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # this checkout's fedlight

#: (how, batch size, client images); the 2000-image rows show what grows with the client and what does not
SETTINGS = [
    ("streamed", 1, 500),
    ("streamed", 50, 500),
    ("streamed", 500, 500),
    ("channel-mean maps kept", 50, 500),
    ("full maps kept", 50, 500),
    ("streamed", 50, 2000),
    ("full maps kept", 50, 2000),
]


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def kept_maps_saliency(net, images, targets, batch_size: int, channels: bool) -> tuple[float, float]:
    """R_k with every image's per-layer maps kept until the end; returns (R_k, MB of kept maps)."""
    import torch
    from torch import nn

    from fedlight.metrics.functional.saliency import guided_relus, layer_weights

    kept: list[list[torch.Tensor]] = []  # per layer, the batches' maps
    for start in range(0, len(targets), batch_size):
        x, y = images[start : start + batch_size], targets[start : start + batch_size]
        outputs, maps, tensor_hooks = [], [], []

        def record(module, args, output, outputs=outputs, maps=maps, tensor_hooks=tensor_hooks):
            position = len(outputs)
            outputs.append(output)
            maps.append(None)

            def keep(grad, position=position):
                saliency = grad * outputs[position].detach().relu()  # G_l [B, C, H, W]
                maps[position] = saliency if channels else saliency.mean(dim=1)  # or Ḡ_l [B, H, W]

            tensor_hooks.append(output.register_hook(keep))

        handles = [m.register_forward_hook(record) for m in net.modules() if isinstance(m, nn.Conv2d)]
        with torch.enable_grad(), guided_relus(net):
            score = net(x).gather(1, y.view(-1, 1)).sum()
            torch.autograd.grad(score, outputs[0])
        for handle in handles + tensor_hooks:
            handle.remove()
        outputs.clear()
        for layer, saliency in enumerate(maps):
            if layer == len(kept):
                kept.append([])
            kept[layer].append(saliency)
    stored = [torch.cat(batches) for batches in kept]  # the whole client's maps, per layer
    megabytes = sum(t.numel() * t.element_size() for t in stored) / 2**20
    channel_means = [t.mean(dim=1) if channels else t for t in stored]  # Ḡ_l [N, H, W]
    norms = torch.stack([t.flatten(1).norm(dim=1) for t in channel_means])  # N [L, N]
    return float(layer_weights(len(stored), 0.5) @ norms.double().sum(dim=1)), megabytes


def child(mode: str, batch_size: int, num_images: int, device: str) -> dict:
    import torch

    from fedlight.metrics.functional.saliency import layer_weights, saliency_norms
    from fedlight.models import create_model

    torch.manual_seed(0)
    net = create_model("resnet18", input_shape=(3, 32, 32), num_classes=10).to(device).eval()
    images = torch.randint(0, 256, (num_images, 3, 32, 32), dtype=torch.uint8, device=device)
    targets = torch.randint(0, 10, (num_images,), device=device)
    for module in net.modules():  # timm starts each block's last BatchNorm at 0; a trained net has no zeros
        if isinstance(module, torch.nn.BatchNorm2d):
            torch.nn.init.uniform_(module.weight, 0.5, 1.5)
    saliency_norms(net, images[:2], targets[:2])  # warm-up: lazy initialisation outside the measurement
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark of the resident set
        before = _rss_mb("VmRSS")
    started = time.perf_counter()
    kept_mb = 0.0
    if mode == "streamed":
        totals = sum(
            saliency_norms(net, images[s : s + batch_size], targets[s : s + batch_size]).double().sum(dim=0)
            for s in range(0, num_images, batch_size)
        )
        weight = float(layer_weights(len(totals), 0.5) @ totals)
    else:
        weight, kept_mb = kept_maps_saliency(net, images, targets, batch_size, channels=mode == "full maps kept")
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _rss_mb("VmHWM")
    return {"mode": mode, "batch": batch_size, "images": num_images, "peak_mb": peak - before, "kept_mb": kept_mb,
            "seconds": seconds, "weight": weight}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "BATCH", "IMAGES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]), args.device)))
        return 0
    rows = []
    for mode, batch, images in SETTINGS:
        command = [sys.executable, __file__, "--device", args.device, "--child", mode, str(batch), str(images)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    reference = next(r for r in rows if r["mode"] == "streamed" and r["batch"] == 50 and r["images"] == 500)
    unit = "GPU memory allocated" if args.device.startswith("cuda") else "resident set"
    print(f"R_k of one client: ResNet-18 (timm, 11.2M parameters), 32×32 images, device {args.device}.")
    print(f"Peak {unit} of the pass above the process before it; ratios against 500 images streamed by 50.\n")
    print("| how | images | batch | peak MB | ratio | maps kept MB | seconds | R_k |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["peak_mb"] / reference["peak_mb"]
        print(f"| {r['mode']} | {r['images']} | {r['batch']} | {r['peak_mb']:.1f} | {ratio:.2f} | "
              f"{r['kept_mb']:.1f} | {r['seconds']:.2f} | {r['weight']:.6g} |")  # fmt: skip
    # one client, one R_k, however it is computed
    weights = [r["weight"] for r in rows if r["images"] == 500]
    spread = max(weights) / min(weights) - 1
    print(f"\nR_k of the 500-image client agrees across settings to a relative {spread:.1e}.")
    return 0 if spread < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
