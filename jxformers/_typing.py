"""Type names for the static type checker.

`ArrayLike` here is what the ops take: `jax.Array` or `numpy.ndarray`. At run time it is
jaxtyping's `ArrayLike` (which also admits Python and NumPy scalars), so the run-time checks
(`Float[ArrayLike, "n d"]` under jaxtyping and beartype) are unchanged; for the type checker it
is the array types only, because an op reads `q.shape` and `q.dtype` of its inputs, which a
Python scalar lacks, and its shape string (one dimension or more) refuses scalars anyway.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from jax import Array

    ArrayLike = Array | np.ndarray
else:
    from jaxtyping import ArrayLike

__all__ = ["ArrayLike"]
