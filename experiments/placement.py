"""Arrays committed to the default device, for the experiments that mix fresh arrays with restored or
computed ones.

Whether a jitted call's argument is committed to a device is part of what its program is compiled for:
restored weights and every output of a jitted call on committed inputs are committed, fresh arrays
(`init_params`, `init_cache`, `jnp.zeros`) are not. A fresh first cache beside committed weights, or a
fresh stand-in beside the real call's committed inputs, compiles a second program of the same shapes.
"""

from __future__ import annotations

import jax


def committed(tree):
    """`tree` (any pytree of arrays) committed to the default device."""
    return jax.device_put(tree, jax.devices()[0])
