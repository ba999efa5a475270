"""Every running request's sampled tokens on the device, by (request slot, position).

Decode and verify steps read their input token here, so the scheduler may launch
step N + 1 before it has read step N's tokens (overlap), also when a step gives
a request several tokens (a verify accepting drafts).

`known[slot]`: the request's positions 0 .. known - 1 hold its tokens as far as
the device knows them (prompt positions are never read here, so never written).
A step that samples from a token the device already knew writes the tokens it
sampled after it and advances `known`. Steps launched ahead of their inputs
are told apart by one rule, on the device and on the host alike:

- a prefill (extend) row's input came from the host, which had every token
  before it: its write always holds;
- a decode or verify row's input is the token at its input position: the
  write holds only if that was the newest known token (input position ==
  known - 1). Otherwise an earlier step gave the request more tokens than
  this step was launched for: the step is stale, writes nothing, and the
  scheduler drops its result (`ScheduleBatch.first_out`).

Invalid writes go to a spare last column, so no step ever synchronizes.
"""

from __future__ import annotations

import torch


class TokenTable:
    def __init__(self, rows: int, positions: int, device: torch.device) -> None:
        self.positions = positions
        self.table = torch.zeros((rows, positions + 1), dtype=torch.int64, device=device)
        self.known = torch.zeros(rows, dtype=torch.int64, device=device)

    def read(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.table[slots, positions]

    def write_extend(self, slots: torch.Tensor, positions: torch.Tensor,
                     tokens: torch.Tensor) -> None:
        """The tokens prefill rows sampled, at `positions` (one per slot)."""
        self.table[slots, positions] = tokens
        self.known[slots] = positions + 1

    def write_steps(self, slots: torch.Tensor, input_positions: torch.Tensor,
                    tokens: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Decode / verify rows: request i read its input at `input_positions[i]` and
        sampled `tokens[i, :counts[i]]` (counts None: every column) after it."""
        n, m = tokens.shape
        known = self.known[slots]
        start = input_positions + 1
        valid = known == start
        steps = torch.arange(m, device=tokens.device)
        keep = valid[:, None]
        if counts is not None:
            keep = keep & (steps[None, :] < counts[:, None])
        cols = torch.where(keep, start[:, None] + steps, self.positions)
        self.table[slots[:, None].expand(n, m), cols] = tokens
        self.known[slots] = torch.where(valid, start + (m if counts is None else counts), known)
