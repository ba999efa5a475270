"""EAGLE / EAGLE-3 drafting: a draft head over the target's hidden states.

The target returns the hidden states the head reads (`HiddenCapture`: its
final-normed state for EAGLE, the states after a low, a middle and a high
layer for EAGLE-3, by default layers 1, n/2 - 1 and n - 4 as EAGLE-3 trains
them, or the checkpoint's `eagle_config.eagle_aux_hidden_state_layer_ids`).
A head's row at position t reads the token at t + 1 and the target's state at
t, so the drafter keeps, per request, the target's states of the positions it
has not drafted from yet (`DraftState.put_features`): a prefill's last row, a
decode row, a verify's rows (those of rejected drafts are replaced by the next
step's). Its catch-up rows are then the positions the last verify accepted,
with the target's states; its further draft steps feed the head's own output
back as the state (`eagle_model.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from radixlm.config import ServerArgs
from radixlm.forward_batch import ForwardBatch, HiddenCapture
from radixlm.runtime.model_runner import ModelRunner
from radixlm.scheduler.schedule_batch import ScheduleBatch
from radixlm.speculative.model_drafter import DraftState, ModelDrafter, _Rows
from radixlm.speculative.standalone import draft_args
from radixlm.speculative.tree import is_chain
from radixlm.utils import to_device


class EagleDrafter(ModelDrafter):
    shift = 1
    architecture = "LlamaForCausalLMEagle"

    @classmethod
    def create(cls, args: ServerArgs, target: ModelRunner, target_dir: str,
               gpu_id: int | None, max_verify_tokens: int) -> EagleDrafter:
        from radixlm.models.loader import load_config

        draft_dir = args.speculative_draft_model_path
        names = checkpoint_names(draft_dir)
        config = load_config(draft_dir, target.context_len)
        config.architectures = [cls.architecture]
        config.draft_has_embedding = "embed_tokens.weight" in names
        config.draft_has_lm_head = "lm_head.weight" in names
        config.draft_has_d2t = "d2t" in names
        config.bias = "fc.bias" in names
        cls.check_config(config, target)
        capture = cls.target_capture(config, target)
        dargs = draft_args(args, draft_dir, target).replace(load_format="safetensors")
        runner = ModelRunner(dargs, draft_dir, config, gpu_id)
        runner.model.share_target(target.model)
        runner.model.allocate_static_features(args.cuda_graph_max_bs, runner.device)
        drafter = cls(args, target, runner, max_verify_tokens)
        drafter.capture = capture
        return drafter

    @classmethod
    def check_config(cls, config: object, target: ModelRunner) -> None:
        if config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_draft_model_path: the head's vocab_size is "
                             f"{config.vocab_size}, the target's {target.vocab_size}")
        if config.hidden_size != target.config.hidden_size:
            raise ValueError(f"speculative_draft_model_path: an EAGLE head of hidden_size "
                             f"{config.hidden_size} cannot read the target's states of "
                             f"{target.config.hidden_size}")

    @classmethod
    def target_capture(cls, config: object, target: ModelRunner) -> HiddenCapture:
        return HiddenCapture(final=True)

    # ---- rows ------------------------------------------------------------------
    def _first_row(self, st: DraftState) -> int:
        return st.feats_start if st.feats is not None else 0

    def _catch_up_features(self, rows: _Rows) -> torch.Tensor:
        parts = []
        for req, start, n in zip(rows.reqs, rows.starts, rows.lens):
            st = self.states[req.rid]
            lo = start - st.feats_start
            assert st.feats is not None and lo >= 0 and lo + n <= st.feats.shape[0], \
                "the target's states of every catch-up row were kept"
            parts.append(st.feats[lo:lo + n])
        return self.runner.model.prepare_target_features(torch.cat(parts))

    def _extend_features(self, batch: ScheduleBatch, fb: ForwardBatch,
                         rows: _Rows) -> torch.Tensor:
        src = to_device(torch.tensor(rows.src, dtype=torch.int64), self.device)
        return self.runner.model.prepare_target_features(_states(fb)[src])

    def _after_draft(self, req: object, pos: int, drafts: list[int]) -> None:
        # Draft steps read the head's own states: their KV is recomputed from the
        # target's once the verify says which tokens stay.
        st = self.states[req.rid]
        st.valid, st.pending = pos, []

    def draft(self, batch: ScheduleBatch) -> list[torch.Tensor | None]:
        self._resolve_trees(batch.reqs)
        return super().draft(batch)

    def _resolve_trees(self, reqs: list) -> None:
        """The target's states of a verified tree's kept path, once the request's
        tokens say which path that was: its rows' states at positions start.."""
        for req in reqs:
            st = self.states.get(req.rid)
            if st is None or st.tree is None:
                continue
            start, rows, drafts, parents = st.tree
            st.tree = None
            fill, path, row = req.fill_ids, [0], 0
            while start + len(path) < len(fill):
                token = fill[start + len(path)]
                child = next((j + 1 for j, (t, p) in enumerate(zip(drafts, parents))
                              if p == row and t == token), None)
                if child is None:
                    break
                path.append(child)
                row = child
            index = torch.tensor(path, dtype=torch.int64, device=rows.device)
            st.put_features(start, rows[index])

    # ---- after every target forward ------------------------------------------------
    @torch.inference_mode()
    def observe(self, batch: ScheduleBatch, fb: ForwardBatch) -> None:
        self._resolve_trees(batch.reqs)
        super().observe(batch, fb)
        states = _states(fb)
        offset = 0
        for i, req in enumerate(batch.reqs):
            start, n = batch.prefix_lens[i], batch.extend_lens[i]
            st = self.states.get(req.rid)
            if st is not None and batch.sample[i]:
                # Copies: a replayed graph's states live in its output buffers.
                if i < batch.num_extend:  # a prefill's last row: its next token was sampled
                    st.put_features(start + n - 1, states[offset + n - 1:offset + n].clone())
                elif batch.draft_parents is not None and batch.drafts[i] and \
                        not is_chain(batch.draft_parents[i]):
                    # A tree's rows are nodes, not positions: kept until the path is known.
                    st.tree = (start, states[offset:offset + n].clone(), list(batch.drafts[i]),
                               list(batch.draft_parents[i]))
                else:
                    st.put_features(start, states[offset:offset + n].clone())
            offset += n


