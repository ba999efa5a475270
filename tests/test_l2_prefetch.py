"""The L2 prefetch after each qkv product (`radixlm/layers/l2_prefetch.py`), on the
CPU: which weights each layer asks for under each mode and budget, the byte
ranges a bulk prefetch may take, the calls a forward makes (a prefetch per
layer with the step's rows, one join after them, the same logits), the refusals,
and the kernel's sm_90 SASS (compiled here with Triton's ptxas). That the
prefetch makes the next products faster is measured on the device
(`benchmarks/l2_prefetch.py`)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from family_models import save_random_model
from kv_runner import greedy_through_kv
from moe_models import MOE_FAMILIES
from quant_checkpoints import save_float_model, tiny_llama

from radixlm.config import ServerArgs
from radixlm.layers import l2_prefetch as L
from radixlm.layers.quantization import get_quantization_config
from radixlm.models.loader import load_config, load_model

PROMPTS = [[3, 17, 99, 5, 42, 8], [120, 4, 66]]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("l2")
    save_float_model(tiny_llama(num_hidden_layers=3), root)
    return str(root)


def load(path: str, quantization: str | None = None) -> torch.nn.Module:
    config = load_config(path)
    return load_model(path, config, "safetensors", torch.float32, "cpu",
                      quant_config=get_quantization_config(config, quantization))


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers)


# ---- byte ranges -------------------------------------------------------------------------
def test_byte_span_takes_whole_aligned_lines_of_what_a_view_spans() -> None:
    base = torch.zeros(4096, dtype=torch.uint8)
    assert base.data_ptr() % 16 == 0
    assert L.byte_span(base) == (base.data_ptr(), 4096)
    # From byte 3 to byte 3 + 100: lines 16 .. 96.
    assert L.byte_span(base[3:103]) == (base.data_ptr() + 16, 80)
    # Rows 0..7 of a [64, 64] matrix, first 40 columns: up to row 7's byte 40.
    rows = base.view(64, 64)[:8, :40]
    assert L.byte_span(rows) == (base.data_ptr(), 7 * 64 + 40 - 8)
    assert L.byte_span(base[5:9])[1] == 0
    assert L.byte_span(base[:0])[1] == 0
    wide = torch.zeros(10, 6, dtype=torch.float32)[:, :3]  # 4-byte elements, strided
    assert L.byte_span(wide) == (wide.data_ptr(), (9 * 6 + 3) * 4 // 16 * 16)


# ---- plans -------------------------------------------------------------------------------
def asked(points) -> list[tuple]:
    """(module after which, ((module, evict-last), ...)) of each point."""
    return [(p.after, p.modules) for p in points]


def test_o_mode_asks_for_each_layers_o_proj_after_its_qkv(path) -> None:
    ls = layers(load(path))
    assert asked(L.plan(ls, "o", 1 << 30)) == [
        (x.self_attn.qkv_proj, ((x.self_attn.o_proj, False),)) for x in ls]


def test_o_qkv_mode_adds_the_next_layers_qkv_to_stay_in_l2(path) -> None:
    """The last layer's next qkv is the first layer's, of the next decode step."""
    ls = layers(load(path))
    assert asked(L.plan(ls, "o+qkv", 1 << 30)) == [
        (a.self_attn.qkv_proj, ((a.self_attn.o_proj, False), (b.self_attn.qkv_proj, True)))
        for a, b in zip(ls, ls[1:] + ls[:1])]


def test_all_mode_asks_after_each_product_for_the_next(path) -> None:
    ls = layers(load(path))
    want = []
    for a, b in zip(ls, ls[1:] + ls[:1]):
        attn, mlp = a.self_attn, a.mlp
        want += [(attn.qkv_proj, ((attn.o_proj, False),)),
                 (attn.o_proj, ((mlp.gate_up_proj, False),)),
                 (mlp.gate_up_proj, ((mlp.down_proj, False),)),
                 (mlp.down_proj, ((b.self_attn.qkv_proj, False),))]
    assert asked(L.plan(ls, "all", 1 << 30)) == want


def test_an_moe_layer_asks_for_its_router_too(tmp_path) -> None:
    """After qkv, o_proj and the router; under "all" nothing after o_proj (the
    experts are not known before the router), and the dense layer's MLP as usual."""
    config = MOE_FAMILIES["qwen3_moe"](hidden_size=128, moe_intermediate_size=32)
    save_random_model(config, tmp_path)
    ls = layers(load(str(tmp_path)))
    assert not hasattr(ls[0].mlp, "gate") and hasattr(ls[1].mlp, "gate")  # mlp_only_layers
    assert asked(L.plan(ls, "o", 1 << 30)) == [
        (ls[0].self_attn.qkv_proj, ((ls[0].self_attn.o_proj, False),)),
        *[(x.self_attn.qkv_proj, ((x.self_attn.o_proj, False), (x.mlp.gate, False)))
          for x in ls[1:]]]
    afters = [p.after for p in L.plan(ls, "all", 1 << 30)]
    assert afters == [ls[0].self_attn.qkv_proj, ls[0].self_attn.o_proj, ls[0].mlp.gate_up_proj,
                      ls[0].mlp.down_proj, *[x.self_attn.qkv_proj for x in ls[1:]]]
    assert [t.data_ptr() for t in L.decode_tensors(ls[1].mlp.gate)] == [
        ls[1].mlp.gate.weight.data_ptr()]


