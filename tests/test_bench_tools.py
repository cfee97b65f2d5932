"""The benchmark tools that run on the CPU machine too: the launch-cost chain and the
compile-only kernel count."""
import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from benchmarks import graph_launch


def test_graph_launch_chain_runs_and_donates(capsys):
    graph_launch.main(["--n", "3", "--calls", "4"])
    lines = [json.loads(s) for s in capsys.readouterr().out.strip().splitlines()]
    assert lines[0]["platform"] == jax.devices()[0].platform
    rows = {r["mode"]: r for r in lines[1:]}
    assert set(rows) == {"fresh", "donated"}
    for r in rows.values():
        assert r["n"] == 3 and r["kernels"] >= 1 and r["sync_us"] > 0


def test_graph_launch_mosaic_chain_computes_its_chain(capsys):
    """The Mosaic-GPU chain (interpreted here) applies its n kernels, and main reports it."""
    import jax.numpy as jnp
    import numpy as np
    x = jax.random.normal(jax.random.key(int(np.random.default_rng().integers(1 << 30))),
                          (64, 256), jnp.float32)
    got = np.asarray(jax.block_until_ready(jax.jit(lambda x: graph_launch.chain_mosaic(x, 3))(x)))
    want = np.asarray(x)
    for _ in range(3):
        want = want * np.float32(0.999) + np.float32(1e-4)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    graph_launch.main(["--n", "1", "--calls", "3", "--kinds", "mosaic", "--modes", "donated"])
    rows = [json.loads(s) for s in capsys.readouterr().out.strip().splitlines()][1:]
    assert [(r["kind"], r["mode"], r["n"]) for r in rows] == [("mosaic", "donated", 1)]


def test_graph_launch_donated_mode_aliases_its_output():
    import jax.numpy as jnp
    f = jax.jit(lambda x, out: graph_launch.chain(x, 2) + 0.0 * out, donate_argnums=(1,))
    x = jnp.ones((8, 16))
    hlo = f.lower(x, x + 1).compile().as_text()
    assert "input_output_alias={ {}: (1, {}" in hlo


def test_aot_anatomy_names_the_missing_plugin():
    """Without the CUDA plugin the compile-only topology fails with a message that says
    what to install (with it, the tool compiles; that needs the plugin, not a GPU)."""
    try:
        installed = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:   # no jax_plugins namespace at all
        installed = False
    if installed:
        pytest.skip("the CUDA plugin is installed here")
    from benchmarks import aot_anatomy
    with pytest.raises(SystemExit, match="CUDA plugin"):
        aot_anatomy.gpu_devices()


def test_step_anatomy_labels_kernels_by_op_and_by_name():
    """op_sources labels ENTRY instructions by op_name (custom calls with their result type);
    event_label maps a profiled kernel back by hlo_op, or by name inside a CUDA graph."""
    from benchmarks.step_anatomy import event_label, op_sources
    hlo = "\n".join([
        "HloModule m",
        "ENTRY %main {",
        '  %input_scatter_fusion.3 = f32[64,4096]{1,0} fusion(%a, %b), kind=kInput, '
        'calls=%fused_scatter.3, metadata={op_name="jit(step)/layer0_swa/scatter-add"}',
        '  %mpmd_map.7 = f32[1,305,4096,8]{3,2,1,0} custom-call(%x, %w), '
        'custom_call_target="mosaic_gpu", metadata={op_name="jit(step)/kernel/mpmd_map"}',
        "  %copy.2 = f32[8]{0} copy(%c)",
        "}"])
    src = op_sources(hlo)
    assert src["input_scatter_fusion.3"] == ("fusion", "fusion: layer0_swa/scatter-add")
    assert src["mpmd_map.7"][1] == "custom-call: kernel/mpmd_map -> f32[1,305,4096,8]{3,2,1,0}"
    assert src["copy.2"] == ("copy", "copy: <copy>")
    # by hlo_op outside graphs, by kernel name inside one, None when unknown
    assert event_label("whatever", "input_scatter_fusion.3", src) == "fusion: layer0_swa/scatter-add"
    assert event_label("input_scatter_fusion_3", "command_buffer_1", src) == \
        "fusion: layer0_swa/scatter-add"
    assert event_label("nvjet_sm90_tss", "command_buffer_1", src) is None


