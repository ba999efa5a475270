"""CPU decode of an offline Engine whose process imported torch before radixlm
(OpenMP keeps its busy-wait policy) or after it (radixlm set PASSIVE in time).

    python benchmarks/omp_import_order.py torch-first   --model /tmp/olmoe-4l-q4_0.gguf
    python benchmarks/omp_import_order.py radixlm-first --model /tmp/olmoe-4l-q4_0.gguf

Run with OMP_WAIT_POLICY unset, alternating the two orders over several
processes (the policy is fixed per process). Prints, for 3 timed calls of 32
prompt tokens and 128 greedy tokens, 128 / the call's time (prefill included),
sorted.
"""

import sys

if sys.argv[1:2] == ["torch-first"]:
    import torch  # noqa: F401  (before radixlm: the point of this order)

import argparse  # noqa: E402
import time  # noqa: E402

import radixlm  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("order", choices=["torch-first", "radixlm-first"])
    p.add_argument("--model", required=True, help="a .gguf file")
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args()
    engine = radixlm.Engine(model_path=args.model, quantization="gguf", dtype="bfloat16",
                            skip_tokenizer_init=True, log_level="error")
    prompt = [[100 + i for i in range(32)]]
    sp = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=prompt, sampling_params=sp)  # warm-up
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params=sp)
        rates.append(args.output_len / (time.perf_counter() - start))
    print(f"{args.order}: OMP_BUSY_WAIT={radixlm.OMP_BUSY_WAIT}, tok/s "
          + " ".join(f"{r:.1f}" for r in sorted(rates)))
    engine.shutdown()


if __name__ == "__main__":
    main()
