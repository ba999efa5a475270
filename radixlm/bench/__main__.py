"""python -m radixlm.bench MODE [options]

MODE: offline, one-batch, shared-prefix, serving, ttft, mixed-chunk, priority,
llamacpp-serving, gguf-agreement, quant, quant-perplexity, moe-gguf, speculative.
"""

from __future__ import annotations

import sys


def main() -> None:
    modes = ("offline", "one-batch", "shared-prefix", "serving", "ttft", "mixed-chunk",
             "priority", "llamacpp-serving", "gguf-agreement", "quant", "quant-perplexity",
             "moe-gguf", "speculative")
    if len(sys.argv) < 2 or sys.argv[1] not in modes:
        print(f"usage: python -m radixlm.bench {{{','.join(modes)}}} [options]")
        sys.exit(2)
    mode, argv = sys.argv[1], sys.argv[2:]
    if mode in ("offline", "one-batch"):
        from radixlm.bench.offline import main as run
        run(argv, mode)
    elif mode in ("mixed-chunk", "priority"):
        from radixlm.bench.scheduling import main as run
        run(argv, mode)
    elif mode == "llamacpp-serving":
        from radixlm.bench.llamacpp_serving import main as run
        sys.exit(run(argv))
    elif mode == "gguf-agreement":
        from radixlm.bench.gguf_agreement import main as run
        run(argv)
    elif mode == "quant":
        from radixlm.bench.quant import main as run
        run(argv)
    elif mode == "quant-perplexity":
        from radixlm.bench.quant_perplexity import main as run
        run(argv)
    elif mode == "moe-gguf":
        from radixlm.bench.moe_gguf import main as run
        run(argv)
    elif mode == "shared-prefix":
        from radixlm.bench.shared_prefix import main as run
        run(argv)
    elif mode == "speculative":
        from radixlm.bench.speculative import main as run
        run(argv)
    elif mode == "ttft":
        from radixlm.bench.ttft import main as run
        run(argv)
    else:
        from radixlm.bench.serving import main as run
        run(argv)


if __name__ == "__main__":
    main()