def test_attn_timeline_summarize_sums_top_level_scopes(tmp_path):
    """A synthetic Mosaic profiler trace (2 CTAs x 3 warpgroups): per-role means of the
    top-level scopes, nested scopes not double-counted, CTA start offsets and span."""
    import json
    from benchmarks import attn_timeline
    rng = np.random.default_rng(0)
    ev, want = [], {"deq": [], "pv": [], "issue": []}
    for cta in range(2):
        t0 = float(cta) * 0.5
        for wg in range(3):
            tid = 1 + wg + 3 * cta
            t = t0
            names = ("issue",) if wg == 2 else ("deq", "pv")
            for name in names:
                d = float(rng.uniform(1, 3))
                ev += [dict(name=name, ph="B", ts=t, pid=1, tid=tid),
                       dict(name="inner", ph="B", ts=t + 0.1, pid=1, tid=tid),
                       dict(name="inner", ph="E", ts=t + 0.2, pid=1, tid=tid),
                       dict(name=name, ph="E", ts=t + d, pid=1, tid=tid)]
                want[name].append(d)
                t += d
    p = tmp_path / "k-trace.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    lines = attn_timeline.summarize(str(p))
    assert "2 CTAs" in lines[0] and "start offsets min/median/max 0.00/0.25/0.50" in lines[0]
    cons = lines[1]
    for name in ("deq", "pv"):
        assert f"{name} {sum(want[name]) / 4:.2f} (1.0)" in cons
    assert "inner" not in cons
    assert f"issue {sum(want['issue']) / 2:.2f} (1.0)" in lines[2]


def test_attention_op_cost_counts_the_attended_entries():
    """op_cost's entry count: every window slot of a long context plus every top-k id at
    4K (t >= 127 fills the window; 4096 // 4 visible entries > k), and, with ids holed at
    random, the same count made in numpy from the ids and window positions."""
    from benchmarks.attention_decode import make_case, op_cost
    B, H, k = 3, 64, 64
    args = make_case(jax.random.key(int(np.random.default_rng().integers(1 << 30))), B, H,
                     4096, k, "csa")
    n, nbytes, flops = op_cost(args)
    assert n == B * (k + 128)
    assert nbytes == n * 584 + 2 * B * H * 512 * 2 and flops == 2 * H * n * 1024
    rng = np.random.default_rng()
    idx = np.where(rng.random((B, k)) < 0.3, -1, np.asarray(args[4]))
    pos, t = np.asarray(args[1][3]).copy(), np.asarray(args[5])
    pos[0, rng.choice(128, 40, replace=False)] = -1       # empty ring slots
    holed = (args[0], args[1][:3] + (pos,), args[2], args[3], idx, args[5], args[6])
    win = sum(int(((p >= 0) & (p <= tb) & (p > tb - 128)).sum()) for p, tb in zip(pos, t))
    assert op_cost(holed)[0] == int((idx >= 0).sum()) + win < B * (k + 128)


def test_with_env_sets_and_restores(monkeypatch):
    from benchmarks.common import with_env
    monkeypatch.setenv("DSV4_T_SET", "old")
    monkeypatch.delenv("DSV4_T_NEW", raising=False)
    seen = with_env({"DSV4_T_SET": "a", "DSV4_T_NEW": "b"},
                    lambda: (os.environ["DSV4_T_SET"], os.environ["DSV4_T_NEW"]))
    assert seen == ("a", "b")
    assert os.environ["DSV4_T_SET"] == "old" and "DSV4_T_NEW" not in os.environ
    with pytest.raises(KeyError):   # restored when the call raises too
        with_env({"DSV4_T_NEW": "b"}, lambda: {}["missing"])
    assert "DSV4_T_NEW" not in os.environ


def test_indexer_probe_variant_knobs():
    from benchmarks.indexer_probe import parse_variant
    v = parse_variant("nvfp4:place:16:3:0:1:w:0:2+DSV4_IDX_ABLATE=nodeq+X=a=b")
    assert (v["fmt"], v["chunks_per_cta"], v["stages"], v["barriers"], v["chunks_per_step"]) == \
        ("nvfp4", 16, 3, "warp", 2)
    assert v["env"] == {"DSV4_IDX_ABLATE": "nodeq", "X": "a=b"}
    assert parse_variant("fp4:place:0:2:0")["env"] == {}


def test_ncu_top_stalls_orders_by_samples(tmp_path):
    """ncu_top_stalls reads an Nsight Compute source-page CSV (a preamble line, then the
    header) and lists the instructions by their share of all warp-state samples, with
    each one's non-zero stall-reason columns."""
    import csv
    from benchmarks.ncu_top_stalls import top_stalls
    rng = np.random.default_rng()
    n = 12
    samples = rng.permutation(np.arange(1, n + 1) * 7)
    barrier = rng.integers(0, 3, n)
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "# Samples",
            "stall_barrier", "stall_long_sb"]
    rows = [[f"0x{16 * i:x}", f"OP{i} R{i}", f"{s:,}", str(s), str(b), "0"]
            for i, (s, b) in enumerate(zip(samples, barrier))]
    p = tmp_path / "src.csv"
    with open(p, "w", newline="") as f:
        f.write("==PROF== a preamble line\n")
        csv.writer(f).writerows([head] + rows)
    lines = top_stalls(str(p), 4).splitlines()
    assert lines[0].startswith(f"{n} instructions, {samples.sum()} samples")
    order = np.argsort(-samples)[:4]
    for line, i in zip(lines[1:], order):
        assert f"OP{i} R{i}" in line
        assert line.split("%")[0].strip() == f"{100 * samples[i] / samples.sum():.1f}"
        assert ("stall_barrier=" in line) == (barrier[i] > 0)
        assert "stall_long_sb" not in line
