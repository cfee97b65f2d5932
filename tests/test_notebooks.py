"""Execute the notebooks top to bottom (CPU) and check the figures they make.

Both notebooks run the embedded trained model (`dsv4_jax.embedded_checkpoint()`,
dsv4-small-stdlib: about the size of the tiny preset) on Python source prompts; the layer
explorer also runs the MTP block (its figure `mtp_agreement`).

Each notebook runs in a fresh `python3` kernel (ipykernel; jupyter_client starts it with the
interpreter running pytest) whose working directory is a temporary folder (the notebooks
write their figures under `_out/<notebook>/` there), with PYTHONPATH set to the repo root.
Skipped when the `notebooks` extra is not installed.
"""
from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"

# notebook -> the figures (PNG files under _out/<notebook>/ in its working directory) it must
# produce
FIGURES = {
    "layer_explorer": ["attention_head", "attention_mass", "indexer_selection",
                       "compressor_gates", "router_load", "mhc_comb", "mhc_pre_post",
                       "logit_lens", "mtp_agreement"],
    "quickstart": ["stream_latency", "sampler_distributions", "step_probabilities"],
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    assert data[:8] == PNG_MAGIC, "not a PNG file"
    assert data[12:16] == b"IHDR", "PNG without IHDR first"
    return struct.unpack(">II", data[16:24])


def execute(name: str, work_dir: Path, monkeypatch):
    """Run notebooks/<name>.ipynb in a fresh kernel whose working directory is work_dir;
    returns the executed notebook."""
    path = NB_DIR / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    pp = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + (os.pathsep + pp if pp else ""))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend shows figures
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(work_dir)}})
    t0 = time.perf_counter()
    client.execute()
    print(f"{name}: executed in {time.perf_counter() - t0:.1f} s")
    return nb


@pytest.mark.slow  # ~22 s + ~43 s of CPU (2 cores), mostly XLA compilation
@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_runs_and_draws(name, tmp_path, monkeypatch):
    nb = execute(name, tmp_path, monkeypatch)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), "a code cell did not run"
    outputs = [o for c in code for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, f"{name}: {errors[0].ename}: {errors[0].evalue}"
    # every figure is saved under _out/<name>/ ...
    out = tmp_path / "_out" / name
    saved = sorted(p.stem for p in out.glob("*.png"))
    assert saved == sorted(FIGURES[name]), f"{name}: figures written {saved}"
    for stem in FIGURES[name]:
        w, h = png_size((out / f"{stem}.png").read_bytes())
        assert w >= 300 and h >= 200, f"{name}/{stem}.png is only {w}x{h} px"
    # ... and shown inline as an image output
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == len(FIGURES[name]), (
        f"{name}: {len(images)} inline images for {len(FIGURES[name])} figures")


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_pairs_in_sync(name):
    """The committed .ipynb and its jupytext .py twin hold the same cells, and the .ipynb
    is committed without outputs."""
    jupytext = pytest.importorskip("jupytext")
    ipynb = nbformat.read(NB_DIR / f"{name}.ipynb", as_version=4)
    py = jupytext.read(NB_DIR / f"{name}.py")
    cells = lambda nb: [(c.cell_type, c.source.strip()) for c in nb.cells]
    assert cells(ipynb) == cells(py), (
        f"{name}.ipynb and {name}.py differ: run `jupytext --sync notebooks/{name}.ipynb`")
    for c in ipynb.cells:
        if c.cell_type == "code":
            assert not c.get("outputs") and c.get("execution_count") is None, (
                f"{name}.ipynb has outputs committed; clear them")
