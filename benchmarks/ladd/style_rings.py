"""What each ring of the FDA window carries on the style-cities twin: the cities' look, or each image's content.

A window of half-width b holds the amplitude spectrum's rings 0..b (ring r: the entries at Chebyshev distance r
from the centre; ring 0 is the DC term, the 1×1 window; the 3×3 window adds ring 1, the 5×5 window ring 2). For
each ring, over the twin's source pool and its target clients (the configs' size: 32×32 spectra, 10 clients per
city), the script prints, averaged over the ring's entries and the three channels:

- the mean amplitude of the source images and of the target images;
- the per-image coefficient of variation (std / mean over images) in each domain: how much the entry changes
  from one image to the next;
- the cities' share of the variance of the client styles (the between-city sum of squares over the total): how
  much of what a client's style holds in this ring is its city's look rather than its images' content;
- the distance between the source's mean and each city's mean, in units of the spread of single images within
  a client: how far FDA moves a source image in this ring, against the image-to-image noise it also swaps in.

::

    python benchmarks/ladd/style_rings.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from fedlight.data import StyleCities
from fedlight.data.style.fda import extract_style
from fedlight.data.twins.style_cities import city_of

TWIN = {"num_source_samples": 1000, "num_test_per_city": 40, "image_size": 32, "class_skew": 0.6}
HALF_WIDTH = 2  # rings 0, 1, 2: the 1×1, 3×3 and 5×5 windows


def ring_statistics(seed: int, num_clients_per_city: int = 10) -> list[dict[str, float]]:
    """One row per ring r = 0..2 of the statistics above, for the twin drawn with ``seed``."""
    common = {**TWIN, "normalise": False, "seed": seed, "num_clients_per_city": num_clients_per_city}
    source = StyleCities(domain="source", **common).load_train()
    target = StyleCities(domain="target", **common).load_train()
    side = 2 * HALF_WIDTH + 1
    source_styles = extract_style(source.inputs, b=HALF_WIDTH, size=(32, 32)).view(-1, 3, side, side)
    target_styles = extract_style(target.inputs, b=HALF_WIDTH, size=(32, 32)).view(-1, 3, side, side)
    offsets = torch.arange(side) - HALF_WIDTH
    ring = torch.maximum(offsets.abs()[:, None], offsets.abs()[None, :])  # [side, side]

    groups = np.asarray(target.groups)
    clients = sorted(set(groups.tolist()))
    client_city = np.array([city_of(client) for client in clients])
    members = [torch.from_numpy(groups == client) for client in clients]
    rows = []
    for r in range(HALF_WIDTH + 1):
        source_values = source_styles[:, :, ring == r].double()  # [N_source, 3, entries]
        target_values = target_styles[:, :, ring == r].double()
        client_styles = torch.stack([target_values[m].mean(0) for m in members])  # [K, 3, entries]
        overall = client_styles.mean(0)
        between = sum(
            int((client_city == city).sum())
            * (client_styles[torch.from_numpy(client_city == city)].mean(0) - overall) ** 2
            for city in sorted(set(client_city))
        )
        total = ((client_styles - overall) ** 2).sum(0)
        city_means = torch.stack(
            [client_styles[torch.from_numpy(client_city == city)].mean(0) for city in sorted(set(client_city))]
        )
        within_client = torch.stack([target_values[m].std(0) for m in members]).mean()
        rows.append(
            {
                "ring": r,
                "source_amplitude": float(source_values.mean()),
                "target_amplitude": float(target_values.mean()),
                "source_cv": float((source_values.std(0) / source_values.mean(0)).mean()),
                "target_cv": float((target_values.std(0) / target_values.mean(0)).mean()),
                "city_share": float(between.sum() / total.sum()),
                "shift_over_noise": float((city_means - source_values.mean(0)).abs().mean() / within_client),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="twin seeds (default 0 1 2)")
    args = parser.parse_args()
    per_seed = [ring_statistics(seed) for seed in args.seeds]
    keys = ["source_amplitude", "target_amplitude", "source_cv", "target_cv", "city_share", "shift_over_noise"]
    print(f"seeds {args.seeds}: mean (min–max over seeds)")
    print("| ring (window) | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for r in range(HALF_WIDTH + 1):
        cells = []
        for key in keys:
            values = [rows[r][key] for rows in per_seed]
            digits = 0 if "amplitude" in key else 2
            cells.append(f"{np.mean(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})")
        print(f"| {r} ({2 * r + 1}×{2 * r + 1}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
