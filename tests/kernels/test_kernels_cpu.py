"""Property-based tests of the CPU kernels (and the torch kernels) against the oracle.

Every decode batch is a random prefix tree over the block tables: runs of
shared chunks at up to 4 levels, groups splitting at each level, private
chunks, partially filled last chunks, requests whose whole context is shared
full chunks, batch rows shuffled so tree order != batch order. The compiled
ops are checked on each SIMD build of csrc/cpu (CHUNKATTN_CPU_ISA), on every
(dtype, head size) pair the CPU kernels support; a build this CPU lacks is
skipped with the missing CPU flags as the reason (`pytest -rs` prints it).
The torch kernels run on the same kind of cases; all against
`reference.paged_attention`, computed in float64 from the same low-precision
cache and queries and rounded to the dtype. Each example runs the compiled
kernels with randomly drawn tile parameters (kernels/cpu_tuning.py): the
tuning a CPU picks changes the tiling, never the result.

Tolerances (max abs error, relative to the output's scale s = max(1, max|ref|)):
    float32   atol 1e-5 * s, rtol 1e-4 (elementwise, torch.testing)
    float16   2e-3 * s     (an fp16 ulp at the output scale plus fp32 accumulation)
    bfloat16  2e-2 * s     (a bf16 ulp is 2^-8 relative: rounding alone reaches 8e-3)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vllm_chunkattn import _C
from vllm_chunkattn.kernels import cpu_tuning, layout, ops, torch_fallback
from vllm_chunkattn.kernels.support import CPU
from vllm_chunkattn.prefix import tree
from vllm_chunkattn.prefix.query_rows import expand_query_rows
from vllm_chunkattn.testing import reference
from vllm_chunkattn.prefix.plan import DecodeShape

DTYPES = list(CPU.dtypes)
HEAD_SIZES = list(CPU.head_sizes)
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 0.0), torch.bfloat16: (2e-2, 0.0)}

SETTINGS = settings(
    max_examples=int(os.environ.get("CHUNKATTN_TEST_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# The SIMD builds of csrc/cpu and the CPU flags (/proc/cpuinfo names) each
# needs: what best_isa() in csrc/cpu/kernels.cpp asks the CPU for.
ISA_CPU_FLAGS = {
    "amx": ("avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"),
    "avx512bf16": ("avx512f", "avx512bw", "avx512_bf16"),
    "avx512": ("avx512f",),
    "avx2": ("avx2", "fma", "f16c"),
    "scalar": (),
}


def _cpu_flags() -> set[str] | None:
    """This CPU's flags, or None where /proc/cpuinfo does not list them."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


CPU_FLAGS = _cpu_flags()


def _isa_runs_here(isa: str) -> bool:
    """Whether the compiled kernels accept CHUNKATTN_CPU_ISA=isa on this CPU."""
    with _isa(isa):
        try:
            return torch.ops.chunkattn.cpu_isa() == isa
        except RuntimeError:
            return False


def _isa_param(isa: str):
    if _isa_runs_here(isa):
        return pytest.param(isa, id=isa)
    if CPU_FLAGS is None:
        reason = f"CPU ISA {isa}: this CPU lacks one of {', '.join(ISA_CPU_FLAGS[isa])} (the kernels' CPU check)"
    else:
        missing = [flag for flag in ISA_CPU_FLAGS[isa] if flag not in CPU_FLAGS]
        reason = f"CPU ISA {isa}: this CPU lacks {', '.join(missing) or 'none of its flags (see ISA_CPU_FLAGS)'}"
    return pytest.param(isa, id=isa, marks=pytest.mark.skip(reason=reason))


