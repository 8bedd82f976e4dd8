# Quick start: `make demo` and `make test` work on a fresh clone with nothing set up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The CPU build of torch is named explicitly: an unpinned `torch` would let pip pick a
# multi-GB CUDA build. Any torch >= 2.4 works with foldc itself.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" "triton==3.6.0" "numpy<2.4"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/foldc demo

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
