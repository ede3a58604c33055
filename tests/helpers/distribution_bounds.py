"""Statistics for checking samplers: how far an empirical distribution may honestly be
from the true one, given the number of samples."""
from __future__ import annotations

import math


def total_variation_bound(num_categories: int, num_samples: int, delta: float = 1e-6) -> float:
    """TV distance the empirical distribution stays under with prob >= 1 - delta.

    Bretagnolle–Huber–Carol: P(sum|p_hat - p| >= l) <= 2^k exp(-n l^2 / 2).
    """
    lam = math.sqrt(2.0 * (num_categories * math.log(2.0) + math.log(1.0 / delta)) / num_samples)
    return lam / 2.0
