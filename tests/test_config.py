"""ServerArgs: CLI flags generated from the dataclass, and validation."""

from __future__ import annotations

import argparse

import pytest

from radixlm.config import ServerArgs


def _parse(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def test_cli_round_trip_uses_sglang_flag_names():
    args = _parse(["--max-total-tokens", "4096", "--disable-radix-cache",
                   "--schedule-policy", "fcfs", "--chunked-prefill-size", "-1"])
    assert args.max_total_tokens == 4096 and args.disable_radix_cache
    assert args.schedule_policy == "fcfs" and args.chunked_prefill_size == -1
    assert _parse([]) == ServerArgs()


@pytest.mark.parametrize("kwargs,match", [
    ({"schedule_policy": "random"}, "schedule_policy"),
    ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
    ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
    ({"tp_size": 0}, "tp_size"),
    ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "multiple of nnodes"),
    ({"tp_size": 2, "nnodes": 2}, "dist-init-addr"),
    ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank"),
    ({"dp_size": 2, "tp_size": 2, "nnodes": 2, "dist_init_addr": "h:1"}, "dp_size > 1"),
])
def test_invalid_or_unbuilt_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kwargs)


def test_unknown_engine_keyword():
    with pytest.raises(TypeError, match="bogus"):
        ServerArgs.from_kwargs(bogus=1)