@contextlib.contextmanager
def _isa(name: str | None):
    old = os.environ.get("CHUNKATTN_CPU_ISA")
    if name is None:
        os.environ.pop("CHUNKATTN_CPU_ISA", None)
    else:
        os.environ["CHUNKATTN_CPU_ISA"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CHUNKATTN_CPU_ISA", None)
        else:
            os.environ["CHUNKATTN_CPU_ISA"] = old


ISAS = [_isa_param(isa) for isa in ISA_CPU_FLAGS]
DTYPE_PARAMS = [pytest.param(dtype, id=str(dtype).removeprefix("torch.")) for dtype in DTYPES]


def test_isa_flags_match_the_kernels_cpu_check():
    """The skip reasons name CPU flags: they must be the ones the kernels check."""
    if CPU_FLAGS is None:
        pytest.skip("/proc/cpuinfo lists no CPU flags here")
    for isa, flags in ISA_CPU_FLAGS.items():
        assert _isa_runs_here(isa) == all(flag in CPU_FLAGS for flag in flags), isa
    widest = next(isa for isa, flags in ISA_CPU_FLAGS.items() if all(flag in CPU_FLAGS for flag in flags))
    with _isa(None):
        assert torch.ops.chunkattn.cpu_isa() == widest


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOLERANCE[dtype]
    scale = max(1.0, ref.float().abs().max().item()) if ref.numel() else 1.0
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol * scale, rtol=rtol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------
# Case generation


@st.composite
def tree_batches(draw, max_batch: int, block_size: int, max_run: int):
    """Block tables and seq lens of a batch whose requests form a random prefix tree.

    Returns (paths, lens): per request its chunk labels (equal labels = one
    physical chunk), in a shuffled batch order.
    """
    batch = draw(st.integers(1, max_batch))
    depth = draw(st.integers(0, 4))
    labels = iter(range(1 << 30))
    paths: list[list[int]] = [[] for _ in range(batch)]

    def grow(members: list[int], level: int) -> None:
        if level == depth:
            return
        run = [next(labels) for _ in range(draw(st.integers(0, max_run)))]
        for r in members:
            paths[r].extend(run)
        parts = draw(st.integers(1, min(3, len(members))))
        cuts = sorted(draw(st.lists(st.integers(1, len(members) - 1), min_size=parts - 1, max_size=parts - 1,
                                    unique=True))) if parts > 1 else []
        bounds = [0, *cuts, len(members)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            grow(members[a:b], level + 1)

    grow(list(range(batch)), 0)
    lens = []
    for r in range(batch):
        paths[r].extend(next(labels) for _ in range(draw(st.integers(0, max_run))))
        # 0: the context ends on a chunk boundary (the last chunk is full, maybe shared).
        tail = draw(st.integers(0, block_size - 1))
        if not paths[r] and tail == 0:
            tail = 1
        full = len(paths[r])
        if tail:
            paths[r].append(next(labels))
        lens.append(full * block_size + tail)
    order = draw(st.permutations(range(batch)))
    return [paths[i] for i in order], [lens[i] for i in order]


def materialise(paths, lens, block_size: int, seed: int, extra_cols: int):
    """Physical block ids for the labels, scattered over the cache; padding columns hold valid ids."""
    rng = random.Random(seed)
    distinct = sorted({label for p in paths for label in p})
    num_blocks = len(distinct) + rng.randint(0, 3)
    ids = rng.sample(range(num_blocks), len(distinct))
    block_of = dict(zip(distinct, ids))
    width = max(len(p) for p in paths) + extra_cols
    table = torch.tensor([[block_of[x] for x in p] + [rng.randrange(num_blocks) for _ in range(width - len(p))]
                          for p in paths], dtype=torch.int32)
    return table, torch.tensor(lens, dtype=torch.int32), num_blocks


@st.composite
def decode_cases(draw, max_batch: int = 64, dtypes=tuple(DTYPES), head_sizes=tuple(HEAD_SIZES)):
    dtype = draw(st.sampled_from(dtypes))
    head_size = draw(st.sampled_from(head_sizes))
    block_size = draw(st.sampled_from([16, 32, 64, 128]))
    group = draw(st.integers(1, 8))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    max_run = {16: 3, 32: 3, 64: 2, 128: 1}[block_size]
    paths, lens = draw(tree_batches(max_batch, block_size, max_run))
    table, seq_lens, num_blocks = materialise(paths, lens, block_size, draw(st.integers(0, 2**31)),
                                              draw(st.integers(0, 2)))
    # Keep an example's cache small enough for a quick float64 reference.
    assume(num_blocks * num_kv_heads * block_size * head_size <= 2_000_000)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    temperature = draw(st.sampled_from([0.5, 1.0, 4.0]))  # 4: peaky softmax, stresses the running max
    kv_cache = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_size, generator=gen).to(dtype)
    batch, num_heads = len(lens), group * num_kv_heads
    pad = draw(st.sampled_from([0, 16]))  # strided query rows / output rows
    query = (temperature * torch.randn(batch, num_heads, head_size + pad, generator=gen)).to(dtype)[..., :head_size]
    # Sliding window (0: none): one key, either side of a chunk, or anywhere up to the longest context.
    window = draw(st.one_of(st.just(0), st.sampled_from([1, block_size - 1, block_size, block_size + 1]),
                            st.integers(1, max(lens) + 1)))
    # Logits soft-capping (0: none): a cap that flattens most scores, and one that bends the largest.
    softcap = draw(st.sampled_from([0.0, 0.0, 1.0, 20.0]))
    # Attention sinks (None: none): logits about as large as the scores, so a sink takes a real share.
    sinks = draw(st.sampled_from([None, None, 1.0, 4.0]))
    if sinks is not None:
        sinks = sinks * torch.randn(num_heads, generator=gen)
    # ALiBi (None: none): BLOOM's slopes (steep for the first heads), or gentle random ones.
    alibi = draw(st.sampled_from([None, None, "bloom", "gentle"]))
    if alibi == "bloom":
        alibi = torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])
    elif alibi == "gentle":
        alibi = 0.05 * torch.rand(num_heads, generator=gen)
    return dict(query=query, kv_cache=kv_cache, block_table=table, seq_lens=seq_lens, pad=pad,
                scale=1.0 / math.sqrt(head_size), dtype=dtype, sliding_window=window, logits_soft_cap=softcap,
                sinks=sinks, alibi_slopes=alibi)


def variant(case) -> dict:
    """The case's attention-variant arguments, as ops, torch_fallback and reference take them."""
    return {name: case.get(name, default) for name, default in (
        ("sliding_window", 0), ("logits_soft_cap", 0.0), ("sinks", None), ("alibi_slopes", None))}


def describe(case) -> str:
    """The case's variant, for failure messages."""
    return (f"window={case.get('sliding_window', 0)} cap={case.get('logits_soft_cap', 0.0)} "
            f"sinks={case.get('sinks') is not None} alibi={case.get('alibi_slopes') is not None}")


