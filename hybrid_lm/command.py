"""What every ``hybrid-lm`` command runs inside, once ``hybrid_lm/cli.py`` has parsed it: the determinism
flags and the compilation cache first, a user mistake as one line, a failed multi-process run's exit."""

from __future__ import annotations

import sys

from hybrid_lm import determinism
from hybrid_lm.compile_cache import enable_compilation_cache
from hybrid_lm.errors import ConfigError, DataError, WorkdirError
from hybrid_lm.train import distributed
from hybrid_lm.train.distributed import ClusterError


def run(args, debug: bool) -> int:
    """Run the parsed command ``args.fn``: a user mistake is one line on stderr and status 2 (``debug``: the
    traceback); a failed multi-process run then ends without JAX's shutdown barrier."""
    try:
        determinism.apply()  # HYBRID_LM_DETERMINISTIC=1: into XLA_FLAGS before the XLA backend starts
        enable_compilation_cache()
        rc = args.fn(args)
    except BrokenPipeError:
        raise  # cli.main(): the reader of stdout left, nothing to report
    except (ConfigError, WorkdirError, DataError, ImportError, OSError, ClusterError) as e:
        if debug:
            raise
        print(f"{_label(e)}: {_one_line(e)}", file=sys.stderr)
        rc = 2
    distributed.leave_if_failing(rc)
    return rc


def _label(e: BaseException) -> str:
    return "config error" if isinstance(e, ConfigError) else "data error" if isinstance(e, DataError) else "error"


def _one_line(e: BaseException) -> str:
    """The message on one line (a user mistake; --debug shows the traceback)."""
    text = str(e).strip() or type(e).__name__
    if isinstance(e, OSError) and not isinstance(e, (ConfigError, WorkdirError, DataError)):
        text = f"{e.strerror or type(e).__name__}: {e.filename}" if e.filename else text
    return " ".join(text.split())
