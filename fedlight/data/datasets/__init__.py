"""Real datasets: read from a local root (or generated, for Synthetic(α, β), and shipped, for the digits)."""
