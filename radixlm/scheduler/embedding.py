"""Embedding requests (`--is-embedding`): prefill only, pooled final hidden states.

A generation model serves embeddings as SGLang does for decoder models: the
final-normed hidden state of the prompt's last token ("last", the default),
or optionally the mean over every prompt token ("mean"), L2-normalized.
Chunked prefill is transparent: "last" reads the final chunk's last row,
"mean" adds each chunk's rows to a running float32 sum on the request.

Embedding requests never reuse the prefix cache (the scheduler turns it off
on an embedding server): a cache hit skips computing the cached positions,
and pooling needs their hidden states, which are not cached (only K/V are).
"""

from __future__ import annotations

import torch

from radixlm.scheduler.req import Req


@torch.inference_mode()
def pool_chunk(hidden: list[torch.Tensor], reqs: list[Req], last_chunk: list[bool],
               pooling: str) -> None:
    """Fold one prefill round's hidden rows (`hidden[i]`: request i's new rows) into
    each request; a request whose prompt is complete (`last_chunk[i]`) gets its
    normalized `embedding`."""
    done: list[tuple[Req, torch.Tensor]] = []
    for req, rows, last in zip(reqs, hidden, last_chunk, strict=True):
        if pooling == "mean":
            part = rows.float().sum(dim=0)
            req.hidden_sum = part if req.hidden_sum is None else req.hidden_sum + part
        if not last:
            continue
        if pooling == "mean":
            assert req.hidden_sum is not None
            vec = req.hidden_sum / len(req.origin_input_ids)
            req.hidden_sum = None
        else:
            vec = rows[-1].float()
        done.append((req, vec))
    if not done:
        return
    # One normalization and one device-to-host copy for the whole batch.
    vecs = torch.nn.functional.normalize(torch.stack([v for _, v in done]), dim=-1).tolist()
    for (req, _), vec in zip(done, vecs, strict=True):
        req.embedding = vec