def test_the_budget_drops_what_does_not_fit(path) -> None:
    ls = layers(load(path))
    o, qkv = L.nbytes(ls[0].self_attn.o_proj), L.nbytes(ls[1].self_attn.qkv_proj)
    assert qkv > o
    l2 = int((o + qkv - 1) / L.BUDGET) + 1  # o + qkv just past the budget
    assert asked(L.plan(ls, "o+qkv", l2)) == asked(L.plan(ls, "o", 1 << 30))
    assert L.plan(ls, "o", int(o / L.BUDGET) - 1) == []
    # "all" takes each product alone up to CAP times the L2
    gate_up = L.nbytes(ls[0].mlp.gate_up_proj)
    afters = [p.after for p in L.plan(ls, "all", int(gate_up / L.CAP) - 1)]
    assert ls[0].self_attn.o_proj not in afters
    assert ls[0].self_attn.qkv_proj in afters and ls[0].mlp.gate_up_proj in afters


def test_decode_tensors_are_what_the_products_read(path, tmp_path) -> None:
    plain = load(path).model.layers[0].self_attn.o_proj
    assert [t.data_ptr() for t in plain.quant_method.decode_tensors(plain)] == [
        plain.weight.data_ptr()]
    fp8 = load(path, "fp8").model.layers[0].self_attn.o_proj
    weight, scales = fp8.quant_method.decode_tensors(fp8)
    assert weight.dtype == torch.float8_e4m3fn and weight.data_ptr() == fp8.weight.data_ptr()
    assert scales is fp8.fp8.scales


def test_cpu_tensors_are_never_prefetched(path) -> None:
    assert L.plan(layers(load(path)), "all", 1 << 30)[0].tensors() == []


# ---- a forward ---------------------------------------------------------------------------
class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def issue(self, point, rows: int) -> None:
        self.calls.append((point, rows))

    def join(self) -> None:
        self.calls.append(("join",))


def test_a_forward_issues_each_point_after_its_product_and_joins_once(path) -> None:
    model = load(path)
    want = greedy_through_kv(model, PROMPTS, 3)
    points = L.plan(layers(model), "all", 1 << 30)
    rec = Recorder()
    L.install(model.model, points, rec)
    assert greedy_through_kv(model, PROMPTS, 3) == want
    # Each forward: the points in order, then one join. The rows: the 9-token
    # prefill's (its last layer projects only the 2 rows that get logits), then
    # two decode steps of 2.
    per = len(points) + 1
    forwards = [rec.calls[i:i + per] for i in range(0, len(rec.calls), per)]
    assert len(forwards) == 3 and all(f[-1] == ("join",) for f in forwards)
    assert all([point for point, _ in f[:-1]] == points for f in forwards)
    last = {p.after for p in points[-3:]}  # the last layer's o_proj, gate/up, down
    assert [[rows for point, rows in f[:-1]] for f in forwards] == [
        [2 if p.after in last else 9 for p in points], [2] * len(points), [2] * len(points)]


# ---- refusals ----------------------------------------------------------------------------
def test_refused_without_a_hopper_gpu_and_for_unknown_modes(path) -> None:
    model = load(path)
    ls = layers(model)
    with pytest.raises(ValueError, match=r"l2_prefetch='o': .*compute capability 9.0"):
        L.attach(model.model, ls, "o", torch.device("cpu"))
    with pytest.raises(ValueError, match="l2_prefetch='qkv': expected one of off, o, o"):
        L.attach(model.model, ls, "qkv", torch.device("cpu"))
    with pytest.raises(ValueError, match="l2_prefetch='every': expected one of"):
        ServerArgs(model_path=path, l2_prefetch="every")
    assert L.attach(model.model, ls, "off", torch.device("cpu")) == ""


# ---- the kernel's code -------------------------------------------------------------------
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1" or not L.HAS_TRITON,
                    reason="compiles for sm_90 with Triton's ptxas")
@pytest.mark.parametrize("evict_last", [False, True])
def test_the_kernel_is_one_bulk_l2_prefetch_a_lane(evict_last) -> None:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not (ptxas.exists() or shutil.which("ptxas")):
        pytest.skip("no ptxas in this Triton install")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from sass import opcode, signature, sm90_sass

    sig = {**signature(L._prefetch_kernel, {"base_ptr": "*i8"}), "size": "i64"}
    code = sm90_sass(L._prefetch_kernel, sig, {"CHUNK": L.CHUNK, "LANES": L.LANES,
                                               "PTX": L.EVICT_LAST_PTX if evict_last else L.PTX},
                     warps=1)
    prefetches = [ins for _, ins in code if opcode(ins) == "UBLKPF"]
    assert len(prefetches) == 1 and ".L2" in prefetches[0]
    # The evict-last form carries its cache policy; neither form stores anything.
    assert ("desc[" in prefetches[0]) == evict_last
    assert not any(opcode(ins) in ("STG", "ATOM", "RED") for _, ins in code)


def test_an_engine_on_the_cpu_refuses_it_by_name(path) -> None:
    import radixlm

    with pytest.raises(ValueError, match=r"l2_prefetch='o\+qkv': bulk L2 prefetches need"):
        radixlm.Engine(path, dtype="float32", skip_tokenizer_init=True, l2_prefetch="o+qkv")


def test_a_draft_runner_does_not_inherit_it(path) -> None:
    from types import SimpleNamespace

    from radixlm.speculative.standalone import draft_args

    args = ServerArgs(model_path=path, l2_prefetch="o+qkv")
    draft = draft_args(args, path, SimpleNamespace(context_len=256))
    assert (draft.l2_prefetch, draft.context_length) == ("off", 256)