class Eagle3Drafter(EagleDrafter):
    architecture = "LlamaForCausalLMEagle3"

    @classmethod
    def check_config(cls, config: object, target: ModelRunner) -> None:
        if config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_draft_model_path: the head's vocab_size is "
                             f"{config.vocab_size}, the target's {target.vocab_size}")
        width = getattr(config, "target_hidden_size", None) or config.hidden_size
        if width != target.config.hidden_size:
            raise ValueError(f"speculative_draft_model_path: the head reads states of "
                             f"hidden size {width}, the target's are "
                             f"{target.config.hidden_size}")
        if not config.draft_has_embedding and config.hidden_size != target.config.hidden_size:
            raise ValueError("speculative_draft_model_path: a head without its own "
                             "embed_tokens shares the target's, of another hidden size")

    @classmethod
    def target_capture(cls, config: object, target: ModelRunner) -> HiddenCapture:
        n = target.config.num_hidden_layers
        eagle = getattr(config, "eagle_config", None) or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids") or (1, n // 2 - 1, n - 4)
        layers = tuple(int(x) for x in layers)
        if len(layers) != 3 or list(layers) != sorted(set(layers)) or \
                not all(0 <= x < n for x in layers):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids={list(layers)}: three "
                             f"increasing layers of the target's {n}")
        return HiddenCapture(layers)

    def _to_target(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.runner.model.to_target_ids(tokens)

    def _q_to_target(self, q: torch.Tensor) -> torch.Tensor:
        out = q.new_zeros((q.shape[0], self.target.vocab_size))
        out[:, self.runner.model.hot_ids] = q
        return out


def _states(fb: ForwardBatch) -> torch.Tensor:
    """The target's captured states per token row, side by side."""
    return fb.captured[0] if len(fb.captured) == 1 else torch.cat(fb.captured, dim=-1)


def checkpoint_names(path: str | None) -> set[str]:
    """Tensor names of a safetensors checkpoint directory (headers only)."""
    from safetensors import safe_open

    if path is None or not Path(path).is_dir():
        raise ValueError(f"speculative_draft_model_path={path!r}: an EAGLE head is a "
                         "checkpoint directory")
    index = Path(path) / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"speculative_draft_model_path={path!r} holds no *.safetensors "
                         "(a pytorch_model.bin head must be converted to safetensors first)")
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    return names
