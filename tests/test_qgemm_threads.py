"""Threading of the quantized-weight products (qgemm.cpp, qgemm_pool.h): for
any thread count, on our pool or torch's OpenMP threads, every output is
computed by the same code as on one thread, so results are BIT-IDENTICAL to
the serial path; and the pool survives two Python threads and a fork()."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from gguf_blocks import GGUF_TYPES, random_blocks, require_kernels

from radixlm.layers.cpu_ops import qgemm, qpack

# Odd n (a partial last tile) with enough tiles for several chunks per thread;
# k a multiple of 256 for the K-quants.
N, K = 597, 512
ROWS = [1, 3, 8, 130]  # pooled decode sizes, the first OpenMP size, > 128 (row chunks)
FORMATS = [*GGUF_TYPES, "int8"]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    require_kernels(qgemm.load, "quantized kernels")


@pytest.fixture(autouse=True)
def restore_threading():
    """Each test starts with the pool on for every size (the default only under
    OMP_WAIT_POLICY=PASSIVE) and leaves the settings as it found them."""
    threads, setting = torch.get_num_threads(), qgemm.set_threading()
    qgemm.set_threading(pool_rows=1 << 40)
    yield
    torch.set_num_threads(threads)
    qgemm.set_threading(*setting)


def packed(fmt: str, n: int = N, k: int = K, seed: int = 0) -> qgemm.QuantizedWeight:
    if fmt == "int8":
        gen = torch.Generator().manual_seed(seed)
        return qpack.pack_int8(torch.randn(n, k, generator=gen) * 0.02)
    return qpack.pack_gguf(random_blocks(fmt, n, k, seed), GGUF_TYPES[fmt], n, k)


def serial(fn):
    """fn() on one thread, no pool."""
    threads, (rows, _) = torch.get_num_threads(), qgemm.set_threading()
    torch.set_num_threads(1)
    qgemm.set_threading(pool_rows=0)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)
        qgemm.set_threading(pool_rows=rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bit_identical_for_any_thread_count(fmt):
    w = packed(fmt)
    for m in ROWS:
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            expected = serial(lambda: qgemm.linear(xd, w))  # noqa: B023
            # 8: the default (pool below 8 rows); 1 << 20: the pool for every size.
            for pool_rows in (8, 1 << 20):
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    qgemm.set_threading(pool_rows=pool_rows)
                    y = qgemm.linear(xd, w)
                    assert torch.equal(y, expected), (
                        f"{fmt} m={m} {dtype} threads={threads} pool_rows={pool_rows}")


def pool_threads() -> int:
    return sum(1 for t in os.listdir("/proc/self/task")
               if open(f"/proc/self/task/{t}/comm").read().strip() == "radixlm-qgemm")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="no /proc")
def test_pool_is_used_and_resized():
    """Decode-sized products do run on the pool: torch's thread count - 1 workers."""
    w, x = packed("q4_1", 1001), torch.randn(1, K)
    for threads in (2, 3, 2):
        torch.set_num_threads(threads)
        qgemm.linear(x, w)
        assert pool_threads() == threads - 1


@pytest.mark.parametrize("threads", [2, 3])
def test_shared_activations_into_column_slices(threads):
    """The fused q/k/v route (one quantization, several `gemm` ops into column
    slices of one bf16 output), pooled, against serial."""
    weights = [packed("q4_0", 576, K, 1), packed("q6_k", 193, K, 2), packed("q8_0", 33, K, 3)]
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)

    def run() -> torch.Tensor:
        act = qgemm.quantize_activations(x, weights[0])
        out = torch.empty(3, sum(w.n for w in weights), dtype=torch.bfloat16)
        start = 0
        for w in weights:
            qgemm.gemm_into(act, w, out[:, start:start + w.n])
            start += w.n
        return out

    expected = serial(run)
    torch.set_num_threads(threads)
    assert torch.equal(run(), expected)


