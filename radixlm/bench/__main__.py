"""python -m radixlm.bench MODE [options]

MODE: offline, one-batch, shared-prefix, serving, ttft, mixed-chunk, priority,
llamacpp-serving, gguf-agreement, quant, quant-perplexity, moe-gguf, speculative.
"""

from __future__ import annotations

import importlib
import sys

# mode -> (module under radixlm.bench, whether its main takes the mode name too,
# whether its return value is the exit status)
MODES: dict[str, tuple[str, bool, bool]] = {
    "offline": ("offline", True, False),
    "one-batch": ("offline", True, False),
    "shared-prefix": ("shared_prefix", False, False),
    "serving": ("serving", False, False),
    "ttft": ("ttft", False, False),
    "mixed-chunk": ("scheduling", True, False),
    "priority": ("scheduling", True, False),
    "llamacpp-serving": ("llamacpp_serving", False, True),
    "gguf-agreement": ("gguf_agreement", False, False),
    "quant": ("quant", False, False),
    "quant-perplexity": ("quant_perplexity", False, False),
    "moe-gguf": ("moe_gguf", False, False),
    "speculative": ("speculative", False, False),
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        print(f"usage: python -m radixlm.bench {{{','.join(MODES)}}} [options]")
        sys.exit(2)
    mode, argv = sys.argv[1], sys.argv[2:]
    module, takes_mode, returns_status = MODES[mode]
    run = importlib.import_module(f"radixlm.bench.{module}").main
    status = run(argv, mode) if takes_mode else run(argv)
    if returns_status:
        sys.exit(status)


if __name__ == "__main__":
    main()
