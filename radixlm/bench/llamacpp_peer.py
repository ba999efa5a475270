"""llama.cpp's own speed on a GGUF, measured in-process through llama-cpp-python.

Run by the interpreter that has llama-cpp-python (the `bench-llamacpp` extra,
often a separate virtual environment), as a script: it imports nothing from
radixlm. Prints one JSON line: prefill tokens/s over a prompt of `--prompt-len`
tokens, then decode tokens/s over `--decode-len` single-token steps (no
sampling: each step evaluates a fixed token, so only the forward is timed).

    python radixlm/bench/llamacpp_peer.py MODEL.gguf --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from llama_cpp import Llama

    ctx = args.prompt_len + args.decode_len + 8
    llm = Llama(args.model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=ctx,
                n_batch=args.prompt_len, n_ubatch=args.prompt_len, verbose=False)
    prompt = [(i * 7919) % 4000 + 100 for i in range(args.prompt_len)]
    prefill, decode = [], []
    for _ in range(args.repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill.append(args.prompt_len / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for i in range(args.decode_len):
            llm.eval([(i * 31) % 4000 + 100])
        decode.append(args.decode_len / (time.perf_counter() - t0))
    print(json.dumps({"prefill_tok_s": statistics.median(prefill),
                      "decode_tok_s": statistics.median(decode),
                      "threads": args.threads, "prompt_len": args.prompt_len,
                      "decode_len": args.decode_len}))


if __name__ == "__main__":
    main()
