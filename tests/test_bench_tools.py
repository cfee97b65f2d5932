"""The benchmark tools' parts that run without a GPU: the HBM ceiling measurement, the
kernel count of an optimised HLO module, the CUDA-graph summary of XLA's thunk sequence,
the profiler's kernel labels, and the trace / report readers of the kernel benches."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import common
from benchmarks.step_anatomy import event_label

SEED = 41

HLO = "\n".join([
    "HloModule m",
    "%fused_scatter.3 {",
    '  %inner = f32[8]{0} add(%p, %q), metadata={op_name="jit(step)/layer9_csa/add"}',
    "}",
    "ENTRY %main {",
    '  %input_scatter_fusion.3 = f32[64,4096]{1,0} fusion(%a, %b), kind=kInput, '
    'calls=%fused_scatter.3, metadata={op_name="jit(step)/layer0_swa/attn/scatter-add"}',
    '  %mpmd_map.7 = f32[1,305,4096,8]{3,2,1,0} custom-call(%x, %w), '
    'custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/layer1_csa/kernel/mpmd_map"}',
    '  %multi.2 = (bf16[8]{0}, f32[8]{0}) fusion(%c), kind=kLoop, calls=%f2, '
    'metadata={op_name="jit(step)/layer1_csa/ffn/reduce"}',
    '  %head_fusion = f32[1,129280]{1,0} fusion(%h), kind=kOutput, calls=%f3, '
    'metadata={op_name="jit(step)/head/dot_general"}',
    "  %copy.2 = f32[8]{0} copy(%c)",
    '  %p.1 = s32[1]{0} parameter(0), metadata={op_name="jit(step)/layer1_csa/pos"}',
    "}"])


def test_hbm_bandwidth_reports_each_pass_and_the_largest():
    bw = common.hbm_bandwidth(1 << 20, calls=2, rounds=1, warm_s=0.0)
    assert set(bw) == {"copy", "a+1", "read", "ceiling"}
    assert all(v > 0 for v in bw.values())
    assert bw["ceiling"] == max(bw["copy"], bw["a+1"], bw["read"])


def test_median_seconds_times_the_call():
    calls = []
    t = common.median_seconds(lambda: calls.append(1) or jnp.ones(4), iters=3)
    assert t >= 0 and len(calls) == 4   # one warm-up + 3 timed


def test_op_sources_labels_entry_instructions():
    """ENTRY instructions only (not the fused computation's), labelled by the last two
    op_name parts; custom calls add their result type; tuples (multi-output fusions) are
    kernels too; without op_name the instruction's name stands in."""
    src = common.op_sources(HLO)
    assert "inner" not in src
    assert src["input_scatter_fusion.3"][:2] == ("fusion", "fusion: attn/scatter-add")
    assert src["mpmd_map.7"][1] == "custom-call: kernel/mpmd_map -> f32[1,305,4096,8]{3,2,1,0}"
    assert src["multi.2"][:2] == ("fusion", "fusion: ffn/reduce")
    assert src["copy.2"] == ("copy", "copy: <copy>", "")


def test_kernel_counts_by_source_and_by_layer():
    n, by_src = common.kernels_by_source(HLO)
    assert n == 5   # 3 fusions, the custom call, the copy; not the parameter
    assert by_src["fusion: attn/scatter-add"] == 1 and sum(by_src.values()) == n
    by_layer = common.kernels_by_layer(HLO)
    assert by_layer == {0: 1, 1: 2, None: 2}


def test_graph_summary_counts_graphs_commands_and_thunks_outside():
    from benchmarks.kernel_count import graph_summary
    rng = np.random.default_rng(SEED)
    sizes = rng.integers(1, 6, 3)
    lines, i = [], 0
    for k, size in enumerate(sizes):
        lines.append(f"{i:03d}: kCommandBuffer [source | sink] ")
        i += 1
        for _ in range(size):
            lines.append(f"    {i:03d}: kCustomKernel [source | next=000 (1)] fusion_{i} grid: [1, 1, 1]")
            i += 1
        if k < 2:
            lines.append(f"{i:03d}: kAllReduceStart [source | sink] ")
            i += 1
    got = graph_summary("\n".join(lines))
    assert got["graphs"] == 3 and got["commands"] == int(sizes.sum())
    assert dict(got["outside"]) == {"kAllReduceStart": 2}


def test_kernel_count_names_the_missing_plugin():
    """Without the CUDA plugin the compile-only topology fails with a message that says
    what to install (with it the tool compiles; that needs the plugin, not a GPU)."""
    for mod in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            if importlib.util.find_spec(mod) is not None:
                pytest.skip(f"the CUDA plugin {mod} is installed here")
        except ModuleNotFoundError:   # no jax_plugins namespace at all
            pass
    from benchmarks.kernel_count import gpu_devices
    with pytest.raises(SystemExit, match="CUDA plugin"):
        gpu_devices("h200")


def test_gpu_specs_carry_the_cuda_versions():
    """Without the CUDA versions XLA reads a compile-only target as CUDA 0.0 and leaves the
    custom calls out of the CUDA graphs."""
    import glob
    import os
    specs = glob.glob(os.path.join(os.path.dirname(common.__file__), "gpu_specs", "*.txtpb"))
    assert specs
    for path in specs:
        text = open(path).read()
        for field in ('driver_version: "13.0.0"', 'runtime_version: "13.0.0"',
                      'compile_time_toolkit_version: "13.0.0"', "runtime_version { major: 13 }"):
            assert field in text, (path, field)


def test_event_label_maps_profiled_kernels_back():
    """By hlo_op outside graphs, by kernel name inside one, None when unknown."""
    src = common.op_sources(HLO)
    assert event_label("whatever", "input_scatter_fusion.3", src) == "fusion: attn/scatter-add"
    assert event_label("input_scatter_fusion_3", "command_buffer_1", src) == \
        "fusion: attn/scatter-add"
    assert event_label("nvjet_sm90_tss", "command_buffer_1", src) is None


def test_attention_op_cost_counts_the_attended_entries():
    """op_cost's entry count: every window slot of a long context plus every top-k id at
    4K (t >= 127 fills the window; 4096 // 4 visible entries > k), and, with ids holed at
    random, the same count made in numpy from the ids and window positions."""
    from benchmarks.attention import make_case, op_cost
    B, H, k = 3, 64, 64
    args = make_case(jax.random.key(SEED), B, H, 4096, k, "csa")
    n, nbytes, flops = op_cost(args)
    assert n == B * (k + 128)
    assert nbytes == n * 584 + 2 * B * H * 512 * 2 and flops == 2 * H * n * 1024
    rng = np.random.default_rng(SEED)
    idx = np.where(rng.random((B, k)) < 0.3, -1, np.asarray(args[4]))
    pos, t = np.asarray(args[1][3]).copy(), np.asarray(args[5])
    pos[0, rng.choice(128, 40, replace=False)] = -1       # empty ring slots
    holed = (args[0], args[1][:3] + (pos,), args[2], args[3], idx, args[5], args[6])
    win = sum(int(((p >= 0) & (p <= tb) & (p > tb - 128)).sum()) for p, tb in zip(pos, t))
    assert op_cost(holed)[0] == int((idx >= 0).sum()) + win < B * (k + 128)


def test_serve_load_stack_sampler_sees_which_thread_works():
    """The load test's sampler: a thread spinning in a function shows it as its leaf and
    holds more CPU than one asleep."""
    import threading
    import time
    from benchmarks.serve_load import StackSampler

    stop = threading.Event()   # the idle thread waits on it
    done = [False]             # the busy one polls a flag: Event.is_set would be a call

    def spin_here():
        x = 0
        while not done[0]:   # no call inside: the function itself is the leaf
            x += 1

    busy = threading.Thread(target=spin_here, name="busy")
    idle = threading.Thread(target=stop.wait, name="idle")
    busy.start()
    idle.start()
    with StackSampler(interval_s=0.005) as s:   # both threads live from start to end
        time.sleep(0.5)
    done[0] = True
    stop.set()
    busy.join()
    idle.join()
    rep = s.report()
    assert s.samples > 20
    assert rep["busy"]["leaf"][0][0].endswith(":spin_here")
    assert rep["cpu_s"]["busy"] > 0.1 > rep["cpu_s"].get("idle", 0.0)


def test_gpu_check_prefill_names_where_an_output_is_wrong(capsys):
    """The failing attention check reports which rows, heads and columns are off."""
    from benchmarks.gpu_check_prefill import where_wrong
    rng = np.random.default_rng(7)
    ref = rng.standard_normal((16, 4, 512)).astype(np.float32)
    y = ref.copy()
    y[3, 2, 100:110] += 1.0
    y[9, 0, 7] = np.nan
    where_wrong("x", y, ref)
    out = capsys.readouterr().out
    assert "rows 2/16 (first [3, 9])" in out and "heads 2/4 (first [0, 2])" in out
    assert "cols 11/512 (first [7, 100," in out and "NaN 1" in out
