"""Tensor and data parallelism on the CPU: gloo ranks as processes, a DP
controller in front of replicas, and the routing policies on their own."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest
import torch
from hf_reference import EXACT, hf_greedy
from server_utils import ServerProcess
from test_models import TINY_CONFIGS, save_random_hf_model

import radixlm
from radixlm.layers.linear import head_partition
from radixlm.server.load_balance import PREFIX_BLOCK, LoadBalancer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
           "Explain why the sky is blue in one sentence."]
NEW_TOKENS = 24
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}


# ---- head partition -----------------------------------------------------------------
@pytest.mark.parametrize("heads,kv,tp,expect", [
    (8, 8, 2, [(0, 4, 0, 4), (4, 4, 4, 4)]),
    (9, 3, 2, [(0, 6, 0, 2), (6, 3, 2, 1)]),  # SmolLM2 on two ranks
    (8, 2, 4, [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]),  # KV replicated
    (9, 1, 2, [(0, 5, 0, 1), (5, 4, 0, 1)]),
])
def test_head_partition(heads, kv, tp, expect):
    parts = [head_partition(heads, kv, tp, r) for r in range(tp)]
    assert parts == expect
    assert sum(p[1] for p in parts) == heads


def test_head_partition_refuses_impossible_splits():
    with pytest.raises(ValueError, match="cannot split"):
        head_partition(4, 1, 8, 0)  # 8 ranks for 4 query heads
    with pytest.raises(ValueError, match="cannot split"):
        head_partition(8, 2, 3, 0)  # 2 KV heads replicated over 3 ranks


# ---- routing policies -----------------------------------------------------------------
def test_round_robin_alternates():
    lb = LoadBalancer("round_robin", 3)
    assert [lb.route([1, 2, 3]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_shortest_queue_counts_unreported_requests():
    lb = LoadBalancer("shortest_queue", 2)
    assert lb.route(list(range(100))) == 0
    assert lb.route(list(range(10))) == 1  # replica 0 holds 100 unreported tokens
    assert lb.route(list(range(10))) == 1  # 20 < 100
    # Replica 0 reports it has taken its request in and finished it: load 0.
    lb.report(0, num_reqs=0, num_tokens=0, num_received=1)
    assert lb.loads[0].num_tokens == 0 and lb.loads[1].num_tokens == 20
    assert lb.route(list(range(10))) == 0
    # A report that predates the second request still counts it as pending.
    lb.report(1, num_reqs=1, num_tokens=10, num_received=1)
    assert lb.loads[1].num_tokens == 20


def test_cache_aware_follows_prefixes_and_falls_back_to_load():
    lb = LoadBalancer("cache_aware", 2)
    a, b = [1] * 8 * PREFIX_BLOCK, [2] * 8 * PREFIX_BLOCK
    first_a = lb.route(a + [7])
    first_b = lb.route(b + [7])
    assert first_a != first_b  # no match anywhere: the shorter queue
    for i in range(5):
        assert lb.route(a + [i]) == first_a
        assert lb.route(b + [i]) == first_b
    assert lb.num_cache_routed == 10
    # Far out of balance: load wins over the cache.
    lb.report(first_a, num_reqs=100, num_tokens=100_000, num_received=lb.loads[first_a].num_routed)
    assert lb.route(a + [9]) == first_b


def test_cache_aware_keys_on_the_prefix_namespace():
    """The same tokens under another namespace (adapter, images) are another prefix."""
    lb = LoadBalancer("cache_aware", 2)
    a = [1] * 8 * PREFIX_BLOCK
    home = lb.route(a + [7])
    other = 1 - home
    lb.route([5] * 8 * PREFIX_BLOCK, namespace=3)  # goes to `other`, the shorter queue
    assert lb.trees[home].match(a) == len(a)
    assert lb.trees[home].match(a, namespace=3) == 0
    assert lb.route(a + [8], namespace=3) == other  # no match in namespace 3: by load
    assert lb.trees[other].match(a, namespace=3) == len(a)
    assert lb.route(a + [9], namespace=3) == other
    assert lb.route(a + [9]) == home


# ---- tensor parallelism -----------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded_ids(model_dir) -> list[list[int]]:
    from radixlm.tokenizer import get_tokenizer

    tok = get_tokenizer(model_dir)
    return [tok.encode(p) for p in PROMPTS]


def test_tp2_embedded_model_matches_tp1_and_hf(embedded_ids, hf_model):
    """SmolLM2's 9 heads / 3 KV heads split 6+3 / 2+1 over two gloo ranks."""
    ref = hf_greedy(hf_model, embedded_ids, NEW_TOKENS)
    with radixlm.Engine(**EXACT, max_total_tokens=4096) as e:
        tp1 = [o["output_ids"] for o in e.generate(input_ids=embedded_ids, sampling_params=GREEDY)]
    with radixlm.Engine(**EXACT, tp_size=2, max_total_tokens=4096, chunked_prefill_size=8) as e:
        tp2 = [o["output_ids"] for o in e.generate(input_ids=embedded_ids, sampling_params=GREEDY)]
        # One by one, now with the prompts' KV cached by the radix tree.
        again = [e.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
                 for ids in embedded_ids]
        info = e.get_server_info()
        assert info["num_cached_tokens"] > 0
        e.scheduler.control("check_invariants")
    assert tp2 == tp1 == ref
    assert again == ref


