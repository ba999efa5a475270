"""Does Hopper's fast FP8 accumulation change a model's answers? Online FP8
(per-channel weights, W8A8 prefill) with the GEMM's per-channel sums promoted
to fp32 every 128 terms (the default) and kept in the MMA's accumulator over
the whole K (`GemmConfig.promote=False`), each against the model holding the
dequantized FP8 weights, on many prompts (CUDA).

    python benchmarks/fp8_sums_agreement.py [--prompts 200] [--tame 0.05]

The model is tests/gpu/test_quant_gpu.py's random Llama (hidden 1024, 4
layers, projections scaled by --tame); each prompt decodes one token. Per
form: mean / max |prompt logprob difference| against the reference, first
tokens equal, and at each first token that differs, by how much the
reference preferred its own token to ours (in nats, from its top 8; 0 is an
exact tie of the reference): flips at margins of a few hundredths are
near-ties that any rounding may turn, larger ones are the sums' doing. The
reference's own margins are summarized for scale.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "gpu")]
from gpu_models import MARGIN_TOP, agreement, first_token_margins  # noqa: E402
from quant_checkpoints import (  # noqa: E402
    GPU_LLAMA,
    GPU_TAME,
    save_tame_model,
    tiny_llama,
    write_online_fp8_dequantized,
)

import radixlm  # noqa: E402
from radixlm.layers.quantization.triton_ops import fp8 as F  # noqa: E402


def models(root: Path, tame: float) -> tuple[str, str]:
    """(the float model, the same with each projection's online-FP8 dequantized weight)."""
    config = tiny_llama(**GPU_LLAMA)
    floats = save_tame_model(config, root / "float", tame)
    return str(root / "float"), write_online_fp8_dequantized(root, config, floats)


def run(path: str, quantization: str | None, prompts: list[list[int]]) -> list[dict]:
    with radixlm.Engine(path, dtype="bfloat16", skip_tokenizer_init=True,
                        max_total_tokens=1 << 17, quantization=quantization) as e:
        return e.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1,
                                                              "temperature": 0,
                                                              "ignore_eos": True},
                          return_logprob=True, logprob_start_len=0,
                          top_logprobs_num=MARGIN_TOP)


def ref_margin(r: dict) -> float:
    first, second = r["meta_info"]["output_top_logprobs"][0][:2]  # (logprob, id, ...)
    return first[0] - second[0]


def report(label: str, ours: list[dict], ref: list[dict]) -> None:
    a = agreement(ours, ref)
    flips = [f"{m:.3f}" if m < float("inf") else f"not in its top {MARGIN_TOP}"
             for m in first_token_margins(ours, ref)]
    print(f"{label:<9} mean / max |prompt logprob diff| {a.mean:.4f} / {a.max:.3f}; "
          f"first tokens equal {a.first}/{len(ours)}; "
          f"the reference's margins where not: {', '.join(flips) or '-'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--tame", type=float, default=GPU_TAME, help="the projections' scale")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, GPU_LLAMA["vocab_size"], (int(n),), generator=g).tolist()
               for n in torch.randint(5, 300, (args.prompts,), generator=g)]
    with tempfile.TemporaryDirectory() as tmp:
        float_path, ref_path = models(Path(tmp), args.tame)
        ref = run(ref_path, None, prompts)
        margins = sorted(ref_margin(r) for r in ref)
        print(f"reference: top-2 margins < 0.05 nats {sum(m < 0.05 for m in margins)}, "
              f"< 0.1 {sum(m < 0.1 for m in margins)}, < 0.2 {sum(m < 0.2 for m in margins)} "
              f"of {len(margins)}; median {margins[len(margins) // 2]:.3f}")
        pick = F.pick_gemm_config
        for label, promote in (("promoted", True), ("fast", False)):
            # The engine runs in this process at tp 1: its GEMMs take the patched picks.
            F.pick_gemm_config = lambda *a, promote=promote, **k: pick(*a, **k)._replace(
                promote=promote)
            try:
                report(label, run(float_path, "fp8", prompts), ref)
            finally:
                F.pick_gemm_config = pick


if __name__ == "__main__":
    main()
