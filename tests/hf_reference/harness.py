"""Call the `transformers` DeepSeek-V4 port (in its own venv) from our numpy/JAX tests.

Runs in OUR .venv: numpy + safetensors only. The port runs in a subprocess under the
reference interpreter: `$DSV4_REF_PYTHON`, else `<repo>/.venv-ref/bin/python`.

    from tests.hf_reference import harness   # or `from hf_reference import harness` in tests/
    if harness.have_reference():
        out = harness.run_reference(hf_config, weights, tokens)          # mode="full"
        out["logits"]                                                   # [B, T, V] float32

`weights` are float32 numpy arrays keyed by official names. Accepted spellings:
official checkpoint names (`layers.0.attn.wq_a.weight`, `layers.0.ffn.experts.3.w1.weight`),
our parameter-tree keys (module path without `.weight`, e.g. `layers.0.attn.wq_a`, and
stacked experts `layers.0.ffn.experts.w1` [E, I, d]). `gate.tid2eid` may be any integer
array. Quantised inputs (`.scale` tensors, non-numeric leaves) are rejected: dequantise first.
`mtp.*` tensors are dropped (the port has no MTP; see NOTES.md) unless drop_mtp=False, which
makes them an error.

Output keys per mode are documented in run_hf.py's docstring (and NOTES.md section 7).
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
RUN_HF = os.path.join(_HERE, "run_hf.py")



def _load_hf_names():
    """checkpoints/hf_names.py by file path (the checkpoints package may import jax)."""
    import importlib.util

    name = "dsv4_hf_reference_hf_names"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(_REPO, "checkpoints", "hf_names.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


hf_names = _load_hf_names()

MODES = ("full", "decode", "moe", "mhc", "attn", "head")
_STACKED_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(w[123])(\.weight)?$")


def ref_python() -> str:
    """Path of the reference interpreter (env DSV4_REF_PYTHON overrides the default)."""
    return os.environ.get("DSV4_REF_PYTHON") or os.path.join(_REPO, ".venv-ref", "bin", "python")


@functools.lru_cache(maxsize=None)
def _have_reference(py: str) -> bool:
    if not os.path.exists(py):
        return False
    try:
        r = subprocess.run([py, "-c", "import transformers.models.deepseek_v4.modeling_deepseek_v4"],
                           capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def have_reference() -> bool:
    """True when the reference interpreter exists and imports transformers' DeepSeek-V4."""
    return _have_reference(ref_python())


def to_hf_weights(weights_official: dict, drop_mtp: bool = True) -> dict[str, np.ndarray]:
    """Official-named float32 arrays -> HF-named arrays (per-expert names for routed experts)."""
    out: dict[str, np.ndarray] = {}
    for name, value in weights_official.items():
        if name.startswith("mtp.") and drop_mtp:
            continue
        try:
            arr = np.asarray(value)
        except Exception as e:  # e.g. a quant pytree
            raise TypeError(f"{name}: not an array ({type(value).__name__}); dequantise first") from e
        if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
            raise TypeError(f"{name}: dtype {arr.dtype} is not numeric; dequantise first")
        if name.endswith(".scale"):
            raise ValueError(f"{name}: block scales are not accepted; pass dequantised float32 weights")
        m = _STACKED_EXPERT.match(name)
        if m:
            layer, w = m.group(1), m.group(2)
            if arr.ndim != 3:
                raise ValueError(f"{name}: stacked experts must be [E, out, in], got shape {arr.shape}")
            for e in range(arr.shape[0]):
                hf = hf_names.official_to_hf(f"layers.{layer}.ffn.experts.{e}.{w}.weight")
                out[hf] = np.ascontiguousarray(arr[e], np.float32)
            continue
        try:
            hf = hf_names.official_to_hf(name)
        except KeyError:
            try:  # parameter-tree key of a linear: module path without `.weight`
                hf = hf_names.official_to_hf(name + ".weight")
            except KeyError:
                raise KeyError(f"unknown official DeepSeek-V4 tensor name: {name!r}") from None
        if hf in out:
            raise KeyError(f"{name}: maps to {hf!r}, which was already given under another spelling")
        if name.endswith("tid2eid"):
            if not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"{name}: tid2eid must be an integer array, got {arr.dtype}")
            out[hf] = np.ascontiguousarray(arr, np.int64)
        else:
            out[hf] = np.ascontiguousarray(arr, np.float32)
    return out


