"""The GPU kernel benchmark's device-independent parts, on CPU: its grids, the
inputs it builds for the baselines (FlashAttention layout, private copies,
dense K/V, FlashInfer cascade levels), and that it refuses to run without a GPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

from vllm_chunkattn.testing import reference
from vllm_chunkattn.bench import kernel_gpu as kg
from vllm_chunkattn.testing.paged_cases import num_blocks_needed, random_kv_cache
from vllm_chunkattn.kernels import layout
from vllm_chunkattn.prefix.tree import prefix_tree


def test_grids_are_the_papers():
    table3 = kg.grid_points(["table3"])
    assert len(table3) == 12 and {p.batch for p in table3} == {32}
    assert {(p.prompt, p.shared) for p in table3} >= {(1024, 0), (2048, 1536), (4096, 4096)}
    assert len(kg.grid_points(["figure3"])) == 10
    assert [p.batch for p in kg.grid_points(["figure4"])] == [1, 8, 16, 32, 64, 96, 128]
    assert all(p.context == 1024 + 512 + 256 + 128 for p in kg.grid_points(["multilevel"]))
    assert len(kg.grid_points(["table3", "figure4"], quick=True)) == 4


def test_point_tables_share_what_they_claim():
    for point in kg.grid_points(["table3", "figure3", "multilevel"], quick=True):
        table, seq_lens = kg.point_table(point, 64)
        assert table.shape[0] == point.batch and int(seq_lens.min()) == int(seq_lens.max()) == point.context
        ctx = prefix_tree(table, seq_lens, 64)
        if point.levels:
            assert ctx.num_nodes == 1 + 4 + 16
        elif point.shared:
            assert ctx.num_nodes == 1 and int(ctx.node_chunk_end[0]) == point.shared // 64
        else:
            assert ctx.num_nodes == 0


def test_cascade_levels_cover_each_request_exactly_once():
    for point in kg.grid_points(["table3", "multilevel"], quick=True):
        table, seq_lens = kg.point_table(point, 16)
        ctx = prefix_tree(table, seq_lens, 16)
        levels = kg.cascade_levels(ctx, table, seq_lens, 16)
        depth = 3 if point.levels else (1 if point.shared else 0)
        assert levels is not None and len(levels) == depth + 1
        order = ctx.order.tolist()
        pages = {row: [] for row in order}
        for lv in levels:
            assert lv.qo_indptr[0] == 0 and lv.qo_indptr[-1] == len(order)
            for g in range(len(lv.qo_indptr) - 1):
                group_pages = lv.kv_indices[lv.kv_indptr[g] : lv.kv_indptr[g + 1]]
                for t in range(lv.qo_indptr[g], lv.qo_indptr[g + 1]):
                    pages[order[t]] += group_pages
        for row, got in pages.items():
            n = -(-int(seq_lens[row]) // 16)
            assert got == table[row, :n].tolist()
        assert levels[-1].last_page_len == [int(seq_lens[r]) - (-(-int(seq_lens[r]) // 16) - 1) * 16 for r in order]


def test_baseline_layouts_hold_the_same_keys_and_values():
    point = kg.Point("t", 3, 40, 32, 1)
    table, seq_lens = kg.point_table(point, 16)
    kv = random_kv_cache(num_blocks_needed(table), 2, 16, 64, torch.float32)
    k_cache, v_cache = layout.read_blocks(kv, torch.arange(kv.shape[0]), kernels_device="cuda")
    k_fa, v_fa = kg.flash_layout(kv)
    assert torch.equal(k_fa.transpose(1, 2), k_cache) and torch.equal(v_fa.transpose(1, 2), v_cache)
    private = kg.unshared_table(table, seq_lens, 16)
    k_u = torch.cat([k_fa[:1], k_fa[table.long().flatten()]])
    assert torch.equal(k_u[private.long()], k_fa[table.long()])
    assert len(set(private.flatten().tolist())) == private.numel()
    k, v = kg.dense_kv(kv, table, point.context)
    for r in range(3):
        ref_k, ref_v = reference.gather_context(kv, table[r], point.context)
        assert torch.equal(k[r], ref_k) and torch.equal(v[r], ref_v)


def test_sdpa_baseline_matches_the_reference_on_cpu():
    point = kg.Point("t", 4, 50, 32, 3)
    settings = kg.Settings(heads=4, kv_heads=2, head_size=64, block_size=16, dtype="float32", methods=["sdpa"])
    fns, skipped, facts = kg._method_fns(point, settings, torch.device("cpu"))
    assert not skipped and facts["nodes"] == 1
    query, kv, table, seq_lens, scale = facts["inputs"]
    expected = reference.paged_attention(query, kv, torch.arange(5), seq_lens, table, scale)
    torch.testing.assert_close(fns["sdpa"](), expected, atol=1e-5, rtol=1e-5)


def test_refuses_to_run_without_a_gpu(capsys):
    if torch.cuda.is_available():
        return
    assert kg.main(["--grids", "table3", "--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_cpu_bench_command_has_a_gpu_mode(capsys):
    """`python -m vllm_chunkattn.bench.kernel --device cuda` is the GPU benchmark on
    the same grids; here (no GPU) it refuses with a reason, as do CPU-only options."""
    from vllm_chunkattn.bench import kernel

    for argv, reason in [
        (["--device", "cuda", "--grid", "prefill"], "grid 'prefill' is CPU-only"),
        (["--device", "cuda", "--dtype", "fp32"], "dtype 'fp32' is not supported by the CUDA kernels"),
    ] + ([] if torch.cuda.is_available() else [(["--device", "cuda", "--quick"], "no CUDA device")]):
        with pytest.raises(SystemExit) as exit_info:
            kernel.main(argv)
        assert exit_info.value.code == 2
        assert reason in capsys.readouterr().err


def test_a_method_that_disagrees_with_chunk_is_not_timed(monkeypatch):
    """The correctness gate of the GPU benchmark, on CPU tensors: sdpa's output corrupted by 0.1 in one
    element fails the point (named with the method and the difference); nothing of the point is timed."""
    point = kg.Point("table3", 4, 64, 32, 1)
    good = torch.randn(4, 2, 64)
    bad = good.clone()
    bad[2, 1, 5] += 0.1
    fns = {"chunk": lambda: good, "fa_shared": lambda: good + 1e-4, "sdpa": lambda: bad}
    facts = {"context": point.context, "nodes": 1, "partial_rows": 4, "tree_build_ms": 0.0}
    monkeypatch.setattr(kg, "_method_fns", lambda *args: (dict(fns), {}, facts))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(kg, "time_gpu", lambda *args, **kwargs: pytest.fail("a failed point must not be timed"))
    settings = kg.Settings(dtype="float16", methods=["chunk", "fa_shared", "sdpa"])
    row = kg.run_point(point, settings, torch.device("cpu"))
    assert [(d["impl"], d["point"]) for d in row["disagreements"]] == [("sdpa", point.label())]
    assert row["disagreements"][0]["max_abs_diff"] == pytest.approx(0.1, rel=1e-3)
    assert row["max_abs_diff_vs_chunk"]["fa_shared"] == pytest.approx(1e-4, rel=1e-2)
    assert row["times_us"] == {}


def test_replot_draws_each_baseline_over_chunk(tmp_path, monkeypatch):
    """`--replot RUN.json` redraws a finished GPU run here; the bars are each baseline's time over chunk's."""
    axes = pytest.importorskip("matplotlib.axes")
    drawn = {}
    real_bar = axes.Axes.bar

    def recording_bar(self, x, heights, *args, label=None, **kwargs):
        drawn.setdefault(label, []).extend(float(h) for h in heights)
        return real_bar(self, x, heights, *args, label=label, **kwargs)

    monkeypatch.setattr(axes.Axes, "bar", recording_bar)
    rows = [
        {"grid": "table3", "batch": 32, "prompt": 1024, "shared": n_s, "completion": 1, "levels": [],
         "times_us": {"chunk": chunk, "sdpa": 200.0, "flashinfer": 100.0}}
        for n_s, chunk in ((0, 200.0), (1024, 25.0))
    ] + [{"grid": "multilevel", "batch": 64, "prompt": 0, "shared": 0, "completion": 0, "levels": [[1, 1024]],
          "times_us": {"chunk": 50.0, "sdpa": 400.0}}]
    meta = {"device": "GPU", "capability": "9.0",
            "settings": {"heads": 32, "kv_heads": 8, "head_size": 128, "block_size": 64, "dtype": "bfloat16"}}
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": meta, "rows": rows}))
    assert kg.main(["--replot", str(run)]) == 0
    assert run.with_suffix(".png").stat().st_size > 0
    assert drawn["sdpa"] == [1.0, 8.0, 8.0]
    assert drawn["flashinfer"][:2] == [0.5, 4.0] and math.isnan(drawn["flashinfer"][2])


def test_relay_grid_and_its_method_inputs_on_cpu():
    """The relay grid's points, and the inputs run_point builds for them: on the
    CPU (our CPU kernels stand in for the CUDA ones), the tree rows and the
    per-request prefill agree with the causal oracle, and the decode-only
    baselines are skipped with a reason."""
    relay = kg.grid_points(["relay"])
    assert [p.query_len for p in relay] == list(kg.RELAY_QUERY_LENS)
    assert all(p.batch == 32 and p.shared == 2048 and p.context == 2048 + 128 + p.query_len for p in relay)
    point = kg.Point("relay", 4, 128, 128, 32 + 5, query_len=5)
    settings = kg.Settings(heads=4, kv_heads=2, head_size=64, block_size=32, dtype="bfloat16",
                           methods=["chunk", "chunk_prefill", "flashinfer", "sdpa"])
    fns, skipped, facts = kg._method_fns(point, settings, torch.device("cpu"))
    assert set(fns) == {"chunk", "chunk_prefill"}
    assert set(skipped) == {"flashinfer", "sdpa"} and all("one query token" in why for why in skipped.values())
    # The shared prefix is one node over all 20 rows; each request's own chunk one over its 5.
    assert facts["nodes"] == 1 + 4
    query, kv, table, seq_lens, scale = facts["inputs"]
    assert query.shape == (20, 4, 64)
    qsl = torch.arange(5, dtype=torch.int32) * 5
    expected = reference.paged_attention(query, kv, qsl, seq_lens, table, scale)
    for method, fn in fns.items():
        torch.testing.assert_close(fn().float(), expected.float(), atol=3e-2, rtol=3e-2, msg=method)


def test_relay_chunk_drops_own_nodes_as_the_engine_does_on_cpu():
    """With fewer new tokens than CUDA.own_node_min_query_len, `chunk` runs the
    engine's tree (each request's own node dropped) and `chunk_own_stacked` the
    tree with them; both agree with the causal oracle."""
    from vllm_chunkattn.kernels.support import CUDA

    q = CUDA.own_node_min_query_len - 1
    point = kg.Point("relay", 4, 128, 128, 32 + q, query_len=q)
    settings = kg.Settings(heads=4, kv_heads=2, head_size=64, block_size=32, dtype="bfloat16",
                           methods=["chunk", "chunk_own_stacked", "chunk_prefill"])
    fns, skipped, facts = kg._method_fns(point, settings, torch.device("cpu"))
    assert set(fns) == {"chunk", "chunk_own_stacked", "chunk_prefill"} and not skipped
    assert facts["nodes"] == 1  # the shared prefix only
    query, kv, table, seq_lens, scale = facts["inputs"]
    expected = reference.paged_attention(query, kv, torch.arange(5, dtype=torch.int32) * q, seq_lens, table, scale)
    for method, fn in fns.items():
        torch.testing.assert_close(fn().float(), expected.float(), atol=3e-2, rtol=3e-2, msg=method)
    point = kg.Point("relay", 4, 128, 128, 32 + q + 1, query_len=q + 1)
    fns, skipped, facts = kg._method_fns(point, settings, torch.device("cpu"))
    assert "chunk_own_stacked" in skipped and facts["nodes"] == 1 + 4


def test_relay_crossover_reads_the_threshold_off_the_grid():
    def row(q, chunk, prefill):
        return {"grid": "relay", "query_len": q, "times_us": {"chunk": chunk, "chunk_prefill": prefill}}

    rows = [row(1, 10, 50), row(2, 20, 40), row(4, 30, 35), row(8, 50, 40), row(16, 40, 45)]
    line = kg.relay_crossover(rows, group=2)
    assert "at most 8 query rows per KV head" in line  # q = 4 x group 2; q = 8 lost, so 32 does not count
    assert "2: yes, 4: yes, 8: yes, 16: no, 32: yes" in line
    assert kg.relay_crossover([r for r in rows if r["query_len"] == 1][:0], group=1) is None