def test_two_python_threads_at_once():
    """Products from two Python threads at once: one holds the pool, the other
    runs serially on its own thread (or waits its turn); none is corrupted."""
    torch.set_num_threads(2)
    ws = [packed(fmt, 1001, K, i) for i, fmt in enumerate(("q4_1", "q8_0"))]
    xs = [torch.randn(m, K, generator=torch.Generator().manual_seed(m)) for m in (1, 2, 5)]
    expected = {(i, j): serial(lambda: qgemm.linear(x, w))  # noqa: B023
                for i, w in enumerate(ws) for j, x in enumerate(xs)}
    failures: list[str] = []

    def hammer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(300):
            i, j = int(rng.integers(len(ws))), int(rng.integers(len(xs)))
            if not torch.equal(qgemm.linear(xs[j], ws[i]), expected[i, j]):
                failures.append(f"thread {seed}: weight {i}, x {j}")

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:5]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork()")
def test_pool_after_fork():
    """A fork()ed child (the server forks) gets a pool of its own: products run
    there, pooled, with the same bits, instead of waiting on threads the child
    does not have."""
    torch.set_num_threads(2)
    w = packed("q4_1", 1001)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(1))
    expected = serial(lambda: qgemm.linear(x, w))
    assert torch.equal(qgemm.linear(x, w), expected)  # the parent's pool exists
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        ok = False
        try:
            ok = all(torch.equal(qgemm.linear(x, w), expected) for _ in range(50))
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    try:
        import select
        ready, _, _ = select.select([read], [], [], 60)
        assert ready, "the forked child's product hung"
        assert os.read(read, 1) == b"1", "the forked child's products differ"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert torch.equal(qgemm.linear(x, w), expected)  # and the parent's still works


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_batch(fmt, dtype):
    """A row's output is the same alone, in a batch of any size, and at any
    offset in it: the serial, pooled and OpenMP paths and the row blocking
    of every M all compute each row the same way. (So a greedy token that
    differs between a plain and a mixed batch does not come from here.)"""
    w = packed(fmt)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, K, generator=gen).to(dtype)
    full = qgemm.linear(x, w)
    for m in (1, 2, 3, 5, 7, 8, 9, 16, 33, 130):
        assert torch.equal(qgemm.linear(x[:m].contiguous(), w), full[:m]), m
    for i in range(0, 300, 37):
        assert torch.equal(qgemm.linear(x[i:i + 1].contiguous(), w), full[i:i + 1]), i


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="no /proc")
def test_torch_ops_on_one_thread_keeps_the_pool():
    """Inside the decode scope torch runs its ops on one thread while products
    keep the pool at torch's former count, bit for bit; both come back after."""
    w, x = packed("q4_0", 1001), torch.randn(1, K)
    torch.set_num_threads(2)
    expected = qgemm.linear(x, w)
    with qgemm.torch_ops_on_one_thread():
        assert torch.get_num_threads() == 1
        assert torch.equal(qgemm.linear(x, w), expected)
        assert pool_threads() == 1  # one worker beside the caller: two threads
    assert torch.get_num_threads() == 2
    with pytest.raises(KeyError), qgemm.torch_ops_on_one_thread():
        raise KeyError("a failing step")
    assert torch.get_num_threads() == 2
    assert torch.ops.radixlm_q.pin_pool_threads(0) == 0  # the pin is released


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="no /proc")
def test_decode_attention_units_run_on_the_pool_bit_for_bit():
    """Once the products' kernels load, decode attention's (request, split, KV
    head) units run on the same pool (qgemm.pool_entry, handed over at load):
    the bits are those of OpenMP's threads and of one thread."""
    from radixlm.layers import cpu_ops

    gen = torch.Generator().manual_seed(7)
    bs, heads, kv_heads, dim = 3, 8, 4, 64
    lens = torch.tensor([300, 37, 600])
    pool = int(lens.sum()) + 1
    k_buf, v_buf = (torch.randn(pool, kv_heads, dim, generator=gen).bfloat16() for _ in "kv")
    r2t = torch.zeros(bs, 600, dtype=torch.int32)
    slots = torch.randperm(pool - 1, generator=gen) + 1
    for b, start in enumerate([0, 300, 337]):
        r2t[b, :lens[b]] = slots[start:start + lens[b]].int()
    q = torch.randn(bs, heads, dim, generator=gen).bfloat16()

    def attend() -> torch.Tensor:
        out = torch.empty_like(q)
        cpu_ops.decode_attention(q, k_buf, v_buf, out, r2t, torch.arange(bs), lens, 0.125)
        return out

    torch.set_num_threads(2)
    qgemm.linear(torch.randn(1, K), packed("q4_0"))  # the pool at one worker
    torch.set_num_threads(3)
    on_pool = attend()
    assert pool_threads() == 2  # the attention remade the pool at its thread count
    torch.ops.radixlm_cpu.set_pool(0)  # no pool: OpenMP's threads
    try:
        assert torch.equal(attend(), on_pool)
        torch.set_num_threads(1)
        assert torch.equal(attend(), on_pool)
    finally:
        torch.ops.radixlm_cpu.set_pool(torch.ops.radixlm_q.pool_entry())


def test_decode_steps_take_one_thread_where_the_products_are_pooled():
    """ModelRunner: a CPU model whose linear/expert weight bytes sit >= 90 % in
    pooled methods runs steps of <= ONE_THREAD_TOKENS tokens in the scope."""
    from types import SimpleNamespace

    from radixlm.layers.quantization.base import LinearMethod
    from radixlm.runtime import model_runner as MR

    class Method(LinearMethod):
        def __init__(self, pooled: bool) -> None:
            self.on_product_pool = pooled

        def create_weights(self, *args) -> None:
            pass

        def apply(self, *args) -> None:
            pass

    def layer(numel: int, pooled: bool) -> torch.nn.Module:
        m = torch.nn.Module()
        m.weight = torch.nn.Parameter(torch.zeros(numel, dtype=torch.uint8), requires_grad=False)
        m.quant_method = Method(pooled)
        return m

    model = torch.nn.Sequential(layer(950, True), layer(50, False))
    assert MR.products_on_pool(model)
    model.append(layer(100, False))  # 950 of 1100 bytes: under 90 %
    assert not MR.products_on_pool(model)
    assert not MR.products_on_pool(torch.nn.Linear(4, 4))

    runner = SimpleNamespace(one_thread_tokens=MR.ONE_THREAD_TOKENS)
    torch.set_num_threads(2)
    with MR.ModelRunner.cpu_threads(runner, MR.ONE_THREAD_TOKENS):
        assert torch.get_num_threads() == 1
    with MR.ModelRunner.cpu_threads(runner, MR.ONE_THREAD_TOKENS + 1):
        assert torch.get_num_threads() == 2
    with MR.ModelRunner.cpu_threads(SimpleNamespace(one_thread_tokens=0), 1):
        assert torch.get_num_threads() == 2


def test_the_pooled_methods_say_so():
    """The methods whose products run on the pool carry the flag the model
    runner weighs (GGUF blocks and int8 through PackedLinearMethod, GGUF
    experts); float weights do not."""
    from radixlm.layers.quantization.gguf import GGUFFusedMoEMethod
    from radixlm.layers.quantization.int8 import Int8LinearMethod
    from radixlm.layers.quantization.packed import PackedLinearMethod
    from radixlm.layers.quantization.unquantized import UnquantizedLinearMethod

    assert PackedLinearMethod.on_product_pool and Int8LinearMethod.on_product_pool
    assert GGUFFusedMoEMethod.on_product_pool
    assert not UnquantizedLinearMethod.on_product_pool
