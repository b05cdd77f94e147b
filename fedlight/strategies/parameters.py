"""What the rules whose server treats W's parameters and its buffers apart share.

A server step (a learning rate, momentum, an adaptive optimiser, a control variate) moves the trainable parameters;
the floating-point buffers (BatchNorm's running statistics) are no parameters and take the clients' aggregate. Such a
rule reads W's parameter mask once per run (:meth:`ParameterMask.cache_parameter_mask` in its ``on_fit_start``) and
steps with :meth:`ParameterMask.parameter_step` or writes its own step through :meth:`ParameterMask.on_parameters`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedlight.strategies.functional import parameter_step

if TYPE_CHECKING:
    from fedlight.context import RunContext


class ParameterMask:
    """Caches ``[P]`` bool: which entries of the federated state are trainable parameters."""

    _parameter_mask: torch.Tensor | None = None

    def cache_parameter_mask(self, context: RunContext) -> None:
        """Reads the mask of the run's model, on the device of W^t; call it from ``on_fit_start``."""
        self._parameter_mask = context.layout.parameter_mask(context.module).to(context.global_state.device)

    def parameter_mask(self, device: torch.device | None = None) -> torch.Tensor:
        """The mask, on ``device`` if given."""
        mask = self._parameter_mask
        assert mask is not None, f"{type(self).__name__} read its parameter mask before on_fit_start"
        return mask if device is None else mask.to(device)

    def on_parameters(self, new: torch.Tensor, aggregate: torch.Tensor) -> torch.Tensor:
        """``new`` on the parameters and the clients' ``aggregate`` on the buffers."""
        return torch.where(self.parameter_mask(new.device), new, aggregate)

    def parameter_step(self, global_state: torch.Tensor, aggregate: torch.Tensor, scale: float) -> torch.Tensor:
        """W^t + scale·(A − W^t) on the parameters, A on the buffers (:func:`.functional.parameter_step`)."""
        return parameter_step(global_state, aggregate, scale, self.parameter_mask(global_state.device))
