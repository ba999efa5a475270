"""Speculative sampling: keeping drafts that were sampled from a draft distribution.

A drafter that samples its draft d at position j from a distribution q_j (a
draft model at temperature > 0) hands q_j along with d. The target's
distribution at that position, p_j, is what `Sampler` would draw from there (the
request's bias, penalties, temperature, top-k / top-p / min-p, with drafts
0..j-1 as context). Position by position (Leviathan et al., Chen et al. 2023):

- accept d with probability min(1, p_j(d) / q_j(d)): u_j * q_j(d) < p_j(d) for a
  uniform u_j;
- at the first rejection, draw the position's token from norm(max(0, p_j - q_j))
  and stop;
- when every draft is accepted, the verify's last row draws the next token from
  p_k as a plain decode step would.

Each position's token is then distributed as p_j exactly, whatever q was. The
randomness is seeded per request and output position like the sampler's
(`noise_key`), from three independent streams: the draft's draw (salted seed,
`draft_keys`), the acceptance test (another salt) and the residual draw (the
target's own key). A drafter that proposes without sampling (n-grams, greedy
drafts) passes no q: its drafts are kept while they equal the target's own
seeded token, which is the same test for a one-hot q.
"""

from __future__ import annotations

import torch
from torch import Tensor

from radixlm.layers.sampler import (
    SamplingBatchInfo,
    filter_logits,
    gumbel_argmax,
    neg_gumbel_noise,
    noise_key,
    process_logits,
)
from radixlm.sampling_params import SamplingParams
from radixlm.utils import to_device

DRAFT_SALT = 0x5D2AF7E1C3B94A67
ACCEPT_SALT = 0x2C81D5E9A70F3B13


def draw_params(params: SamplingParams) -> SamplingParams:
    """What a draft model's draw applies of a request's parameters: temperature
    and the top-k / top-p / min-p truncation (any q is exact; context-dependent
    adjustments would only cost host work per draft step)."""
    return SamplingParams(temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k, min_p=params.min_p)


def draft_info(params: list[SamplingParams], seeds: list[int], steps: list[int],
               vocab_size: int, device: torch.device) -> SamplingBatchInfo:
    """Sampling info of draft rows (every row sampled): `draw_params`, salted seeds."""
    n = len(params)
    return SamplingBatchInfo.build([draw_params(p) for p in params],
                                   [s ^ DRAFT_SALT for s in seeds], steps, [[]] * n,
                                   [[]] * n, [set()] * n, vocab_size, device)


def filtered_logits(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """log p up to a per-row constant, for rows that all sample (none greedy):
    processed (bias, penalties, bans), tempered, truncated (-inf)."""
    assert info.sampled_rows is None, "filtered_logits needs every row sampled"
    processed = process_logits(logits.float(), info)
    return filter_logits(processed / info.temperatures, info, None)


def sample_drafts(logits: Tensor, info: SamplingBatchInfo) -> tuple[Tensor, Tensor]:
    """(a draft token per row drawn from its q, q [rows, V]) for rows that all sample."""
    scores = filtered_logits(logits, info)
    q = torch.softmax(scores, dim=-1)
    return gumbel_argmax(scores, info.noise_keys), q


def uniform(keys: Tensor) -> Tensor:
    """One uniform in (0, 1) per row key (the sampler's hash, at token 0)."""
    return torch.exp(-torch.exp(neg_gumbel_noise(keys, 1)[:, 0]))


def verify_sampled(logits: Tensor, info: SamplingBatchInfo, rows: list[list[int]],
                   drafts: list[list[int]], q: list[Tensor], sampled: Tensor, seeds: list[int],
                   first_steps: list[int]) -> tuple[Tensor, Tensor]:
    """Speculative sampling for requests whose drafts came with q.

    `logits`, `info`: the verify's rows of these requests only (`rows[i]` indexes
    request i's k_i + 1 rows in them, all sampled); `drafts[i]`: its k_i drafts,
    `q[i]` [k_i, V]; `sampled` the sampler's token per row (the last row's is the
    bonus); `first_steps[i]`: the output index of its first row's token.
    Returns (tokens [n, K + 1] padded, counts [n])."""
    device = logits.device
    n, width = len(drafts), max(len(d) for d in drafts) + 1
    vocab = min(logits.shape[1], min(t.shape[1] for t in q))
    p = torch.softmax(filtered_logits(logits, info)[:, :vocab], dim=-1)
    lens = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
    index = torch.tensor([[r[min(j, len(r) - 1)] for j in range(width)] for r in rows],
                         dtype=torch.int64)
    pad_d = torch.tensor([d + [0] * (width - 1 - len(d)) for d in drafts], dtype=torch.int64)
    pad_q = torch.zeros((n, width - 1, vocab), dtype=torch.float32, device=device)
    for i, qi in enumerate(q):
        pad_q[i, :qi.shape[0]] = qi[:, :vocab]
    index, pad_d, lens = (to_device(t, device) for t in (index, pad_d, lens))
    p_rows = p[index[:, :-1]]  # [n, K, V]
    pd = p_rows.gather(2, pad_d[..., None])[..., 0]
    qd = pad_q.gather(2, pad_d[..., None])[..., 0]
    keys = torch.tensor([[noise_key(s ^ ACCEPT_SALT, f + j) for j in range(width - 1)]
                         for s, f in zip(seeds, first_steps)], dtype=torch.int64)
    u = uniform(to_device(keys, device).view(-1)).view(n, width - 1)
    live = torch.arange(width - 1, device=device)[None, :] < lens[:, None]
    accept = ((u * qd < pd) & live).to(torch.int64).cumprod(dim=1)
    a = accept.sum(dim=1)  # accepted drafts
    tokens = torch.where(accept.bool(), pad_d, 0)
    tokens = torch.cat([tokens, tokens.new_zeros((n, 1))], dim=1)
    # The token at position a: the residual draw where a draft was rejected, the
    # sampler's draw from p_k where all were accepted.
    at = torch.arange(n, device=device)
    rejected = a < lens
    row = index[at, a]
    redrawn = gumbel_argmax(residual(p[row], pad_q[at, a.clamp(max=width - 2)]).log(),
                            info.noise_keys[row])
    tokens[at, a] = torch.where(rejected, redrawn, sampled[row])
    return tokens, a + 1


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) up to its scale, per row: what a rejected position draws
    from (p itself where p <= q everywhere, which only rounding makes possible)."""
    r = (p - q).clamp_(min=0)
    return torch.where(r.sum(dim=1, keepdim=True) > 0, r, p)


def token_logprobs(logits: Tensor, info: SamplingBatchInfo, tokens: Tensor) -> Tensor:
    """Each row's logprob of `tokens` under its processed logits (what `Sampler`
    reports for the token it chose)."""
    processed = process_logits(logits.float(), info)
    lse = torch.logsumexp(processed, dim=-1)
    return processed.gather(1, tokens[:, None])[:, 0] - lse
