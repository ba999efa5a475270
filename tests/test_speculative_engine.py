"""Speculative decoding through the real scheduler and worker, on tiny random models
(CPU fp32): every algorithm's greedy tokens equal the plain run's, the drafts a
model drafter proposes are its model's own (a from-scratch reference: HF's greedy
continuation of the draft model; an independent implementation of the EAGLE /
EAGLE-3 head's published math over the whole sequence), a model drafting for
itself has every draft accepted, retraction and abort mid-speculation, and the
verify budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from spec_models import save_eagle_head, save_tiny_target

from radixlm.config import ServerArgs
from radixlm.models.loader import load_config
from radixlm.protocol import GenerateReq
from radixlm.scheduler.scheduler import Scheduler

NEW_TOKENS = 14


@pytest.fixture(scope="module")
def models(tmp_path_factory: Any) -> dict[str, str]:
    root = tmp_path_factory.mktemp("spec")
    target = save_tiny_target(root / "target", seed=1)
    # Tied embeddings and small layers: the model mostly repeats its last token, so an
    # EAGLE head that passes the target's state through drafts right.
    looping = save_tiny_target(root / "looping", seed=3, std=0.02, tie_word_embeddings=True)
    return {
        "target": target, "looping": looping,
        "draft": save_tiny_target(root / "draft", seed=2),
        "eagle": save_eagle_head(root / "eagle", target, "EAGLE", identity=False, std=0.3),
        "eagle3": save_eagle_head(root / "eagle3", target, "EAGLE3", identity=False, std=0.3),
        "eagle_id": save_eagle_head(root / "eagle_id", looping, "EAGLE"),
        "eagle3_id": save_eagle_head(root / "eagle3_id", looping, "EAGLE3"),
    }


def _prompts(n: int = 3, seed: int = 0, shared: bool = True) -> list[list[int]]:
    """Prompts of 5, 33 and 54 tokens, the last two sharing their first 24 (unless not
    `shared`)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 96, (24,), generator=g).tolist() if shared else []
    if not shared:
        return [torch.randint(0, 96, (m,), generator=g).tolist() for m in (5, 33, 54)][:n]
    return [torch.randint(0, 96, (5,), generator=g).tolist(),
            shared + torch.randint(0, 96, (9,), generator=g).tolist(),
            shared + torch.randint(0, 96, (30,), generator=g).tolist()][:n]


def _scheduler(model: str, **kw: Any) -> Scheduler:
    args = ServerArgs(model_path=model, device="cpu", dtype="float32", skip_tokenizer_init=True,
                      max_total_tokens=kw.pop("max_total_tokens", 2048),
                      chunked_prefill_size=kw.pop("chunked_prefill_size", 16), **kw)
    return Scheduler(args, model, load_config(model, args.context_length), None)


def _serve(model: str, prompts: list[list[int]], params: dict[str, Any] | None = None,
           record: bool = False, new_tokens: int = NEW_TOKENS, **kw: Any
           ) -> tuple[dict[str, list[int]], Scheduler, list]:
    """Every prompt's tokens; with `record`, each draft call's (tokens so far,
    drafts) per request."""
    sched = _scheduler(model, **kw)
    calls: list[tuple[list[int], list[int]]] = []
    drafter = sched.worker.model_drafter
    if record and drafter is not None:
        draft = drafter.draft

        def recording(batch: Any) -> Any:
            out = draft(batch)
            calls.extend((list(r.fill_ids), list(d)) for r, d in zip(batch.reqs, batch.drafts)
                         if d)
            return out

        drafter.draft = recording
    for i, ids in enumerate(prompts):
        sched.add_request(GenerateReq(rid=f"r{i}", input_ids=ids, sampling_params={
            "max_new_tokens": new_tokens, "temperature": 0, **(params or {})}))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while sched.has_work:
        for o in sched.step():
            out[o.rid] += o.new_token_ids
        sched.check_invariants()
    return out, sched, calls


@pytest.fixture(scope="module")
def plain(models: dict[str, str]) -> dict[str, list[int]]:
    out, _, _ = _serve(models["target"], _prompts())
    assert all(len(v) == NEW_TOKENS for v in out.values())
    return out


