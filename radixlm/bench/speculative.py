"""Speculative decoding benchmarks; every table puts the plain run beside it.

    python -m radixlm.bench speculative copy [--repeats 3] [--output-len 96]
    python -m radixlm.bench speculative verify-cost [--model-path DIR --load-format dummy]
    python -m radixlm.bench speculative simulated --model-path DIR --load-format dummy

- `copy`: copy-heavy chat prompts (repeat / edit / reformat a given text),
  one request at a time, greedy; plain, NGRAM and STANDALONE with the model as
  its own draft (every draft accepted: the drafter's pure overhead), each run
  in turn within every repeat. Decode tok/s = (tokens - 1) / (time after the
  first token), min / median / max over the repeats, and tokens per verify.
- `verify-cost`: one forward of a verify batch (bs requests x (k + 1) rows)
  against a decode step of bs rows, through the model runner (CUDA graphs
  where the device has them), k = 1..8, bs = 1..64: the cost that speculation
  must win back, and where it stops being flat (`DEFAULT_MAX_VERIFY_TOKENS`).
- `simulated`: single-stream decode with a replayed draft: the plain run's own
  continuation with every (L)-th draft token wrong, so each verify keeps exactly
  L - 1 drafts plus its own token (acceptance length L, SIMULATED: no drafter
  reached it). In bf16 without --enable-deterministic-inference a verify row
  may round a near-tie otherwise than the decode row, so each case first finds
  the continuation its own verifies produce and replays that (`_calibrate`,
  reported with where it parts from the plain run). Measures the engine's
  verify path at a given acceptance, end to end and after the first token (a
  1-token request's time taken off). A case
  k,L,T with T > 1 replays a tree of k draft tokens instead (T children per
  level, the right one among wrong ones and the only one expanded, level L
  all wrong): the same draft-token budget and acceptance as the chain k,L
  where its depth ceil(k / T) >= L - 1, so the two rows compare a tree's verify
  (its per-row path tables, in CUDA graphs the request table's path rows)
  with a chain's. Tree cases start the engine with tree drafts configured
  (NGRAM, --speculative-eagle-topk max T), whose drafter the replay replaces.

    python -m radixlm.bench speculative simulated --model-path DIR --load-format dummy \
        --cases 6,4 6,4,2 6,4,3 8,3 8,3,4
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

COPY_TEXT = ("Mara kept bees on the roof of the old library. Every spring she opened the "
             "hives, counted the frames, and wrote the numbers in a notebook with a green "
             "cover. The bees flew over the river to the orchards, and in June the honey "
             "tasted of apple blossom and dust.")
COPY_TASKS = (
    f"Repeat the following text exactly, word for word:\n\n{COPY_TEXT}",
    f"Rewrite the following text, changing 'bees' to 'wasps' and nothing else:\n\n{COPY_TEXT}",
    f"Copy the following text, putting each sentence on its own line:\n\n{COPY_TEXT}",
)


def _stats(xs: list[float]) -> str:
    return f"{min(xs):7.1f} {statistics.median(xs):7.1f} {max(xs):7.1f}"


# ---- copy ---------------------------------------------------------------------------
def _decode_rate(engine: Any, prompt: str, output_len: int) -> tuple[float, int]:
    """(decode tok/s after the first token, tokens) of one streamed greedy request."""
    t0 = time.perf_counter()
    first = None
    n = 0
    for chunk in engine.generate(prompt, {"temperature": 0, "max_new_tokens": output_len},
                                 stream=True):
        n += len(chunk["output_ids"])  # a streamed chunk carries the new tokens only
        if first is None and n:
            first = time.perf_counter()
    end = time.perf_counter()
    return (n - 1) / max(end - (first or t0), 1e-9), n


def copy_bench(args: argparse.Namespace) -> None:
    import radixlm
    from radixlm.models.loader import prepare_model_dir

    model = prepare_model_dir(args.model_path)
    base = dict(device=args.device, dtype=args.dtype, quantization=args.quantization,
                max_total_tokens=8192)
    configs = {
        "plain": {},
        f"NGRAM k={args.ngram_drafts}": dict(speculative_algorithm="NGRAM",
                                             speculative_num_steps=args.ngram_drafts),
        f"STANDALONE self k={args.model_drafts}": dict(
            speculative_algorithm="STANDALONE", speculative_draft_model_path=model,
            speculative_num_steps=args.model_drafts),
    }
    engines = {name: radixlm.Engine(model, **base, **kw) for name, kw in configs.items()}
    prompts = [engines["plain"].tokenizer.apply_chat_template(
        [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in COPY_TASKS]
    rates: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, int] = {}
    for e in engines.values():  # warm-up
        _decode_rate(e, prompts[0], 8)
    start = {name: _spec_counts(e) for name, e in engines.items()}
    for _ in range(args.repeats):
        for name, e in engines.items():
            t = 0.0
            n_all = 0
            for p in prompts:
                rate, n = _decode_rate(e, p, args.output_len)
                if n > 1:  # a one-token answer has no decode time
                    t += (n - 1) / rate
                    n_all += n - 1
            rates[name].append(n_all / t)
            tokens[name] = n_all
    print(f"\ncopy-heavy prompts ({len(prompts)}, one at a time), greedy, up to "
          f"{args.output_len} tokens; {args.device} {args.dtype}; {args.repeats} repeats")
    print(f"{'config':28} {'decode tok/s min   med     max':>30} {'x plain':>8} "
          f"{'tokens':>7} {'tok/verify':>10} {'accepted':>9}")
    plain = statistics.median(rates["plain"])
    for name, e in engines.items():
        verifies, drafts, accepted = (a - b for a, b in zip(_spec_counts(e), start[name]))
        per_verify = f"{1 + accepted / verifies:.2f}" if verifies else "-"
        share = f"{accepted / drafts:.0%}" if drafts else "-"
        print(f"{name:28} {_stats(rates[name]):>30} {statistics.median(rates[name]) / plain:8.2f}"
              f" {tokens[name]:7d} {per_verify:>10} {share:>9}")
    for e in engines.values():
        e.shutdown()


def _spec_counts(engine: Any) -> tuple[int, int, int]:
    st = engine.scheduler.stats
    return st.num_spec_verifies, st.num_draft_tokens, st.num_accepted_drafts


# ---- verify-cost -----------------------------------------------------------------------
def _forward(runner: Any, mode: Any, rows: list[tuple[int, list[int]]], kv: dict[int, int],
             keep: bool) -> None:
    from radixlm.forward_batch import ForwardBatch

    ids, prefix, ext, locs = [], [], [], []
    for slot, new in rows:
        pre = kv[slot]
        loc = runner.kv_pool.alloc(len(new))
        runner.req_to_token_pool.req_to_token[slot, pre:pre + len(new)] = \
            loc.to(runner.device, torch.int32)
        ids += new
        prefix.append(pre)
        ext.append(len(new))
        locs.append(loc)
    fb = ForwardBatch.build(mode, ids, [s for s, _ in rows], prefix, ext, torch.cat(locs),
                            runner.req_to_token_pool, runner.kv_pool, runner.attn_backend,
                            runner.device)
    runner.forward(fb)
    if keep:
        for slot, new in rows:
            kv[slot] += len(new)
    else:
        runner.kv_pool.free(torch.cat(locs))


def _time(fn: Any, device: torch.device, iters: int) -> float:
    """Median seconds of `fn()` over `iters` calls."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def verify_cost(args: argparse.Namespace) -> None:
    import radixlm

    kw = dict(device=args.device, dtype=args.dtype, load_format=args.load_format,
              skip_tokenizer_init=True, max_total_tokens=args.kv_tokens,
              disable_radix_cache=True)
    if args.quantization:
        kw["quantization"] = args.quantization
    with radixlm.Engine(args.model_path, **kw) as e:
        runner = e.scheduler.worker.runner
        g = torch.Generator().manual_seed(0)
        vocab = runner.vocab_size
        print(f"\nverify forward vs decode step, context {args.context} tokens per request; "
              f"{args.device} {args.dtype}; median of {args.iters} (ms)")
        ks = list(range(1, 9))
        print(f"{'bs':>4} {'decode':>8} " + " ".join(f"{'k=' + str(k):>8}" for k in ks)
              + "   (verify / decode)")
        for bs in args.batch_sizes:
            prompt = torch.randint(10, vocab - 1, (args.context,), generator=g).tolist()
            base, cells = _costs(runner, bs, prompt, ks, args.iters)
            print(f"{bs:4d} {base * 1e3:8.2f} " + " ".join(f"{c * 1e3:8.2f}" for c in cells)
                  + "   " + " ".join(f"{c / base:.2f}" for c in cells))


