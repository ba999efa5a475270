"""A GGUF MoE file of a real model's shape with random blocks, for the CPU serving
benchmark (`bench llamacpp-serving --model` on it: ours beside llama.cpp's server).

    python -m radixlm.bench moe-gguf --out /tmp/olmoe-4l-q4_0.gguf --layers 4

OLMoE-1B-7B's shape by default (hidden 2048, 16 heads, 64 experts of 1024,
top-8, no renormalization), with fewer layers so that it fits this machine,
written as llama.cpp's converter writes an `olmoe` file: stacked experts
`ffn_{gate,up,down}_exps`, the router `ffn_gate_inp` (F32), q/k norms over the
whole projection. Matrices are random blocks of `--experts-type` (experts)
and `--type` (attention, embedding, head) whose values have the spread of a
trained model's weights (std ~0.02); norms are one. The vocabulary and
tokenizer are the embedded SmolLM2 file's (49152 tokens: both servers need a
real tokenizer to serve text), so the embedding and head are [49152, hidden].
Tensors are written one at a time: the file is never all in memory.
`--hidden/--heads/--inter/--experts/--top-k` shrink the shape (a `--layers 1
--hidden 256` file takes seconds: for trying a peer on it).

llama.cpp's `olmoe` loader takes the file as written (tensor names, ggml dims,
hparams and vocabulary: `tests/test_moe_gguf.py` checks them against gguf-py's
tables), and a llama.cpp build without its AMX backend serves it. A build with
the AMX backend (llama-cpp-python 0.3.36 built natively here: `AMX_INT8 = 1` in
its log) segfaults on its first forward of any file whose Q4_0/Q4_1/Q8_0
matrices it places in its AMX buffer, the embedded dense SmolLM2 included: its
compiled tile-config init loads a half-initialized 64-byte config with
`ldtilecfg`, a general-protection fault (SIGSEGV). So the peer for this file is
a llama-cpp-python built without that backend (no `AMX_INT8` in the log's `CPU :`
line; moe_gguf_peer_report.md has the crash and the figures).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

# Bytes and values per block, and the value spread per unit of the block scale.
_BLOCKS = {"Q4_0": (18, 32, 4.6), "Q8_0": (34, 32, 74.0)}
WEIGHT_STD = 0.02


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] of random `kind` blocks with values of std ~WEIGHT_STD."""
    nbytes, values, spread = _BLOCKS[kind]
    if cols % values:
        raise ValueError(f"{cols} columns are not whole {kind} blocks of {values}")
    blocks = rows * cols // values
    out = rng.integers(0, 256, size=(blocks, nbytes), dtype=np.uint8)
    scale = np.full(blocks, WEIGHT_STD / spread, dtype=np.float16)
    out[:, :2] = scale.view(np.uint8).reshape(blocks, 2)
    return out.reshape(rows, -1)


def olmoe_tensors(layers: int, hidden: int, heads: int, experts: int, inter: int, vocab: int
                  ) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, HF-order shape, role) of every tensor of an OLMoE model."""
    yield "token_embd.weight", (vocab, hidden), "matrix"
    for i in range(layers):
        b = f"blk.{i}"
        yield f"{b}.attn_norm.weight", (hidden,), "norm"
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            yield f"{b}.{part}.weight", (hidden, hidden), "matrix"
        yield f"{b}.attn_q_norm.weight", (hidden,), "norm"
        yield f"{b}.attn_k_norm.weight", (hidden,), "norm"
        yield f"{b}.ffn_norm.weight", (hidden,), "norm"
        yield f"{b}.ffn_gate_inp.weight", (experts, hidden), "router"
        yield f"{b}.ffn_gate_exps.weight", (experts, inter, hidden), "experts"
        yield f"{b}.ffn_up_exps.weight", (experts, inter, hidden), "experts"
        yield f"{b}.ffn_down_exps.weight", (experts, hidden, inter), "experts"
    yield "output_norm.weight", (hidden,), "norm"
    yield "output.weight", (vocab, hidden), "matrix"


def _copy_tokenizer(writer: object, source: str) -> int:
    """Copy the tokenizer.* metadata of GGUF file `source`; returns its vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(source)
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), vtype, sub_type=sub)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def write(out: Path, layers: int, kind: str, experts_kind: str, seed: int = 0, *,
          hidden: int = 2048, heads: int = 16, experts: int = 64, top_k: int = 8,
          inter: int = 1024, context: int = 4096, tokenizer: str | None = None,
          vocab: int | None = None) -> None:
    """`tokenizer`: the GGUF file whose tokenizer to copy (default: the embedded
    model's); `vocab` instead: no tokenizer, a vocabulary of that size."""
    import gguf

    from radixlm.models.loader import default_model_path

    w = gguf.GGUFWriter(str(out), "olmoe")
    if vocab is None:
        vocab = _copy_tokenizer(w, tokenizer or default_model_path())
    w.add_name(f"random OLMoE-1B-7B shape, {layers} layers")
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_expert_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(experts)
    w.add_expert_used_count(top_k)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)
    makers: list[Callable[[], np.ndarray]] = []
    for name, shape, role in olmoe_tensors(layers, hidden, heads, experts, inter, vocab):
        if role == "norm":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
            makers.append(lambda shape=shape: np.ones(shape, dtype=np.float32))
        elif role == "router":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
            makers.append(lambda shape=shape: rng.normal(0, WEIGHT_STD, shape).astype(np.float32))
        else:
            qtype = experts_kind if role == "experts" else kind
            rows, cols = int(np.prod(shape[:-1])), shape[-1]
            row_bytes = cols // _BLOCKS[qtype][1] * _BLOCKS[qtype][0]
            w.add_tensor_info(name, (*shape[:-1], row_bytes), np.dtype(np.uint8),
                              rows * row_bytes, raw_dtype=gguf.GGMLQuantizationType[qtype])
            makers.append(lambda rows=rows, cols=cols, qtype=qtype:
                          random_blocks(qtype, rows, cols, rng))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for make in makers:
        w.write_tensor_data(make())
    w.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m radixlm.bench moe-gguf",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--type", default="Q8_0", choices=sorted(_BLOCKS),
                   help="attention, embedding and head blocks")
    p.add_argument("--experts-type", default="Q4_0", choices=sorted(_BLOCKS))
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--inter", type=int, default=1024, help="each expert's intermediate size")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    write(Path(args.out), args.layers, args.type, args.experts_type, args.seed,
          hidden=args.hidden, heads=args.heads, inter=args.inter, experts=args.experts,
          top_k=args.top_k)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 2**20:.0f} MiB)")
