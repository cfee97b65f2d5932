# Quick start:  make demo   (sets up .venv and generates with the embedded small model)
#               make test   (sets up .venv + the reference env and runs the tests)
PY312 ?= $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' 2>/dev/null && echo python3.12 || ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)
PY311 ?= $(shell command -v python3.11 >/dev/null 2>&1 && python3.11 -c 'import sys' 2>/dev/null && echo python3.11 || ls -d $$HOME/.pyenv/versions/3.11*/bin/python3.11 2>/dev/null | tail -1)
VENV := .venv
REF := .venv-ref
PYTEST_ARGS ?= -n 2 --dist loadfile -m "not slow"   # two workers (CI has 2 cores), one test file per worker at a time; `make test-slow` runs the tests marked slow

.PHONY: demo test test-slow setup setup-ref gpu-test train clean

$(VENV)/.ok: pyproject.toml
	@test -n "$(PY312)" || (echo "python3.12 not found (jax 0.11 needs Python >= 3.12)"; exit 1)
	$(PY312) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test,notebooks,serve]"
	$(VENV)/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

# transformers' DeepSeek-V4 port as an independent reference (CPU torch exists for 3.11 here)
$(REF)/.ok:
	@if [ -n "$(PY311)" ]; then \
	  $(PY311) -m venv $(REF) && $(REF)/bin/pip install -q torch==2.13.0 "transformers==5.24.0" safetensors numpy \
	  && touch $@ || echo "reference env not installed: reference tests will be skipped"; \
	else echo "python3.11 not found: reference tests will be skipped"; fi

setup: $(VENV)/.ok
setup-ref: $(REF)/.ok

demo: setup
	$(VENV)/bin/dsv4 generate --prompt "def read_config(path):" --max-new-tokens 80 --temperature 0.7 --top-p 0.95 --stream

test: setup setup-ref
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# the tests marked slow: interpreted kernels on meshes and in whole models, subprocess meshes,
# notebooks, second parametrisations of the default tests (each names its time)
test-slow: setup setup-ref
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile -m slow

# the GPU tests (every test marked gpu), on a Hopper machine whose python3 has jax[cuda]
gpu-test:
	PYTHONPATH=. python3 -m pytest -q -m gpu -p no:cacheprovider tests

# train the small model (docs/TRAINING.md) on one GPU whose python3 has jax[cuda] and optax:
# prepare the stdlib corpus + tokenizer, train, export to runs/small/model, plot the losses
train:
	PYTHONPATH=. python3 -m training all --out runs/small

clean:
	rm -rf $(VENV) $(REF)