def _costs(runner: Any, bs: int, prompt: list[int], ks: list[int],
           iters: int) -> tuple[float, list[float]]:
    """(a decode step's seconds, a verify's for each k) of bs requests on `prompt`."""
    from radixlm.forward_batch import ForwardMode

    pool = runner.req_to_token_pool
    slots = [pool.alloc() for _ in range(bs)]
    kv = dict.fromkeys(slots, 0)
    _forward(runner, ForwardMode.EXTEND, [(s, prompt) for s in slots], kv, keep=True)

    def step(k: int) -> None:
        mode = ForwardMode.DECODE if k == 0 else ForwardMode.VERIFY
        _forward(runner, mode, [(s, [7] * (k + 1)) for s in slots], kv, keep=False)

    for k in [0, *ks]:
        step(k)  # warm-up
    base = _time(lambda: step(0), runner.device, iters)
    cells = [_time(lambda k=k: step(k), runner.device, iters) for k in ks]
    for s in slots:
        runner.kv_pool.free(pool.req_to_token[s, :kv[s]].to("cpu", torch.int64))
        pool.free(s)
    return base, cells


# ---- simulated -------------------------------------------------------------------------
class ReplayDrafter:
    """Proposes `k` tokens of a known continuation with every `length`-th one wrong,
    so each verify keeps exactly length - 1 drafts (SIMULATED acceptance)."""

    needs_host_tokens = True
    drafts_on_device = False

    def __init__(self, continuation: list[int], k: int, length: int, vocab: int) -> None:
        self.continuation, self.k, self.length, self.vocab = continuation, k, length, vocab

    def propose(self, reqs: list[Any]) -> dict[str, list[int]]:
        out = {}
        for r in reqs:
            n = len(r.output_ids)
            ahead = self.continuation[n:n + self.k]
            out[r.rid] = [(t + 1) % self.vocab if j == self.length - 1 else t
                          for j, t in enumerate(ahead)]
        return out

    def forget(self, rid: str) -> None:
        return None