def _run(args: list[str], timeout: float) -> None:
    py = ref_python()
    if not have_reference():
        raise RuntimeError(f"reference interpreter {py} missing or cannot import transformers.models.deepseek_v4")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    r = subprocess.run([py, RUN_HF, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"run_hf.py {' '.join(args[:4])} failed (rc {r.returncode}):\n{r.stderr[-4000:]}")


def _write_config(d: str, hf_config: dict) -> None:
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf_config, f)


def port_shapes(hf_config: dict, timeout: float = 300) -> dict[str, tuple[tuple[int, ...], str]]:
    """The port's state_dict for `hf_config`: HF name -> (shape, torch dtype name)."""
    with tempfile.TemporaryDirectory(prefix="dsv4_ref_") as d:
        _write_config(d, hf_config)
        out = os.path.join(d, "shapes.json")
        _run(["--mode", "shapes", d, "-", out], timeout)
        with open(out) as f:
            raw = json.load(f)
    return {k: (tuple(v[0]), v[1]) for k, v in raw.items()}


def run_reference(hf_config: dict, weights_official: dict, tokens: np.ndarray | None = None,
                  mode: str = "full", *, layer: int | None = None, which: str | None = None,
                  prefill: int | None = None, chunk: int = 1, drop_mtp: bool = True,
                  timeout: float = 600, **arrays: np.ndarray) -> dict[str, np.ndarray]:
    """Run the port on `weights_official` and return its outputs as numpy arrays.

    mode "full": `tokens` int [B, T]; returns logits and per-layer intermediates.
    mode "decode": `tokens`; the port's cache path (prefill `prefill` tokens, default T//2,
    then `chunk` tokens per step); returns `logits` [B, T, V].
    mode "moe" (x=[B,T,d], tokens for hash layers), "mhc" (X=[B,T,4,d], which="attn"|"ffn"),
    "attn" (x=[B,T,d]), "head" (X=[B,T,4,d]); `layer` for all but "head".
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    hf = to_hf_weights(weights_official, drop_mtp=drop_mtp)
    inputs = {k: np.asarray(v) for k, v in arrays.items()}
    if tokens is not None:
        tokens = np.asarray(tokens)
        if not np.issubdtype(tokens.dtype, np.integer) or tokens.ndim != 2:
            raise ValueError(f"tokens must be an int array [B, T], got {tokens.dtype} {tokens.shape}")
        inputs["tokens"] = tokens.astype(np.int32)
    if mode in ("full", "decode") and "tokens" not in inputs:
        raise ValueError(f"mode {mode!r} needs tokens")
    from safetensors.numpy import save_file

    with tempfile.TemporaryDirectory(prefix="dsv4_ref_") as d:
        _write_config(d, hf_config)
        save_file(hf, os.path.join(d, "model.safetensors"))
        inp, out = os.path.join(d, "input.npz"), os.path.join(d, "out.npz")
        np.savez(inp, **inputs)
        args = ["--mode", mode]
        if layer is not None:
            args += ["--layer", str(int(layer))]
        if which is not None:
            args += ["--which", which]
        if mode == "decode":
            args += ["--chunk", str(int(chunk))] + ([] if prefill is None else ["--prefill", str(int(prefill))])
        _run(args + [d, inp, out], timeout)
        with np.load(out) as z:
            return {k: z[k] for k in z.files}
