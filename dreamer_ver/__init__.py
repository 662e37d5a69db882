"""dreamer_ver: DreamerV3's parallel actor/learner runtime in JAX + Flax + optax.

Run it with ``dreamer-ver`` (or ``python -m dreamer_ver.main``); the package
layout and its import rules are in ``docs/architecture.md``.
"""

__version__ = '0.2.0'
