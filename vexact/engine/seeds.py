"""The one check of a seed's range, shared by the model's initialisation and the sampler (no imports: both the
model and the input checks import it, and neither imports the other at module level)."""

from __future__ import annotations

SEED_RANGE = (-(2**63), 2**64)
"""torch.manual_seed's range, [low, high): a larger seed would alias seed mod 2**64."""


def check_seed(seed: int, name: str = "seed", none_means: str | None = None) -> None:
    """``seed`` an int in ``SEED_RANGE``; else one ValueError naming the argument ``name``. ``none_means``: where
    None is accepted, what it means (it is then named in the message)."""
    if seed is None and none_means is not None:
        return
    low, high = SEED_RANGE
    if not isinstance(seed, int) or isinstance(seed, bool) or not low <= seed < high:
        alternative = f" or None ({none_means})" if none_means is not None else ""
        raise ValueError(f"{name} must be an int in [-2**63, 2**64){alternative}, got {seed!r}")
