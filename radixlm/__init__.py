"""radixlm: an LLM serving engine with a radix-tree prefix cache."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

# OpenMP's default busy-waiting makes torch 7-10x slower on the CPU whenever
# another process (tokenizer, detokenizer, HTTP server) wants a core. Must be
# set before torch loads its OpenMP runtime; an explicit setting wins. Where
# torch came first, the runtime already busy-waits: OMP_BUSY_WAIT says so, and
# a CPU engine warns (model_runner.py).
OMP_BUSY_WAIT = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

if TYPE_CHECKING:
    from radixlm.engine import Engine


def __getattr__(name: str) -> Any:
    # Lazy, so `import radixlm.layers...` (e.g. on a GPU box running kernel tests)
    # does not pull in the server's dependencies.
    if name == "Engine":
        from radixlm.engine import Engine
        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "__version__"]