@pytest.mark.parametrize("name", ["llama-linear-rope-biases", "mistral-head-dim"])
def test_tp2_random_models_match_hf(name, tmp_path):
    """Heads divisible by the ranks (4 KV heads), and one KV head replicated on both."""
    config = TINY_CONFIGS[name]()
    hf = save_random_hf_model(config, tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
               for n in (5, 17, 33)]
    ref = hf_greedy(hf, prompts, 12)
    with radixlm.Engine(model_path=str(tmp_path), tp_size=2, skip_tokenizer_init=True,
                        max_total_tokens=1024, load_format="safetensors") as e:
        out = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12,
                                                             "temperature": 0.0,
                                                             "ignore_eos": True})
    assert [o["output_ids"] for o in out] == ref


# ---- data parallelism ---------------------------------------------------------------------
def shared_prefix_workload(groups: int, per_group: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prompts = []
    for _ in range(groups):
        prefix = torch.randint(100, 40000, (160,), generator=gen).tolist()
        for _ in range(per_group):
            prompts.append(prefix + torch.randint(100, 40000, (8,), generator=gen).tolist())
    return prompts


def run_dp(method: str, prompts: list[list[int]]) -> dict:
    sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    with radixlm.Engine(**EXACT, dp_size=2, load_balance_method=method, max_total_tokens=8192) as e:
        outs = e.generate(input_ids=prompts, sampling_params=sp)
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        return e.get_server_info()


def test_dp2_round_robin_vs_cache_aware():
    prompts = shared_prefix_workload(groups=8, per_group=4)
    rr = run_dp("round_robin", prompts)
    ca = run_dp("cache_aware", prompts)
    assert rr["dp"]["routed"] == [16, 16]
    assert sum(ca["dp"]["routed"]) == 32 and min(ca["dp"]["routed"]) >= 8
    assert ca["dp"]["cache_routed"] >= 24  # every request after its group's first
    # Each group's prefix is computed once in total, not once per replica.
    assert ca["cache_hit_rate"] > rr["cache_hit_rate"]
    for info in (rr, ca):
        assert info["num_generated_tokens"] == 32 * 4
        assert len(info["dp"]["replicas"]) == 2


def test_dp2_shortest_queue_completes_and_controls_reach_every_replica():
    with radixlm.Engine(**EXACT, dp_size=2, load_balance_method="shortest_queue",
                        max_total_tokens=4096) as e:
        outs = e.generate(PROMPTS * 2, GREEDY)
        assert len(outs) == 8
        assert e.flush_cache() == (True, "cache flushed")
        info = e.get_server_info()
        assert sum(info["dp"]["routed"]) == 8 and min(info["dp"]["routed"]) >= 2
        assert info["kv_tokens_cached"] == 0  # flushed on both replicas


# ---- the server, and a dying rank ------------------------------------------------------
def _follower_pids(server: ServerProcess, leader: int) -> list[int]:
    """Scheduler ranks other than the leader (their process title names them)."""
    kids = psutil.Process(server.proc.pid).children()
    return [p.pid for p in kids
            if p.pid != leader and "radixlm::scheduler" in " ".join(p.cmdline())]


def test_tp2_server_serves_and_dies_with_a_rank():
    server = ServerProcess(["--tp-size", "2", "--max-total-tokens", "4096"])
    try:
        r = httpx.post(server.url + "/generate", json={"text": PROMPTS[0],
                                                       "sampling_params": GREEDY}, timeout=120)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == NEW_TOKENS
        pids = httpx.get(server.url + "/get_server_info").json()["process_pids"]
        followers = [p for p in _follower_pids(server, pids["scheduler"])
                     if p != pids["detokenizer"]]
        assert followers, "no tensor-parallel follower process found"
        os.kill(followers[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert server.proc.returncode not in (None, 0)
    finally:
        server.kill()


def test_dp2_session_turns_stay_on_one_replica():
    """A session's continuation must reach the replica holding its history."""
    with radixlm.Engine(**EXACT, dp_size=2, max_total_tokens=4096) as e:
        sid = e.open_session(0)
        rid = None
        for turn in ("Hello!", " Tell me more.", " And then?"):
            params = {"id": sid} if rid is None else {"id": sid, "rid": rid}
            out = e.generate(turn, {"max_new_tokens": 4, "temperature": 0.0},
                             session_params=params)
            assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
            rid = out["meta_info"]["id"]
        assert out["meta_info"]["cached_tokens"] > 0
        e.close_session(sid)
        assert sorted(e.get_server_info()["dp"]["routed"]) == [0, 3]
