"""FedSLS's saliency weights: guided backpropagation to every convolution, reduced to one number per image.

For image i and the output F_l ``[C_l, H_l, W_l]`` of the l-th convolution in forward order (Eqs. 4–8 of
the FedSLS paper and S1–S3):

    G_l = (∂Y/∂F_l) ⊙ ReLU(F_l)        Y: the ground-truth class logit; ∂ by guided backpropagation
    Ḡ_l = mean over the C_l channels    [H_l, W_l]
    N_l = ‖Ḡ_l‖_F = sqrt(Σ_{h,w} Ḡ_l²)
    R_k = Σ_l τ^{l−1} Σ_{i∈D_k} N_{i,l}

Guided backpropagation (Springenberg et al. 2015) lets a gradient through a ReLU only where both the
ReLU's input and the incoming gradient are positive. It is installed on every ``nn.ReLU`` module for
the duration of the pass; ReLUs called functionally are not guided.

Memory: nothing per image is kept beyond the batch. Each convolution output gets a tensor hook that
turns its gradient into the ``[B]`` norms as soon as backpropagation reaches it, so the saliency maps
G_l and Ḡ_l exist one layer at a time; the activations are those autograd keeps anyway. A client's R_k
is a running sum over batches (:func:`saliency_norms` per batch, summed by the caller).

FedSL, the paper's ablation, replaces the saliency maps by "vanilla latents": the image downsampled by
a factor f and averaged over its channels (:func:`vanilla_latent_norms`). :func:`saliency_map` and
:func:`vanilla_latent` keep the maps themselves, for the paper's comparison of both with the images (Sec. 4.3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def layer_weights(num_layers: int, tau: float) -> torch.Tensor:
    """w_l = τ^{l−1} for l = 1…L (Eq. 7), float64.

    >>> layer_weights(4, 0.5).tolist()
    [1.0, 0.5, 0.25, 0.125]
    """
    return torch.full((num_layers,), float(tau), dtype=torch.float64).pow(torch.arange(num_layers))


class _GuidedReLUGradient(torch.autograd.Function):
    """Identity on a ReLU's output whose backward keeps only positive gradients where the output is positive.

    Combined with the ReLU's own backward (which masks where the input is positive), the gradient that
    passes is ReLU'(x) · max(g, 0): guided backpropagation.
    """

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(output)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (output,) = ctx.saved_tensors
        return grad.clamp(min=0) * (output > 0)


@contextlib.contextmanager
def guided_relus(model: nn.Module) -> Iterator[int]:
    """Within the block, every ``nn.ReLU`` of ``model`` backpropagates guided gradients; yields their number."""

    def guide(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return _GuidedReLUGradient.apply(output)

    handles = [m.register_forward_hook(guide) for m in model.modules() if isinstance(m, nn.ReLU)]
    try:
        yield len(handles)
    finally:
        for handle in handles:
            handle.remove()


def channel_mean_saliency(grad: torch.Tensor, activation: torch.Tensor) -> torch.Tensor:
    """Ḡ_l = mean_c (∂Y/∂F_l ⊙ ReLU(F_l)) (Eqs. 4–5) of ``[B, C_l, H_l, W_l]`` gradients and outputs, in float32.

    >>> channel_mean_saliency(torch.ones(1, 2, 1, 2), torch.tensor([[[[1.0, -1.0]], [[3.0, 2.0]]]])).tolist()
    [[[2.0, 1.0]]]
    """
    return (grad.float() * activation.float().relu()).mean(dim=1)  # [B, H_l, W_l]


def saliency_map(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, layer: int = 1, guided: bool = True
) -> torch.Tensor:
    """Ḡ_{i,l} of every image of a batch at the ``layer``-th ``nn.Conv2d`` call of ``model`` (1: the first).

    The map whose norm :func:`saliency_norms` takes, kept whole: the FedSLS paper's latent-space analysis
    (Sec. 4.3) compares the map of the first layer with the image. Run it in eval mode, as
    :func:`saliency_norms`.

    Args:
        model: a network whose ``forward`` returns ``[B, num_classes]`` logits.
        inputs: ``[B, ...]`` images.
        targets: ``[B]`` ground-truth classes; Y_i is logit ``targets[i]`` of image i.
        layer: l, counted from 1 in forward-execution order.
        guided: guided backpropagation through ReLUs (the paper's); ``false`` uses plain gradients.

    Returns:
        ``[B, H_l, W_l]`` float32 maps, detached.

    The 1×1 convolution of :func:`saliency_norms`'s example: Ḡ = (2, 0).

    >>> net = nn.Sequential(nn.Conv2d(1, 1, 1, bias=False), nn.Flatten(), nn.Linear(2, 1, bias=False))
    >>> _ = net[0].weight.data.fill_(2.0), net[2].weight.data.fill_(1.0)
    >>> saliency_map(net, torch.tensor([[[[1.0, -1.0]]]]), torch.tensor([0])).tolist()
    [[[2.0, 0.0]]]
    """
    assert layer >= 1, f"layers are counted from 1, got {layer}"
    outputs: list[torch.Tensor] = []  # F_l of every convolution call, in forward order

    def record(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        outputs.append(output)

    convolutions = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    handles = [conv.register_forward_hook(record) for conv in convolutions]
    try:
        with torch.enable_grad(), guided_relus(model) if guided else contextlib.nullcontext():
            logits = model(inputs)  # [B, num_classes]
            assert len(outputs) >= layer, f"{type(model).__name__} calls {len(outputs)} convolution(s), not {layer}"
            score = logits.gather(1, targets.view(-1, 1).long()).sum()  # Σ_i Y_i: images do not interact in eval
            (grad,) = torch.autograd.grad(score, outputs[layer - 1])  # ∂Y/∂F_l, [B, C_l, H_l, W_l]
    finally:
        for handle in handles:
            handle.remove()
    return channel_mean_saliency(grad, outputs[layer - 1].detach())


def saliency_norms(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, guided: bool = True) -> torch.Tensor:
    """N_{i,l} of every image of a batch at every ``nn.Conv2d`` of ``model``, in forward-execution order.

    Run it in eval mode: images then do not interact (BatchNorm uses its running statistics), so one
    backward pass of Σ_i Y_i gives every image its own ∂Y_i/∂F_{i,l}. No parameter gradient is computed
    or accumulated.

    Args:
        model: a network whose ``forward`` returns ``[B, num_classes]`` logits.
        inputs: ``[B, ...]`` images.
        targets: ``[B]`` ground-truth classes; Y_i is logit ``targets[i]`` of image i (before softmax).
        guided: guided backpropagation through ReLUs (the paper's); ``false`` uses plain gradients
            (gradient × activation, the ablation of decision S1).

    Returns:
        ``[B, L]`` float32 norms, one column per convolution call (a convolution called twice counts twice).

    A 1×1 convolution with weight 2 on a 1×2 image (1, −1) whose logit is the sum of its output: ∂Y/∂F = 1,
    ReLU(F) = (2, 0), Ḡ = (2, 0), N = 2:

    >>> net = nn.Sequential(nn.Conv2d(1, 1, 1, bias=False), nn.Flatten(), nn.Linear(2, 1, bias=False))
    >>> _ = net[0].weight.data.fill_(2.0), net[2].weight.data.fill_(1.0)
    >>> saliency_norms(net, torch.tensor([[[[1.0, -1.0]]]]), torch.tensor([0])).tolist()
    [[2.0]]
    """
    norms: list[torch.Tensor] = []  # one [B] per convolution call, in forward order
    outputs: list[torch.Tensor | None] = []  # the convolution outputs F_l, until their gradient arrives
    tensor_hooks = []

    def record(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        position = len(norms)
        norms.append(torch.zeros(output.shape[0], device=output.device))
        outputs.append(output)
        version = output._version

        def reduce(grad: torch.Tensor) -> None:
            activation = outputs[position]
            assert activation._version == version, (
                f"convolution {position} ({module}) had its output modified in place before backpropagation; "
                "the saliency needs ReLU(F) of the unmodified output"
            )
            saliency = channel_mean_saliency(grad, activation.detach())  # Ḡ_l, [B, H_l, W_l]
            norms[position] = torch.linalg.vector_norm(saliency.flatten(1), dim=1)  # N_l, [B]
            if position > 0:
                outputs[position] = None  # not needed any more (the first one is the backward's target)

        # the hook reaches F_l through the list, not a closure over it: no reference cycle keeps it alive
        tensor_hooks.append(output.register_hook(reduce))

    convolutions = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convolutions, f"{type(model).__name__} has no nn.Conv2d, so it has no saliency to measure"
    handles = [conv.register_forward_hook(record) for conv in convolutions]
    try:
        with torch.enable_grad(), guided_relus(model) if guided else contextlib.nullcontext():
            logits = model(inputs)  # [B, num_classes]
            score = logits.gather(1, targets.view(-1, 1).long()).sum()  # Σ_i Y_i
            # the gradient with respect to the first convolution's output passes through every later one,
            # firing their hooks; only that [B, C_1, H_1, W_1] gradient is returned
            torch.autograd.grad(score, outputs[0])
    finally:
        for handle in handles + tensor_hooks:
            handle.remove()
        outputs.clear()
    return torch.stack(norms, dim=1)


def vanilla_latent_norms(inputs: torch.Tensor, factor: int) -> torch.Tensor:
    """FedSL's per-image norm ‖mean_c AvgPool_f(x)‖_F of the image downsampled by ``factor``.

    uint8 images are scaled to [0, 1] first; floating-point inputs are used as they are.

    Args:
        inputs: ``[B, C, H, W]`` images.
        factor: f, the downsampling factor (2, 4 or 8 in the paper); H and W are cut to multiples of f.

    Returns:
        ``[B]`` float32 norms.

    >>> vanilla_latent_norms(torch.full((1, 3, 4, 4), 255, dtype=torch.uint8), 2).tolist()  # 2×2 ones: norm 2
    [2.0]
    """
    latents = vanilla_latent(inputs, factor)  # [B, H/f, W/f]
    return torch.linalg.vector_norm(latents.flatten(1), dim=1)


def vanilla_latent(inputs: torch.Tensor, factor: int) -> torch.Tensor:
    """FedSL's vanilla latent mean_c AvgPool_f(x): ``[B, C, H, W]`` images → ``[B, H/f, W/f]`` float32 maps.

    uint8 images are scaled to [0, 1] first; floating-point inputs are used as they are. H and W are cut to
    multiples of f.

    >>> vanilla_latent(torch.arange(8.0).view(1, 2, 2, 2), 2).tolist()  # the mean of 0…7
    [[[3.5]]]
    """
    images = inputs.float() / 255.0 if inputs.dtype == torch.uint8 else inputs.float()
    return F.avg_pool2d(images, kernel_size=factor).mean(dim=1)
