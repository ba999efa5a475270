"""A .gguf model on its blocks (--quantization gguf) against its dequantized weights.

    python -m radixlm.bench gguf-agreement [--new-tokens 64] [--dtype float32] [SERVER ARGS]

Both engines load the same file with the same arguments but --quantization
(gguf, then none); the weights are the same numbers, and only the
activations' int8 rounding in our kernels differs. Prints, for each of ten
fixed prompts, how many greedy tokens agree before the first divergence (EOS
ignored, so every sequence runs to --new-tokens) and the dequantized model's
margin between its top two tokens there (a small one: a near-tie that the
rounding tipped), and the perplexity of each on a fixed text (teacher-forced:
the text's own logprobs).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from radixlm.config import ServerArgs

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "Explain why the sky is blue in one sentence.",
    "The quick brown fox",
    "In 1969, Neil Armstrong",
    "Translate to French: good morning, my friend. ->",
    "The three primary colors are",
    "import numpy as np\n\n# Compute the mean of each row\n",
]

# Public-domain prose (Jane Austen, 1813) and a little code: the perplexity text.
TEXT = """It is a truth universally acknowledged, that a single man in possession of a good \
fortune, must be in want of a wife.

However little known the feelings or views of such a man may be on his first entering a \
neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he \
is considered the rightful property of some one or other of their daughters.

"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is \
let at last?"

Mr. Bennet replied that he had not.

"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."

Mr. Bennet made no answer.

"Do you not want to know who has taken it?" cried his wife impatiently.

"You want to tell me, and I have no objection to hearing it."

This was invitation enough.

def mean_of_rows(rows):
    \"\"\"The mean of each row of a list of lists of numbers.\"\"\"
    return [sum(row) / len(row) for row in rows if row]
"""


@dataclass
class Side:
    name: str
    greedy: list[list[int]]
    gaps: list[list[float]]  # per token: top-1 minus top-2 logprob (the choice's margin)
    perplexity: float


def greedy(engine, prompts: list[str], new_tokens: int
           ) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt's greedy tokens, and each token's margin over the runner-up."""
    sp = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    outs = engine.generate(prompts, sp, return_logprob=True, top_logprobs_num=2)
    gaps = [[top[0][0] - top[1][0] for top in o["meta_info"]["output_top_logprobs"]]
            for o in outs]
    return [o["output_ids"] for o in outs], gaps


def perplexity(engine, text: str) -> float:
    """exp of the mean negative log-likelihood of the text's tokens after the first."""
    out = engine.generate(text, {"max_new_tokens": 1, "temperature": 0.0},
                          return_logprob=True, logprob_start_len=0)
    logprobs = [lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def first_divergence(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_side(server_args: ServerArgs, quantization: str, prompts: list[str], new_tokens: int,
             text: str) -> Side:
    from radixlm.engine import Engine

    kwargs = {**vars(server_args), "quantization": quantization}
    with Engine(**kwargs) as engine:
        return Side(quantization, *greedy(engine, prompts, new_tokens),
                    perplexity(engine, text))


def compare(server_args: ServerArgs, prompts: list[str] = PROMPTS, new_tokens: int = 64,
            text: str = TEXT) -> tuple[Side, Side, list[int]]:
    """(quantized, dequantized, tokens until the first divergence per prompt)."""
    quant = run_side(server_args, "gguf", prompts, new_tokens, text)
    floats = run_side(server_args, "none", prompts, new_tokens, text)
    agree = [first_divergence(a, b) for a, b in zip(quant.greedy, floats.greedy, strict=True)]
    return quant, floats, agree


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixlm.bench gguf-agreement",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    new_tokens = args.new_tokens
    server_args = ServerArgs.from_cli_args(args)
    if server_args.quantization not in (None, "auto"):
        parser.error("--quantization is this benchmark's to set (gguf, then none)")
    quant, floats, agree = compare(server_args, PROMPTS, new_tokens, TEXT)
    print(f"\n| prompt | greedy tokens until the first divergence (of {new_tokens}) | "
          "dequantized model's margin there (top-1 - top-2 logprob) |")
    print("|---|---|---|")
    for i, (prompt, n) in enumerate(zip(PROMPTS, agree, strict=True)):
        shown = prompt.replace("\n", "\\n")
        margin = f"{floats.gaps[i][n]:.3f}" if n < new_tokens else "-"
        print(f"| {shown[:48]} | {n if n < new_tokens else f'{n} (none)'} | {margin} |")
    identical = sum(n == new_tokens for n in agree)
    print(f"\n{identical} of {len(agree)} sequences identical; mean tokens before a divergence "
          f"{sum(agree) / len(agree):.1f}, min {min(agree)}")
    ratio = quant.perplexity / floats.perplexity
    print(f"perplexity on the fixed text: gguf {quant.perplexity:.3f}, dequantized "
          f"{floats.perplexity:.3f} ({ratio - 1:+.2%})")