class ReplayTreeDrafter(ReplayDrafter):
    """Proposes a tree of `k` tokens over the known continuation: per level `topk`
    children of the right node so far (fewer where the budget ends), the right
    token at a place varying with the position, the others wrong; level
    `length` has no right child, so each verify keeps exactly
    min(length, depth + 1) - 1 drafts (SIMULATED)."""

    def __init__(self, continuation: list[int], k: int, length: int, vocab: int,
                 topk: int) -> None:
        super().__init__(continuation, k, length, vocab)
        self.topk = topk

    def propose(self, reqs: list[Any]) -> dict[str, Any]:
        from radixlm.speculative.tree import DraftTree

        out: dict[str, Any] = {}
        for r in reqs:
            n = len(r.output_ids)
            tokens: list[int] = []
            parents: list[int] = []
            at = 0  # the row of the right node so far
            for j, t in enumerate(self.continuation[n:n + self.k]):
                left = self.k - len(tokens)
                if left <= 0:
                    break
                # The right child last among those the budget still has room for.
                place = min((n + j) % self.topk, left - 1)
                first = len(tokens) + 1
                for c in range(min(self.topk, left)):
                    right = c == place and j != self.length - 1
                    # Wrong children are t + 2.., never the target's t.
                    tokens.append(t if right else (t + 2 + c) % self.vocab)
                    parents.append(at)
                at = first + place
            if tokens:
                out[r.rid] = DraftTree(tokens, parents)
        return out


