# The two commands of the README: `make demo` and `make test`. Both create .venv when missing and
# are no-ops for set-up when it is current (a stamp per extra set, remade when setup.py changes).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# torch first and pinned: this is the CPU wheel; an open range would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: demo test docs bench bench-llm lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install $(TORCH)

# One stamp per extras set; `pip install -e` runs again only when setup.py changes.
$(VENV)/.stamp-%: setup.py | $(PY)
	$(PIP) install $(TORCH) -e ".[$(subst +,$(comma),$*)]"
	touch $@
comma := ,

demo: $(VENV)/.stamp-examples
	$(PY) examples/cartpole_grpo.py

# The whole suite: unit, property, example (CartPole, LLM) and multi-writer (Ray) tests + doctests.
test: $(VENV)/.stamp-test+examples+llm+dist
	$(PY) -m pytest -q test torchrl_grpo --doctest-modules

# The site, with warnings as errors, and every example on it run by Sphinx's doctest builder.
docs: $(VENV)/.stamp-docs+examples+llm
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html
	$(PY) -m sphinx -W --keep-going -q -b doctest docs docs/_build/doctest

# Benchmark tables (each a side-by-side comparison in one run); see docs/benchmarks.rst.
bench: $(VENV)/.stamp-examples+llm+dist
	$(PY) benchmarks/transform_throughput.py
	$(PY) benchmarks/shared_writers.py
	$(PY) benchmarks/loss_memory.py
	$(PY) benchmarks/llm_loss_memory.py
	$(PY) benchmarks/cartpole_seeds.py

# The LLM example at its defaults for seeds 0-2, one after the other (about 10 minutes).
bench-llm: $(VENV)/.stamp-examples+llm
	$(PY) benchmarks/llm_seeds.py

lint: $(VENV)/.stamp-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) docs/_build .pytest_cache
