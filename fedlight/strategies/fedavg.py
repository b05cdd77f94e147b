"""FedAvg: McMahan et al., *Communication-Efficient Learning of Deep Networks from Decentralized
Data*, AISTATS 2017.

W^{t+1} = Σ_{k∈K^t} (n_k / Σ_{j∈K^t} n_j) · W_k^{t+1}, Eq. 3 of the prototype-margin paper. Stragglers
are dropped unless ``tolerate_stragglers`` is set (Table 3's "FedAvg + toleration" row).
"""

from __future__ import annotations

from fedlight.strategies.base import Strategy


class FedAvg(Strategy):
    """Sample-count-weighted averaging: every hook is the base class's default."""
