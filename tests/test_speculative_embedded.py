"""Speculative decoding on the embedded model (CPU fp32, through `Engine.generate`):
every algorithm gives the plain run's greedy tokens for a copy task, a stop
string, a regex grammar and n = 2 samples, in a KV pool small enough that
requests are retracted mid-speculation. STANDALONE drafts with the model itself,
EAGLE / EAGLE-3 with random heads in the published layout (built here); NGRAM and
STANDALONE also as trees (--speculative-eagle-topk > 1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_reference import EXACT
from spec_models import save_eagle_head

import radixlm

TEXT = ("The lighthouse keeper climbed the stairs every evening, lit the lamp, and wrote "
        "the weather in a small blue book.")
POOL = 150  # KV slots: the five sequences do not all fit at once (retractions)


def _chat(tokenizer: Any, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def _run(model_dir: str, stop: str | None = None, **kw: Any) -> tuple[list[dict], Any]:
    with radixlm.Engine(model_dir, device="cpu", max_total_tokens=POOL,
                        chunked_prefill_size=64, **EXACT, **kw) as e:
        tok = e.tokenizer
        prompts = [_chat(tok, f"Repeat this sentence exactly: {TEXT}"),
                   _chat(tok, f"Repeat this sentence exactly: {TEXT}"),
                   _chat(tok, "Is the sky blue? Answer yes or no, then say why."),
                   _chat(tok, "Write one short sentence about the sea.")]
        greedy = {"temperature": 0, "max_new_tokens": 32}
        params = [greedy, {**greedy, "stop": [stop] if stop else []},
                  {**greedy, "regex": r"(yes|no), because [a-z ]{10,60}\."},
                  {**greedy, "n": 2}]
        out = e.generate(prompts, params)
        e.scheduler.check_invariants()
        return out, e.scheduler.stats


@pytest.fixture(scope="module")
def heads(model_dir: str, tmp_path_factory: Any) -> dict[str, str]:
    root = tmp_path_factory.mktemp("heads")
    return {kind: save_eagle_head(root / kind, model_dir, kind, identity=False,
                                  dtype=torch.bfloat16) for kind in ("EAGLE", "EAGLE3")}


@pytest.fixture(scope="module")
def plain(model_dir: str) -> tuple[list[dict], str]:
    first, _ = _run(model_dir)
    # A stop string from the middle of the copy, so it falls inside an accepted run.
    words = first[0]["text"].split()
    stop = " " + words[len(words) // 2]
    out, stats = _run(model_dir, stop=stop)
    assert stats.num_retractions > 0
    assert out[1]["meta_info"]["finish_reason"]["matched"] == stop.strip() or \
        out[1]["meta_info"]["finish_reason"]["type"] == "stop"
    return out, stop


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NGRAM-tree",
                                  "STANDALONE-tree"])
def test_every_algorithm_keeps_the_greedy_tokens(model_dir: str, heads: dict[str, str],
                                                 plain: tuple[list[dict], str],
                                                 algo: str) -> None:
    expected, stop = plain
    algo, _, shape = algo.partition("-")
    tree = dict(speculative_eagle_topk=3, speculative_num_steps=3) if shape else {}
    draft = {"NGRAM": None, "STANDALONE": model_dir}.get(algo, heads.get(algo))
    out, stats = _run(model_dir, stop=stop, speculative_algorithm=algo,
                      speculative_draft_model_path=draft, **tree)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in expected]
    assert [o["meta_info"]["finish_reason"] for o in out] == \
        [o["meta_info"]["finish_reason"] for o in expected]
    assert stats.num_draft_tokens > 0
    assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in out) > 0
    if algo in ("NGRAM", "STANDALONE"):  # the copy task is what they draft right
        assert stats.num_accepted_drafts > stats.num_draft_tokens / 4
