"""Imports every mixer family so that its ``@register_mixer`` entries exist.

Adding a mixer: docs/MIXERS.md, "Adding a mixer" (one file; shipped with hybrid_lm, it is imported here).
"""

from hybrid_lm.model import attention  # noqa: F401  (attention, swa)
from hybrid_lm.model import constrained_attention  # noqa: F401  (attention_sink)
from hybrid_lm.model import stochastic  # noqa: F401  (sa, sa_swa)
from hybrid_lm.model import moba  # noqa: F401  (moba)
from hybrid_lm.model import lightning  # noqa: F401  (lightning)
from hybrid_lm.model import mamba2  # noqa: F401  (mamba2)
from hybrid_lm.model import gated_deltanet  # noqa: F401  (gdn)
from hybrid_lm.model import ssa  # noqa: F401  (ssa)