def poison_unseen_blocks(kv_cache: torch.Tensor, block_table: torch.Tensor, readers) -> torch.Tensor:
    """A copy of the cache with NaN in every block that lies wholly before the
    sliding window of each reader that has it: (block-table row, first key the
    reader sees, keys it has). A kernel that reads such a block (rather than
    skipping it) turns its output into NaN; the masked keys of a block it must
    read are finite, so those only have to be masked."""
    block_size = kv_cache.shape[2]
    seen: dict[int, bool] = {}
    for row, first_key, num_keys in readers:
        for col in range(-(-int(num_keys) // block_size)):
            block = int(block_table[row, col])
            seen[block] = seen.get(block, False) or (col + 1) * block_size > first_key
    poisoned = kv_cache.clone()
    for block, was_seen in seen.items():
        if not was_seen:
            poisoned[block] = float("nan")
    return poisoned


def _decode_cache(case) -> torch.Tensor:
    """The case's cache as the kernels get it: with a window, unseen blocks poisoned."""
    if not case.get("sliding_window"):
        return case["kv_cache"]
    lens = case["seq_lens"].tolist()
    return poison_unseen_blocks(case["kv_cache"], case["block_table"],
                                [(b, n - case["sliding_window"], n) for b, n in enumerate(lens)])


def _decode_reference(case):
    batch = case["query"].shape[0]
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    return reference.paged_attention(case["query"], case["kv_cache"], qsl, case["seq_lens"], case["block_table"],
                                     case["scale"], **variant(case))


def _strided_out(like: torch.Tensor, pad: int) -> torch.Tensor:
    b, h, d = like.shape
    return torch.full((b, h, d + pad), float("nan"), dtype=like.dtype)[..., :d]


@st.composite
def tunings(draw) -> cpu_tuning.CpuTuning:
    """Tile parameters anywhere in the kernels' limits, their bounds and the candidates included."""
    values = {}
    for name, (lo, hi) in _C.cpu_tuning_limits().items():
        values[name] = draw(st.one_of(st.sampled_from([lo, hi, *cpu_tuning.CANDIDATES[name]]), st.integers(lo, hi)))
    return cpu_tuning.CpuTuning(**values)


@contextlib.contextmanager
def _tuning(tuning: cpu_tuning.CpuTuning | None):
    old = cpu_tuning.current()
    if tuning is not None:
        tuning.apply()
    try:
        yield
    finally:
        old.apply()


def assert_on_isa(isa: str, op, like: torch.Tensor, pad: int, ref: torch.Tensor, dtype: torch.dtype,
                  what: str, tuning: cpu_tuning.CpuTuning | None = None) -> None:
    """Run `op(out)` on SIMD build `isa` of the CPU kernels with tile parameters
    `tuning` (None: the current ones), into a NaN-filled output shaped like
    `like` (rows strided by `pad`), and check the result."""
    with _isa(isa), _tuning(tuning):
        assert torch.ops.chunkattn.cpu_isa() == isa
        out = _strided_out(like, pad)
        op(out)
    assert_close(out, ref, dtype, f"{what} [{isa}{', ' + tuning.describe() if tuning else ''}]")


# Per (ISA, dtype, head size): a share of the examples a single property test gets.
PER_COMBINATION = settings(SETTINGS, max_examples=max(10, SETTINGS.max_examples // 4))


# ---------------------------------------------------------------------------
# Decode


def _plan(case, ctx):
    """The step's decode plan for the case's layer shape."""
    shape = DecodeShape.of_layer(case["query"], case["kv_cache"])
    return ops.plan_tpp_decode(shape, case["block_table"], case["seq_lens"], ctx)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@PER_COMBINATION
@given(data=st.data())
def test_tpp_decode_matches_reference(isa, dtype, head_size, data):
    case = data.draw(decode_cases(dtypes=(dtype,), head_sizes=(head_size,)))
    ctx = tree.prefix_tree(case["block_table"], case["seq_lens"], case["kv_cache"].shape[2])
    ref = _decode_reference(case)
    kv_cache = _decode_cache(case)
    assert_on_isa(isa, lambda out: ops.tpp_decode(case["query"], kv_cache, _plan(case, ctx), case["scale"], out,
                                                  **variant(case)),
                  case["query"], case["pad"], ref, case["dtype"], f"tpp_decode nodes={ctx.num_nodes} {describe(case)}",
                  data.draw(tunings()))


@settings(SETTINGS, max_examples=max(10, SETTINGS.max_examples // 3))
@given(case=decode_cases(max_batch=24))
def test_torch_tpp_decode_matches_reference(case):
    ctx = tree.prefix_tree(case["block_table"], case["seq_lens"], case["kv_cache"].shape[2])
    out = torch_fallback.tpp_decode(case["query"], case["kv_cache"], case["block_table"], case["seq_lens"], ctx,
                                   case["scale"], **variant(case))
    assert_close(out, _decode_reference(case), case["dtype"], f"torch_fallback.tpp_decode {describe(case)}")


def _one_big_node(batch, num_kv_heads, group, chunks, block_size=64, head_size=128, dtype=torch.bfloat16, tail=5):
    """All requests share `chunks` full chunks, then one private partial chunk each."""
    table = torch.zeros(batch, chunks + 1, dtype=torch.int32)
    table[:, :chunks] = torch.arange(chunks, dtype=torch.int32)
    table[:, chunks] = chunks + torch.arange(batch, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(chunks + batch, num_kv_heads, block_size, 2 * head_size, generator=gen).to(dtype)
    query = torch.randn(batch, num_kv_heads * group, head_size, generator=gen).to(dtype)
    lens = torch.full((batch,), chunks * block_size + tail, dtype=torch.int32)
    return dict(query=query, kv_cache=kv, block_table=table, seq_lens=lens, pad=0, scale=head_size**-0.5, dtype=dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_kv_heads,group", [(1, 1), (1, 8), (2, 4), (8, 1)])
def test_tpp_decode_one_big_shared_node(isa, threads, num_kv_heads, group):
    """One node with many chunks and few kv heads: phase 1 splits the node's chunks over the threads."""
    case = _one_big_node(batch=6, num_kv_heads=num_kv_heads, group=group, chunks=24)
    ctx = tree.prefix_tree(case["block_table"], case["seq_lens"], 64)
    assert ctx.num_nodes == 1
    ref = _decode_reference(case)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_on_isa(isa, lambda out: ops.tpp_decode(case["query"], case["kv_cache"], _plan(case, ctx), case["scale"], out),
                      case["query"], 0, ref, case["dtype"], f"tpp_decode, {threads} threads")
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [3, 5, 6, 7, 9, 10])
def test_tpp_decode_shared_node_of_every_lane_tail(isa, dtype, batch):
    """A shared node of batch x 4 rows: on AVX-512 the last lane vector runs at half width when at most 8 of its
    16 lanes are rows (20 and 24 rows: the second of a pair; 36 and 40: a lone last vector), at full width
    otherwise (12, 28); every row as the reference has it."""
    case = _one_big_node(batch=batch, num_kv_heads=2, group=4, chunks=5, dtype=dtype)
    ctx = tree.prefix_tree(case["block_table"], case["seq_lens"], 64)
    assert ctx.num_nodes == 1
    ref = _decode_reference(case)
    assert_on_isa(isa, lambda out: ops.tpp_decode(case["query"], case["kv_cache"], _plan(case, ctx), case["scale"], out),
                  case["query"], 0, ref, case["dtype"], f"tpp_decode, {4 * batch} rows per KV head")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("decode_qk_inline", [0, 1])
def test_tpp_decode_bf16_node_with_either_qk_block(isa, decode_qk_inline):
    """Both builds of decode's bf16 matrix-matrix tile (the Q.K register block
    inlined or called, a measured tile parameter) give the reference's result."""
    case = _one_big_node(batch=6, num_kv_heads=1, group=8, chunks=24, dtype=torch.bfloat16)
    ctx = tree.prefix_tree(case["block_table"], case["seq_lens"], 64)
    ref = _decode_reference(case)
    tuning = dataclasses.replace(cpu_tuning.current(), decode_qk_inline=decode_qk_inline)
    assert_on_isa(isa, lambda out: ops.tpp_decode(case["query"], case["kv_cache"], _plan(case, ctx), case["scale"], out),
                  case["query"], 0, ref, case["dtype"], f"tpp_decode bf16, decode_qk_inline={decode_qk_inline}", tuning)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("which", ["sinks", "alibi_slopes"])
def test_tpp_decode_sinks_and_alibi_across_node_splits(isa, threads, which):
    """A node split over the threads leaves several partials per row, merged
    with the row's private part: a sink must join the denominator once per
    query (not once per partial), and ALiBi's bias must be the same function
    of the key position in both phases. The variant changes the result."""
    case = _one_big_node(batch=6, num_kv_heads=2, group=4, chunks=24, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    # Sinks near log(keys): each takes a good share of its row's softmax.
    case[which] = (7.0 + torch.randn(8, generator=gen) if which == "sinks"
                   else torch.tensor([2.0 ** -(h + 1) for h in range(8)]))
    ctx = tree.prefix_tree(case["block_table"], case["seq_lens"], 64)
    ref = _decode_reference(case)
    plain = reference.paged_attention(case["query"], case["kv_cache"], torch.arange(7, dtype=torch.int32),
                                      case["seq_lens"], case["block_table"], case["scale"])
    assert (plain - ref).abs().max() > 0.1 * plain.abs().max()  # the variant matters here
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_on_isa(isa, lambda out: ops.tpp_decode(case["query"], case["kv_cache"], _plan(case, ctx),
                                                      case["scale"], out, **variant(case)),
                      case["query"], 0, ref, case["dtype"], f"tpp_decode {which}, {threads} threads")
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [1, 4])
def test_fp16_rows_round_as_torch_does(isa, group):
    """The drivers convert fp16 query and output rows with F16C where the CPU has it (csrc/cpu/driver_utils.h):
    on fp16 values, the fp16 ops give the fp32 ops' results on the same values, rounded as torch rounds them,
    bit for bit (a prefill from scratch, one after a cached context, a decode over a shared prefix)."""
    gen = torch.Generator().manual_seed(group)
    kv_heads, head_size, bs = 2, 128, 32
    cases = []
    for reqs, new, ctx in [(2, 40, 100), (3, 7, 7)]:
        per = -(-ctx // bs)
        cache = torch.empty(reqs * per, kv_heads, bs, 2 * head_size).uniform_(-1, 1, generator=gen).half()
        table = torch.arange(reqs * per, dtype=torch.int32).reshape(reqs, per)
        lens = torch.full((reqs,), ctx, dtype=torch.int32)
        qsl = torch.arange(reqs + 1, dtype=torch.int32) * new
        query = torch.empty(reqs * new, kv_heads * group, head_size).uniform_(-1, 1, generator=gen).half()
        cases.append((query, cache, lambda q, kv, out, qsl=qsl, lens=lens, table=table:
                      ops.paged_prefill(q, kv, qsl, lens, table, 0.125, out)))
    case = _one_big_node(batch=6, num_kv_heads=kv_heads, group=group, chunks=2, tail=5, dtype=torch.float16)
    ctx = tree.prefix_tree(case["block_table"], case["seq_lens"], 64)

    def decode(q, kv, out):
        shape = DecodeShape.of_layer(q, kv)
        ops.tpp_decode(q, kv, ops.plan_tpp_decode(shape, case["block_table"], case["seq_lens"], ctx), 0.125, out)

    cases.append((case["query"], case["kv_cache"], decode))
    with _isa(isa), _tuning(cpu_tuning.CpuTuning()):
        for query, cache, op in cases:
            half, single = torch.empty_like(query), torch.empty(query.shape)
            op(query, cache, half)
            op(query.float(), cache.float(), single)
            assert torch.equal(half, single.half()), (isa, query.shape)


@pytest.mark.parametrize("isa", ISAS)
def test_tpp_decode_all_context_shared(isa):
    """seq_len a multiple of the block size and every chunk shared: no private token at all."""
    case = _one_big_node(batch=4, num_kv_heads=2, group=2, chunks=3, tail=0)
    case["block_table"] = case["block_table"][:, :3].contiguous()
    ctx = tree.prefix_tree(case["block_table"], case["seq_lens"], 64)
    assert ctx.shared_chunks.tolist() == [3] * 4
    ref = _decode_reference(case)
    assert_on_isa(isa, lambda out: ops.tpp_decode(case["query"], case["kv_cache"], _plan(case, ctx), case["scale"], out),
                  case["query"], 0, ref, case["dtype"], "tpp_decode")
    out = torch_fallback.tpp_decode(case["query"], case["kv_cache"], case["block_table"], case["seq_lens"], ctx,
                                   case["scale"])
    assert_close(out, ref, case["dtype"], "torch_fallback.tpp_decode, no private token")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [1, 64, 100, 64 * 23 + 4])
def test_tpp_decode_window_skips_the_chunks_no_row_sees(isa, window):
    """One node of 24 shared chunks, then a private partial chunk per request,
    with the chunks wholly before every window poisoned with NaN: a kernel
    that read one would return NaN (as it does without the window)."""
    case = _one_big_node(batch=6, num_kv_heads=2, group=4, chunks=24)
    case["sliding_window"] = window
    ctx = tree.prefix_tree(case["block_table"], case["seq_lens"], 64)
    poisoned = _decode_cache(case)
    assert torch.isnan(poisoned).any()
    ref = _decode_reference(case)
    assert_on_isa(isa, lambda out: ops.tpp_decode(case["query"], poisoned, _plan(case, ctx), case["scale"], out,
                                                  window),
                  case["query"], 0, ref, case["dtype"], f"tpp_decode window={window}")
    with _isa(isa):
        unwindowed = ops.tpp_decode(case["query"], poisoned, _plan(case, ctx), case["scale"],
                                    torch.empty_like(case["query"]))
    assert torch.isnan(unwindowed).any()


@pytest.mark.parametrize("isa", ISAS)
def test_paged_prefill_window_skips_the_chunks_no_token_sees(isa):
    """A 700-token prompt of 22 chunks under a 100-token window: each query tile
    reads only the chunks its tokens' windows reach (the rest are NaN here)."""
    gen = torch.Generator().manual_seed(4)
    block_size, head_size, kv_heads, group, window = 32, 64, 2, 2, 100
    num_cached, num_new = 500, 200
    lens = torch.tensor([num_cached + num_new], dtype=torch.int32)
    table = torch.arange(22, dtype=torch.int32).view(1, 22)
    kv = torch.randn(22, kv_heads, block_size, 2 * head_size, generator=gen)
    qsl = torch.tensor([0, num_new], dtype=torch.int32)
    query = torch.randn(num_new, kv_heads * group, head_size, generator=gen)
    case = dict(query=query, kv_cache=kv, block_table=table, seq_lens=lens, query_start_loc=qsl,
                scale=head_size**-0.5, sliding_window=window)
    ref = _prefill_reference(case)
    poisoned = poison_unseen_blocks(kv, table, [(0, num_cached - window + 1, num_cached + num_new)])
    assert torch.isnan(poisoned).any()
    assert_on_isa(isa, lambda out: ops.paged_prefill(query, poisoned, qsl, lens, table, case["scale"], out, window),
                  query, 0, ref, torch.float32, "paged_prefill window")


@pytest.mark.parametrize(("bad", "message"), [
    ("out_dtype", "out dtype must match query dtype"),
    ("out_shape", r"query and out must be \[batch, num_heads, head_size\] of the same shape"),
    ("cache_layout", r"kv_cache must be contiguous \[num_blocks, num_kv_heads, block_size, 2\*head_size\]"),
])
def test_both_drivers_refuse_a_bad_query_out_or_cache(bad, message):
    """Decode and prefill state the query/out/cache contract once (driver_utils.h); each refuses a
    violation with its message before touching memory."""
    case = _one_big_node(batch=2, num_kv_heads=1, group=2, chunks=1, dtype=torch.float32)
    query, kv = case["query"], case["kv_cache"]
    plan = _plan(case, tree.prefix_tree(case["block_table"], case["seq_lens"], 64))
    out = torch.empty_like(query)
    if bad == "out_dtype":
        out = out.to(torch.bfloat16)
    elif bad == "out_shape":
        out = out[:1]
    else:
        kv = torch.cat([kv, kv], dim=3)[..., : kv.shape[3]]  # the same shape, not contiguous
    with pytest.raises(RuntimeError, match=message):
        ops.tpp_decode(query, kv, plan, 1.0, out)
    query_start_loc = torch.arange(3, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=message.replace("batch", "num_tokens")):
        ops.paged_prefill(query, kv, query_start_loc, case["seq_lens"], case["block_table"], 1.0, out)


def test_tpp_decode_rejects_unsupported_head_size():
    case = _one_big_node(batch=2, num_kv_heads=1, group=1, chunks=1, head_size=72)
    ctx = tree.prefix_tree(case["block_table"], case["seq_lens"], 64)
    with pytest.raises(RuntimeError, match="head size 72 is not supported"):
        ops.tpp_decode(case["query"], case["kv_cache"], _plan(case, ctx), 1.0, torch.empty_like(case["query"]))


# ---------------------------------------------------------------------------
# Tree rows of any query length (prefix/query_rows.py): speculative decodes,
# short suffixes after a prefix-cache hit, mixed with decode rows


@st.composite
def multi_row_cases(draw, dtypes=tuple(DTYPES), head_sizes=tuple(HEAD_SIZES), max_query_len: int = 64):
    """A decode case's tree, each request with 0 to 64 new tokens ending its
    context: one (a decode) often, and often exactly enough that the computed
    context ends on either side of a chunk boundary."""
    case = draw(decode_cases(max_batch=16, dtypes=dtypes, head_sizes=head_sizes))
    block_size = case["kv_cache"].shape[2]
    query_lens = []
    for seq_len in case["seq_lens"].tolist():
        hi = min(seq_len, max_query_len)
        boundary = (seq_len - 1) // block_size * block_size  # the last chunk boundary inside the context
        near = [seq_len - c for c in (boundary - 1, boundary, boundary + 1) if 0 <= seq_len - c <= hi]
        query_lens.append(draw(st.one_of(st.just(1), st.integers(0, hi), st.sampled_from(near or [1]))))
    query_lens = torch.tensor(query_lens, dtype=torch.int32)
    assume(int(query_lens.sum()) > 0)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).to(torch.int32)])
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    _, num_heads, head_size = case["query"].shape
    pad = case["pad"]
    case["query"] = torch.randn(int(qsl[-1]), num_heads, head_size + pad, generator=gen).to(case["dtype"])[..., :head_size]
    case["query_start_loc"] = qsl
    case["rows"] = expand_query_rows(case["block_table"], case["seq_lens"], query_lens)
    return case


def _rows_plan(case, ctx):
    rows = case["rows"]
    shape = DecodeShape.of_layer(case["query"], case["kv_cache"])
    return ops.plan_tpp_decode(shape, rows.block_table, rows.seq_lens, ctx)


def _rows_tree(case):
    rows = case["rows"]
    return tree.prefix_tree(rows.block_table, rows.unmasked_lens, case["kv_cache"].shape[2])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@PER_COMBINATION
@given(data=st.data())
def test_tpp_decode_rows_of_any_length_match_reference(isa, dtype, data):
    """Every query token a row of the two-phase partition: the causal prefill's result."""
    case = data.draw(multi_row_cases(dtypes=(dtype,)))
    ctx = _rows_tree(case)
    ref = _prefill_reference(case)
    rows = case["rows"]
    kv_cache = case["kv_cache"]
    if case["sliding_window"]:
        kv_cache = poison_unseen_blocks(kv_cache, rows.block_table, [
            (r, n - case["sliding_window"], n) for r, n in enumerate(rows.seq_lens.tolist())])
    assert_on_isa(isa, lambda out: ops.tpp_decode(case["query"], kv_cache, _rows_plan(case, ctx), case["scale"], out,
                                                  **variant(case)),
                  case["query"], case["pad"], ref, case["dtype"],
                  f"tpp_decode rows, nodes={ctx.num_nodes} {describe(case)}", data.draw(tunings()))


@settings(SETTINGS, max_examples=max(10, SETTINGS.max_examples // 3))
@given(case=multi_row_cases())
def test_a_requests_rows_are_one_sequence_first_run(case):
    """The plan attends a request's query tokens as one query matrix in the sequence-first phase
    (decode_plan.h, row_order): runs are consecutive rows in token order, and a request's rows are in one
    run, but for a first row whose keys all lie in nodes, which runs alone. (Rows of two requests may share
    a run only where their private blocks are the same ones: then attending them together is exact.)"""
    ctx = _rows_tree(case)
    rows = case["rows"]
    batch = int(rows.seq_lens.numel())
    row_order = _rows_plan(case, ctx).work.row_order.tolist()
    order, offsets = row_order[:batch], row_order[batch:]
    runs = [order[a:b] for a, b in zip(offsets, offsets[1:])]
    assert sorted(order) == list(range(batch)) and all(run == list(range(run[0], run[0] + len(run))) for run in runs)
    run_of = {row: i for i, run in enumerate(runs) for row in run}
    block_size = case["kv_cache"].shape[2]
    private = (rows.seq_lens - ctx.shared_chunks * block_size).tolist()
    qsl = case["query_start_loc"].tolist()
    for first, end in zip(qsl, qsl[1:]):
        if end - first > 1 and private[first] == 0:
            assert runs[run_of[first]] == [first], "a row with no private key runs alone"
            first += 1
        assert len({run_of[row] for row in range(first, end)}) <= 1, (first, end, runs)
    last_private = [private[run[-1]] for run in runs]
    assert last_private == sorted(last_private, reverse=True), "runs with the most private tokens first"


@settings(SETTINGS, max_examples=max(10, SETTINGS.max_examples // 3))
@given(case=multi_row_cases(max_query_len=16))
def test_torch_tpp_decode_rows_of_any_length_match_reference(case):
    ctx = _rows_tree(case)
    rows = case["rows"]
    out = torch_fallback.tpp_decode(case["query"], case["kv_cache"], rows.block_table, rows.seq_lens, ctx,
                                   case["scale"], **variant(case))
    assert_close(out, _prefill_reference(case), case["dtype"], f"torch_fallback.tpp_decode rows {describe(case)}")


def test_rows_of_one_request_share_its_context_and_not_its_new_tokens():
    """Two requests on one 3-chunk prefix, with 5 and 1 new tokens: one node over
    the prefix covers all 6 rows; the 5 rows of the first also share its private
    chunk; no node reaches a chunk holding a new token."""
    block_size = 16
    table = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 6, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([70, 60], dtype=torch.int32)  # first: context 65 (chunks 0-3 full), new 65..69
    rows = expand_query_rows(table, seq_lens, torch.tensor([5, 1]))
    assert rows.seq_lens.tolist() == [66, 67, 68, 69, 70, 60]
    assert rows.unmasked_lens.tolist() == [66] * 5 + [60]
    ctx = tree.prefix_tree(rows.block_table, rows.unmasked_lens, block_size)
    order = ctx.order.tolist()
    nodes = {(frozenset(order[b:e]), cb, ce) for b, e, cb, ce in zip(
        ctx.node_begin.tolist(), ctx.node_end.tolist(), ctx.node_chunk_begin.tolist(), ctx.node_chunk_end.tolist())}
    assert nodes == {(frozenset(range(6)), 0, 3), (frozenset(range(5)), 3, 4)}


# ---------------------------------------------------------------------------
# Prefill


@st.composite
def prefill_cases(draw, dtypes=tuple(DTYPES), head_sizes=tuple(HEAD_SIZES)):
    case = draw(decode_cases(max_batch=6, dtypes=dtypes, head_sizes=head_sizes))
    lens = case["seq_lens"].tolist()
    # New tokens per request: all of the context (plain prefill), one, or some (chunked / prefix hit).
    num_new = [draw(st.one_of(st.just(n), st.just(1), st.integers(0, min(n, 200)))) for n in lens]
    num_new = [min(x, 200) for x in num_new]
    qsl = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.int32)
    _, num_heads, head_size = case["query"].shape
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    pad = case["pad"]
    case["query"] = torch.randn(int(qsl[-1]), num_heads, head_size + pad, generator=gen).to(case["dtype"])[..., :head_size]
    case["query_start_loc"] = qsl
    return case


def _prefill_reference(case):
    return reference.paged_attention(case["query"], case["kv_cache"], case["query_start_loc"], case["seq_lens"],
                                     case["block_table"], case["scale"], **variant(case))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@PER_COMBINATION
@given(data=st.data())
def test_paged_prefill_matches_reference(isa, dtype, head_size, data):
    case = data.draw(prefill_cases(dtypes=(dtype,), head_sizes=(head_size,)))
    ref = _prefill_reference(case)
    window, qsl, lens = case["sliding_window"], case["query_start_loc"].tolist(), case["seq_lens"].tolist()
    kv_cache = case["kv_cache"]
    if window:  # a request's first new token has the earliest window
        kv_cache = poison_unseen_blocks(kv_cache, case["block_table"], [
            (i, n - (qsl[i + 1] - qsl[i]) - window + 1, n) for i, n in enumerate(lens) if qsl[i + 1] > qsl[i]])
    assert_on_isa(isa, lambda out: ops.paged_prefill(case["query"], kv_cache, case["query_start_loc"],
                                                     case["seq_lens"], case["block_table"], case["scale"], out,
                                                     **variant(case)),
                  case["query"], case["pad"], ref, case["dtype"], f"paged_prefill {describe(case)}",
                  data.draw(tunings()))


@settings(SETTINGS, max_examples=max(10, SETTINGS.max_examples // 3))
@given(case=prefill_cases())
def test_torch_paged_prefill_matches_reference(case):
    out = torch.zeros_like(case["query"])
    torch_fallback.paged_prefill(case["query"], case["kv_cache"], case["query_start_loc"].tolist(),
                                case["seq_lens"].tolist(), case["block_table"], case["scale"], out, **variant(case))
    assert_close(out, _prefill_reference(case), case["dtype"], f"torch_fallback.paged_prefill {describe(case)}")


@pytest.mark.parametrize("isa", ISAS)
def test_paged_prefill_request_without_new_tokens(isa):
    """A request with no new token (num_new = 0) between two that have some: nothing to do for it."""
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(6, 2, 16, 128, generator=gen)
    table = torch.arange(6, dtype=torch.int32).view(3, 2)
    lens = torch.tensor([20, 17, 32], dtype=torch.int32)
    qsl = torch.tensor([0, 5, 5, 7], dtype=torch.int32)
    query = torch.randn(7, 4, 64, generator=gen)
    case = dict(query=query, kv_cache=kv, block_table=table, seq_lens=lens, query_start_loc=qsl, scale=0.125)
    ref = _prefill_reference(case)
    assert_on_isa(isa, lambda out: ops.paged_prefill(query, kv, qsl, lens, table, 0.125, out),
                  query, 0, ref, torch.float32, "paged_prefill")


@pytest.mark.parametrize("isa", ISAS)
def test_paged_prefill_int64_metadata_and_long_prompt(isa):
    """vLLM-style int64 metadata; a prompt longer than one query tile and one key tile."""
    gen = torch.Generator().manual_seed(1)
    block_size, head_size, kv_heads, group = 32, 128, 2, 4
    lens = [700, 33]
    num_new = [700, 9]
    table = torch.tensor([list(range(0, 22)), list(range(22, 24)) + [0] * 20], dtype=torch.int32)
    kv = torch.randn(24, kv_heads, block_size, 2 * head_size, generator=gen)
    qsl = torch.tensor([0, 700, 709], dtype=torch.int64)
    query = torch.randn(709, kv_heads * group, head_size, generator=gen)
    case = dict(query=query, kv_cache=kv, block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int64),
                query_start_loc=qsl, scale=head_size**-0.5)
    ref = _prefill_reference(case)
    assert_on_isa(isa, lambda out: ops.paged_prefill(query, kv, qsl, case["seq_lens"], table, case["scale"], out),
                  query, 0, ref, torch.float32, "paged_prefill")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("head_size, kv_heads, group", [(64, 3, 2), (128, 2, 4)], ids=["d64-gqa2", "d128-gqa4"])
def test_paged_prefill_burst_behind_a_shared_prefix(isa, dtype, block_size, head_size, kv_heads, group):
    """Requests whose cached context starts with the same blocks (the driver then walks one KV head of every
    request before the next head, and where the lanes tile multiplies a packed V^T it packs the shared
    blocks' once for all of them), of different lengths: three behind one prefix, one of them computing new
    tokens in a block the others read as context; two that end inside one shared block (its keys past both
    ends packed, and masked); one computing its prompt from scratch."""
    gen = torch.Generator().manual_seed(4)
    bs = block_size
    table = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 2, 7], [5, 6, 8, 8], [5, 6, 8, 8], [9, 10, 11, 9]],
                         dtype=torch.int32)
    lens = torch.tensor([3 * bs + 10, 3 * bs + bs // 2, 3 * bs, bs + 7, bs + 3, 2 * bs + 5], dtype=torch.int32)
    num_new = [20, 12, bs + 5, 9, 6, 2 * bs + 5]
    qsl = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.int32)
    kv = torch.randn(12, kv_heads, bs, 2 * head_size, generator=gen).to(dtype)
    query = torch.randn(int(qsl[-1]), kv_heads * group, head_size, generator=gen).to(dtype)
    case = dict(query=query, kv_cache=kv, block_table=table, seq_lens=lens, query_start_loc=qsl,
                scale=head_size**-0.5)
    ref = _prefill_reference(case)
    assert_on_isa(isa, lambda out: ops.paged_prefill(query, kv, qsl, lens, table, case["scale"], out),
                  query, 0, ref, dtype, f"paged_prefill block_size={bs}")


# ---------------------------------------------------------------------------
# KV write


@settings(SETTINGS, max_examples=30)
@given(
    dtype=st.sampled_from(DTYPES),
    head_size=st.sampled_from(HEAD_SIZES),
    block_size=st.sampled_from([16, 32, 64, 128]),
    num_kv_heads=st.integers(1, 4),
    num_tokens=st.integers(1, 80),
    strided=st.booleans(),
    slot_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**31),
)
def test_write_kv_cache_matches_reference(dtype, head_size, block_size, num_kv_heads, num_tokens, strided, slot_dtype,
                                          seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = (num_tokens + block_size - 1) // block_size + 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1  # padding tokens
    # Rows as a slice of a fused qkv-like buffer when strided.
    width = 3 * num_kv_heads * head_size if strided else 2 * num_kv_heads * head_size
    kv_rows = torch.randn(num_tokens, width, generator=gen).to(dtype)
    key = kv_rows[:, : num_kv_heads * head_size].view(num_tokens, num_kv_heads, head_size)
    value = kv_rows[:, num_kv_heads * head_size : 2 * num_kv_heads * head_size].view(num_tokens, num_kv_heads,
                                                                                     head_size)
    cache = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_size, generator=gen).to(dtype)
    expected = cache.clone()
    reference.write_kv_cache(key, value, expected, slots)
    ops.write_kv_cache(key, value, cache, slots.to(slot_dtype))
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_the_cache_layout_is_the_stated_one(dtype):
    """csrc/chunkattn.h and kernels/layout.py: keys by row; in a bfloat16 cache
    the value of row r at head dim d at [r // 2][2d + r % 2] of its tile,
    float32 and float16 values by row."""
    num_blocks, heads, block_size, head_size = 3, 2, 32, 64
    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_size, dtype=dtype)
    key, value = (torch.arange(1, heads * head_size + 1).view(1, heads, head_size).to(dtype) * sign for sign in (1, -1))
    ops.write_kv_cache(key, value, cache, torch.tensor([block_size + 7]))  # block 1, row 7
    tiles = cache.view(num_blocks, heads, 2, block_size, head_size)
    assert torch.equal(tiles[1, :, 0, 7], key[0])
    v_tile = tiles[1, :, 1]
    if dtype == torch.bfloat16:
        assert layout.values_in_pairs(dtype, "cpu") and not layout.values_in_pairs(dtype, "cuda")
        pair_rows = v_tile.reshape(heads, block_size // 2, 2 * head_size)
        assert torch.equal(pair_rows[:, 3, 1::2], value[0]) and not pair_rows[:, 3, 0::2].any()
    else:
        assert not layout.values_in_pairs(dtype, "cpu")
        assert torch.equal(v_tile[:, 7], value[0])
    assert int(cache.ne(0).sum()) == 2 * heads * head_size  # nothing else written
    k, v = layout.read_tokens(cache, torch.tensor([1]), torch.tensor([7]))
    assert torch.equal(k, key) and torch.equal(v, value)
    k_blocks, v_blocks = layout.read_blocks(cache, torch.tensor([1]))
    assert torch.equal(k_blocks[0, :, 7], key[0]) and torch.equal(v_blocks[0, :, 7], value[0])


@pytest.mark.parametrize("isa", ISAS)
def test_slots_no_token_was_written_to_never_reach_the_output(isa):
    """bf16 values lie in key pairs, so an odd number of keys shares its last
    pair row with a slot no token was written to. With NaN in every slot past
    each request's keys, prefill (the lanes tile, the AMX tile's P V on the
    cache, and the direct kernel) and decode stay the oracle's."""
    gen = torch.Generator().manual_seed(11)
    block_size, head_size, kv_heads, group = 64, 128, 2, 4
    lens = [129, 67, 33, 1, 191]
    new = [65, 3, 33, 1, 17]
    blocks_of = [-(-n // block_size) for n in lens]
    table = torch.zeros(len(lens), max(blocks_of), dtype=torch.int32)
    first = 0
    for i, count in enumerate(blocks_of):
        table[i, :count] = torch.arange(first, first + count, dtype=torch.int32)
        first += count
    kv = torch.randn(first, kv_heads, block_size, 2 * head_size, generator=gen).to(torch.bfloat16)
    poisoned = kv.clone()
    for i, n in enumerate(lens):
        if n % block_size:
            rows = torch.arange(n % block_size, block_size)
            block = torch.full_like(rows, int(table[i, blocks_of[i] - 1]))
            nan = torch.full((len(rows), kv_heads, head_size), float("nan"), dtype=torch.bfloat16)
            layout.write_tokens(poisoned, block, rows, nan, nan)
    assert torch.isnan(poisoned).any()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_size**-0.5
    query = torch.randn(int(qsl[-1]), kv_heads * group, head_size, generator=gen).to(torch.bfloat16)
    ref = reference.paged_attention(query, kv, qsl, seq_lens, table, scale)
    assert_on_isa(isa, lambda out: ops.paged_prefill(query, poisoned, qsl, seq_lens, table, scale, out), query, 0,
                  ref, torch.bfloat16, "paged_prefill past the keys")
    decode = dict(query=torch.randn(len(lens), kv_heads * group, head_size, generator=gen).to(torch.bfloat16),
                  kv_cache=kv, block_table=table, seq_lens=seq_lens, scale=scale, dtype=torch.bfloat16)
    ref = _decode_reference(decode)
    plan = _plan(decode, tree.prefix_tree(table, seq_lens, block_size))
    assert_on_isa(isa, lambda out: ops.tpp_decode(decode["query"], poisoned, plan, scale, out), decode["query"], 0, ref,
                  torch.bfloat16, "tpp_decode past the keys")


# ---------------------------------------------------------------------------
# torch.compile support


def test_ops_have_fake_kernels():
    case = _one_big_node(batch=3, num_kv_heads=2, group=2, chunks=2, dtype=torch.float32)
    ctx = tree.prefix_tree(case["block_table"], case["seq_lens"], 64)
    out = torch.empty_like(case["query"])
    work = _plan(case, ctx).work
    args = (out, case["query"], case["kv_cache"], case["block_table"], case["seq_lens"], ctx.order, ctx.node_begin,
            ctx.node_end, ctx.node_chunk_begin, ctx.node_chunk_end, ctx.node_partial_offset, ctx.shared_chunks,
            ctx.row_partial_offsets, ctx.row_partials, work.header, work.items, work.node_work, work.partial_work,
            work.row_order, case["scale"])
    torch.library.opcheck(torch.ops.chunkattn.tpp_decode.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    torch.library.opcheck(torch.ops.chunkattn.paged_prefill.default,
                          (out, case["query"], case["kv_cache"], qsl, case["seq_lens"], case["block_table"],
                           case["scale"]),
                          test_utils=("test_schema", "test_faketensor"))