def _spec(algo: str, draft: str | None, **kw: Any) -> dict[str, Any]:
    return dict(speculative_algorithm=algo, speculative_draft_model_path=draft, **kw)


# ---- references: what the draft model itself would propose ------------------------------
def _hf_greedy(model_dir: str, tokens: list[int], k: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = _HF.get(model_dir) or AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64).eval()
    _HF[model_dir] = model
    x = torch.tensor([tokens])
    with torch.no_grad():
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k,
                           do_sample=False)
    return y[0, len(tokens):].tolist()


_HF: dict[str, Any] = {}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class EagleReference:
    """The published EAGLE / EAGLE-3 head math over a whole sequence in float64,
    recomputed from scratch per draft step (no KV cache): rows t < P read the
    token at t + 1 and the target's state at t, later rows the previous draft and
    the head's own output."""

    def __init__(self, head_dir: str, target_dir: str, kind: str) -> None:
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.kind = kind
        self.w = {k: v.double() for k, v in load_file(f"{head_dir}/model.safetensors").items()}
        self.cfg = LlamaConfig.from_pretrained(head_dir)
        self.target = AutoModelForCausalLM.from_pretrained(target_dir,
                                                           dtype=torch.float64).eval()
        self.rope = LlamaRotaryEmbedding(self.cfg)
        self.prefix = "layers.0" if kind == "EAGLE" else "midlayer"
        n = self.target.config.num_hidden_layers
        self.layers = [0, n // 2 - 1, n - 2]  # as spec_models writes them

    def target_states(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out = self.target(torch.tensor([tokens]), output_hidden_states=True)
        if self.kind == "EAGLE":
            return out.hidden_states[-1][0]  # HF's last entry is final-normed
        states = [out.hidden_states[i + 1][0] for i in self.layers]
        return torch.cat(states, dim=-1) @ self.w["fc.weight"].T

    def rows(self, ids: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's next feature, its logits over the target's vocabulary)."""
        w, p, cfg = self.w, self.prefix, self.cfg
        eps = cfg.rms_norm_eps
        emb = self.target.model.embed_tokens(torch.tensor(ids))
        if self.kind == "EAGLE":
            h = torch.cat([emb, feats], -1) @ w["fc.weight"].T + w["fc.bias"]
            residual, x = h, h
        else:
            residual = feats
            x = torch.cat([_rms(emb, w[f"{p}.input_layernorm.weight"], eps),
                           _rms(feats, w[f"{p}.hidden_norm.weight"], eps)], -1)
        residual = residual + self._attention(x, len(ids))
        x = _rms(residual, w[f"{p}.post_attention_layernorm.weight"], eps)
        gate, up = x @ w[f"{p}.mlp.gate_proj.weight"].T, x @ w[f"{p}.mlp.up_proj.weight"].T
        out = torch.nn.functional.silu(gate) * up @ w[f"{p}.mlp.down_proj.weight"].T + residual
        if self.kind == "EAGLE":
            return out, self.target.lm_head(out)
        logits = _rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T
        hot = torch.arange(logits.shape[-1]) + w["d2t"].long()
        full = torch.full((len(ids), self.target.config.vocab_size), -torch.inf,
                          dtype=torch.float64)
        full[:, hot] = logits
        return out, full

    def _attention(self, x: torch.Tensor, n: int) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        w, p, cfg = self.w, self.prefix, self.cfg
        heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = (x @ w[f"{p}.self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1)
        k = (x @ w[f"{p}.self_attn.k_proj.weight"].T).view(n, kv, d).transpose(0, 1)
        v = (x @ w[f"{p}.self_attn.v_proj.weight"].T).view(n, kv, d).transpose(0, 1)
        cos, sin = self.rope(v, torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        k, v = (t.repeat_interleave(heads // kv, dim=0) for t in (k[0], v))
        att = (q[0] @ k.transpose(1, 2)) / d ** 0.5
        att = att.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
        out = (att.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d)
        return out @ w[f"{p}.self_attn.o_proj.weight"].T

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        pos = len(tokens) - 1  # the newest token's position
        feats = self.target_states(tokens[:pos])
        ids = tokens[1:pos + 1]
        out: list[int] = []
        with torch.no_grad():
            for _ in range(k):
                own, logits = self.rows(ids, feats)
                out.append(int(logits[-1].argmax()))
                ids = ids + [out[-1]]
                feats = torch.cat([feats, own[-1:]])
        return out


# ---- tests ------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE", "EAGLE", "EAGLE3"])
def test_greedy_tokens_equal_and_drafts_are_the_drafters(models: dict[str, str],
                                                         plain: dict[str, list[int]],
                                                         algo: str) -> None:
    draft = {"NGRAM": None, "STANDALONE": models["draft"], "EAGLE": models["eagle"],
             "EAGLE3": models["eagle3"]}[algo]
    out, sched, calls = _serve(models["target"], _prompts(), record=True,
                               **_spec(algo, draft, speculative_num_steps=3))
    assert out == plain
    if algo.startswith("EAGLE"):
        # A head's KV at a position reads the next token too: a shared prefix's last
        # position holds the KV of the request that computed it (worse drafts for
        # the other, never other tokens), which a from-scratch reference does not
        # model. Compare drafts on prompts that share nothing.
        prompts = _prompts(shared=False)
        out, sched, calls = _serve(models["target"], prompts, record=True,
                                   **_spec(algo, draft, speculative_num_steps=3))
        assert out == _serve(models["target"], prompts)[0]
    assert sched.stats.num_draft_tokens > 0
    if algo == "NGRAM":
        return
    assert len(calls) > 10
    if algo == "STANDALONE":
        for tokens, drafts in calls:
            assert drafts == _hf_greedy(models["draft"], tokens, len(drafts))
        return
    ref = EagleReference(draft, models["target"], algo)
    for tokens, drafts in calls:
        assert drafts == ref.drafts(tokens, len(drafts)), tokens


@pytest.mark.parametrize("algo", ["STANDALONE", "EAGLE"])
def test_an_fp8_lm_head_keeps_speculation_lossless(models: dict[str, str], algo: str) -> None:
    """--lm-head-quantization fp8 reaches the draft's head too: greedy tokens as
    the same FP8-head target's without speculation."""
    head = {"lm_head_quantization": "fp8"}
    want, _, _ = _serve(models["target"], _prompts(), **head)
    draft = models["draft"] if algo == "STANDALONE" else models["eagle"]
    out, sched, _ = _serve(models["target"], _prompts(),
                           **_spec(algo, draft, speculative_num_steps=3), **head)
    assert out == want
    assert sched.stats.num_draft_tokens > 0


def test_a_model_drafting_for_itself_has_every_draft_accepted(
        models: dict[str, str], plain: dict[str, list[int]]) -> None:
    """The draft KV is the target's own KV then: any slot or position mixed up in
    catch-up rows, chunked prefill or the shared prefix would cost acceptance."""
    target = models["target"]
    base = _serve(target, _prompts())[1]
    out, sched, _ = _serve(target, _prompts(), **_spec("STANDALONE", target,
                                                       speculative_num_steps=4))
    assert out == plain
    st = sched.stats
    assert st.num_accepted_drafts == st.num_draft_tokens > 0
    assert sched.forward_ct < base.forward_ct / 2


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_heads_that_draft_right_are_accepted(models: dict[str, str], kind: str) -> None:
    """A head passing the target's state through drafts the token the target put
    after the previous position: right while the output repeats a token."""
    looping = models["looping"]
    plain, base, _ = _serve(looping, _prompts())
    head = models["eagle_id" if kind == "EAGLE" else "eagle3_id"]
    out, sched, _ = _serve(looping, _prompts(), **_spec(kind, head, speculative_num_steps=3))
    assert out == plain
    st = sched.stats
    assert st.num_accepted_drafts >= 0.6 * st.num_draft_tokens > 0, st
    assert sched.forward_ct < base.forward_ct


def test_seeded_sampling_with_ngram_drafts_is_unchanged(models: dict[str, str]) -> None:
    """A drafter that proposes without sampling keeps a seeded request's tokens."""
    params = {"temperature": 0.2, "top_p": 0.95, "seed": 11}
    plain, _, _ = _serve(models["looping"], _prompts(), params)
    out, sched, _ = _serve(models["looping"], _prompts(), params, **_spec("NGRAM", None))
    assert out == plain and sched.stats.num_accepted_drafts > 0


def test_sampled_drafts_are_reproducible(models: dict[str, str]) -> None:
    """A draft model at temperature > 0: drafts drawn from q, kept by speculative
    sampling (its distribution: test_speculative.py); seeded runs repeat."""
    params = {"temperature": 1.0, "seed": 5}
    spec = _spec("STANDALONE", models["target"], speculative_num_steps=3)
    one, sched, _ = _serve(models["target"], _prompts(), params, **spec)
    two, _, _ = _serve(models["target"], _prompts(), params, **spec)
    assert one == two and all(len(v) == NEW_TOKENS for v in one.values())
    st = sched.stats
    assert st.num_accepted_drafts >= 0.9 * st.num_draft_tokens > 0  # q == p: min(1, p/q) = 1


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE", "EAGLE3"])
def test_retraction_mid_speculation(models: dict[str, str], algo: str) -> None:
    """A pool too small for every request: retracted requests resume from their
    output so far, drafts and all, with the same tokens."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (20,), generator=g).tolist() for _ in range(4)]
    small = dict(max_total_tokens=150, new_tokens=24)
    plain, base, _ = _serve(models["target"], prompts, **small)
    draft = {"NGRAM": None, "STANDALONE": models["target"], "EAGLE3": models["eagle3"]}[algo]
    out, sched, _ = _serve(models["target"], prompts, **small,
                           **_spec(algo, draft, speculative_num_steps=3))
    assert out == plain
    assert base.stats.num_retractions > 0 and sched.stats.num_retractions > 0
    assert sched.stats.num_draft_tokens > 0


def _serve_aborting_r1(sched: Scheduler) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """(tokens, finish reason) per request of _prompts() served greedily, r1 aborted at
    the first step after drafts were made (between verify steps, with draft state for
    it); the pool invariant checked after every step."""
    for i, ids in enumerate(_prompts()):
        sched.add_request(GenerateReq(rid=f"r{i}", input_ids=ids, sampling_params={
            "max_new_tokens": NEW_TOKENS, "temperature": 0}))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    finish = {}
    while sched.has_work:
        for o in sched.step():
            out[o.rid] += o.new_token_ids
            finish[o.rid] = o.finish_reason
        if sched.stats.num_draft_tokens > 0 and "r1" not in finish:
            sched.abort("r1")
        sched.check_invariants()
    return out, finish


def test_abort_mid_speculation(models: dict[str, str], plain: dict[str, list[int]]) -> None:
    target = models["target"]
    sched = _scheduler(target, **_spec("STANDALONE", target))
    out, finish = _serve_aborting_r1(sched)
    assert finish["r1"]["type"] == "abort"
    assert out["r0"] == plain["r0"] and out["r2"] == plain["r2"]
    assert not sched.worker.model_drafter.states


def test_speculation_pauses_beyond_the_verify_budget(models: dict[str, str]) -> None:
    prompts = _prompts() * 3  # nine requests
    _, sched, _ = _serve(models["target"], prompts,
                         **_spec("STANDALONE", models["target"], speculative_num_steps=3,
                                 speculative_max_verify_tokens=16))
    assert sched.stats.num_draft_tokens == 0  # 9 x 2 rows > 16 for as long as all run
    _, forced, _ = _serve(models["target"], prompts,
                          **_spec("STANDALONE", models["target"], speculative_num_steps=3,
                                  speculative_max_verify_tokens=0))
    assert forced.stats.num_draft_tokens > 0


def test_draft_heads_and_models_refused(models: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="draft head"):
        _scheduler(models["eagle"])
    other = save_tiny_target(tmp_path / "other", vocab_size=80)
    with pytest.raises(ValueError, match="vocab_size"):
        _scheduler(models["target"], **_spec("STANDALONE", other))
    with pytest.raises(ValueError, match="safetensors"):
        _scheduler(models["target"], **_spec("EAGLE", str(tmp_path)))
    with pytest.raises(ValueError, match="tensor parallelism"):
        create = __import__("radixlm.speculative", fromlist=["create_drafter"]).create_drafter
        args = ServerArgs(tp_size=2, **_spec("EAGLE", models["eagle"]))
        create(args, _scheduler(models["target"]).worker.runner, models["target"])