def _replay(case: tuple[int, ...], plain: list[int], vocab: int) -> ReplayDrafter:
    k, length = case[:2]
    topk = case[2] if len(case) > 2 else 1
    if topk > 1:
        return ReplayTreeDrafter(plain, k, length, vocab, topk)
    return ReplayDrafter(plain, k, length, vocab)


def _case_name(case: tuple[int, ...]) -> str:
    k, length = case[:2]
    if len(case) > 2 and case[2] > 1:
        return f"tree k={k} T={case[2]} L={length}"
    return f"k={k} L={length}"


def _tree_flags(cases: list[tuple[int, ...]]) -> dict[str, Any]:
    """Engine flags under which tree cases verify as the engine would serve trees
    (the Triton backend's start-up check, the graph runner's path rows)."""
    trees = [c for c in cases if len(c) > 2 and c[2] > 1]
    if not trees:
        return {}
    topk = max(c[2] for c in trees)
    depth = max(-(-c[0] // c[2]) for c in trees)
    return dict(speculative_algorithm="NGRAM", speculative_eagle_topk=topk,
                speculative_num_steps=depth)


def _first_difference(a: list[int], b: list[int]) -> int:
    """Where token lists a and b first differ (the shorter's length if one is a
    prefix of the other); -1 if they are equal."""
    if a == b:
        return -1
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _calibrate(engine: Any, case: tuple[int, ...], plain: list[int], vocab: int,
               prompt: list[int], sp: dict[str, Any], passes: int = 4
               ) -> tuple[list[int], tuple[int, int]]:
    """The continuation a replay of `case` must draft so its acceptance holds in bf16
    without the deterministic flag: (tokens, (runs taken, first token parting from
    `plain`, or -1)).

    A verify row is not rounded as a decode row is, so greedy tokens under
    speculation may part from the plain run's at a near-tie, and a replay of the
    plain run would then be rejected from there on. But every verify of a case has
    the same row count, and a row's products and its attention (computed as the
    decode step at its position) do not depend on its place among the rows: the
    speculative run's own output, replayed, reproduces itself. Replay, take the
    output as the next reference, until it holds (or `passes` runs)."""
    ref, runs = plain, 0
    while runs < passes:
        runs += 1
        engine.scheduler.drafter = _replay(case, ref, vocab)
        out = engine.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
        if out == ref:
            break
        ref = out
    return ref, (runs, _first_difference(ref, plain))


def simulated(args: argparse.Namespace) -> None:
    import radixlm

    kw = dict(device=args.device, dtype=args.dtype, load_format=args.load_format,
              skip_tokenizer_init=True, max_total_tokens=args.kv_tokens,
              enable_deterministic_inference=args.enable_deterministic_inference,
              **_tree_flags(args.cases))
    # Losslessness is exact in fp32 and under the deterministic flag; in bf16 without
    # it a verify row is not computed as a decode row is, so greedy tokens may part
    # at a near-tie: each case then replays its own continuation (`_calibrate`).
    exact = args.dtype == "float32" or args.enable_deterministic_inference
    parted: dict[str, int] = {}
    calibrated: dict[str, tuple[int, int]] = {}
    g = torch.Generator().manual_seed(0)
    with radixlm.Engine(args.model_path, **kw) as e:
        vocab = e.scheduler.vocab_size
        prompt = torch.randint(10, vocab - 1, (args.context,), generator=g).tolist()
        sp = {"temperature": 0, "ignore_eos": True, "max_new_tokens": args.output_len}
        plain = e.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
        print(f"\nsingle stream, {args.context}-token prompt, {args.output_len} tokens, "
              f"{args.device} {args.dtype}; SIMULATED acceptance (a replayed draft); "
              f"{args.repeats} repeats, tok/s min / median / max")
        rows = [("plain", None)] + [(_case_name(c), c) for c in args.cases]
        refs: dict[str, list[int]] = {"plain": plain}
        for name, case in rows[1:]:
            refs[name] = plain
            if not exact:
                refs[name], calibrated[name] = _calibrate(e, case, plain, vocab, prompt, sp)
        rates: dict[str, list[float]] = {name: [] for name, _ in rows}
        decode: dict[str, list[float]] = {name: [] for name, _ in rows}  # after token 1
        first = {**sp, "max_new_tokens": 1}
        counts = {name: [0, 0] for name, _ in rows}  # verifies, accepted drafts
        for _ in range(args.repeats):
            for name, case in rows:
                ref = refs[name]
                e.scheduler.drafter = None if case is None else _replay(case, ref, vocab)
                t0 = time.perf_counter()
                e.generate(input_ids=prompt, sampling_params=first)
                one = time.perf_counter() - t0
                before = _spec_counts(e)
                t0 = time.perf_counter()
                out = e.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
                elapsed = time.perf_counter() - t0
                rates[name].append(len(out) / elapsed)
                decode[name].append((len(out) - 1) / (elapsed - one))
                after = _spec_counts(e)
                counts[name][0] += after[0] - before[0]
                counts[name][1] += after[2] - before[2]
                if out != ref:
                    assert not exact, f"{name}: tokens changed"
                    parted[name] = _first_difference(out, ref)
        base = statistics.median(rates["plain"])
        print("tok/s: end to end (the cached prompt's prefill step included); decode: "
              "after the first token (the time of a 1-token request taken off)")
        print(f"{'config':22} {'tok/s min   med     max':>24} {'x plain':>8} "
              f"{'decode min  med     max':>24} {'tok/verify':>10}")
        for name, _ in rows:
            verifies, accepted = counts[name]
            per_verify = f"{1 + accepted / verifies:.2f}" if verifies else "-"
            print(f"{name:22} {_stats(rates[name]):>24} "
                  f"{statistics.median(rates[name]) / base:8.2f} {_stats(decode[name]):>24} "
                  f"{per_verify:>10}")
        for name, (passes, first) in calibrated.items():
            where = ("equals the plain run's" if first < 0 else
                     f"parts from the plain run's at token {first} (bf16 rounds a verify "
                     "row as it does not a decode row)")
            print(f"{name}: replays its own verifies' continuation (found in {passes} "
                  f"run(s)), which {where}")
        for name, at in parted.items():
            print(f"{name}: greedy tokens parted from the replayed continuation at token "
                  f"{at}; the acceptance after it is below the replayed L")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m radixlm.bench speculative")
    p.add_argument("what", choices=("copy", "verify-cost", "simulated"))
    p.add_argument("--model-path", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--ngram-drafts", type=int, default=4)
    p.add_argument("--model-drafts", type=int, default=3)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--kv-tokens", type=int, default=65536)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="simulated: batch-invariant kernels, so bf16 greedy tokens must "
                        "match the plain run exactly")
    p.add_argument("--cases", type=lambda s: tuple(int(x) for x in s.split(",")), nargs="+",
                   default=[(2, 3), (3, 3), (4, 4), (6, 5)],
                   help="k,L pairs: drafts per verify, simulated acceptance length; "
                        "k,L,T: a tree of k drafts, T children per level (SIMULATED)")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.quantization is None and args.device == "cpu" and args.what == "copy":
        args.quantization = "none"
    {"copy": copy_bench, "verify-cost": verify_cost, "simulated": simulated}[args.what](args)
