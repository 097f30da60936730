"""Imports every mixer family so that its ``@register_mixer`` entries exist.

A new family is one file in ``hybrid_lm/model/`` plus one import line here.
"""

from hybrid_lm.model import attention  # noqa: F401  (attention, swa)
from hybrid_lm.model import stochastic  # noqa: F401  (sa, sa_swa)
from hybrid_lm.model import moba  # noqa: F401  (moba)
