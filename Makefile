# The two commands of the README: `make demo` and `make test`. Both create .venv when missing and
# are no-ops for set-up when it is current (a stamp per extra set, remade when setup.py changes).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# torch first and pinned: this is the CPU wheel; an open range would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: demo test test-next docs bench bench-llm lint clean

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
docs: $(VENV)/.stamp-docs+examples+llm+dist
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html
	$(PY) -m sphinx -W --keep-going -q -b doctest docs docs/_build/doctest

# Benchmark tables (each a side-by-side comparison in one run); see docs/benchmarks.rst.
bench: $(VENV)/.stamp-examples+llm+dist
	$(PY) benchmarks/transform_throughput.py
	$(PY) benchmarks/shared_writers.py
	$(PY) benchmarks/ray_mcadvantage.py
	$(PY) benchmarks/loss_memory.py
	$(PY) benchmarks/llm_loss_memory.py
	$(PY) benchmarks/cartpole_seeds.py

# The LLM example at its defaults for seeds 0-2, one after the other (about 10 minutes), then
# the synchronous and the asynchronous example on the same seeds (about 20 minutes).
bench-llm: $(VENV)/.stamp-examples+llm+dist
	$(PY) benchmarks/llm_seeds.py
	$(PY) benchmarks/llm_seeds.py --example both -- --steps 1000

# The suite against torchrl's and tensordict's nightlies, in a venv of its own: what their next
# release changes. Not in .ci/run, so that an upstream break does not block landing. The package
# goes in without its dependencies (setup.py pins torchrl below the next release).
NEXT    := .venv-next
NEXTPIP := $(NEXT)/bin/python -m pip --disable-pip-version-check -q
test-next:
	test -x $(NEXT)/bin/python || $(PYTHON) -m venv $(NEXT)
	$(NEXTPIP) install $(TORCH) torchrl-nightly tensordict-nightly
	$(NEXTPIP) install gymnasium "pytest>=8" "hypothesis>=6" tqdm matplotlib "transformers>=5" \
		tokenizers peft "ray[default]"
	$(NEXTPIP) install --no-deps -e .
	$(NEXT)/bin/python -c "import torchrl, tensordict; print('torchrl', torchrl.__version__, \
		'tensordict', tensordict.__version__)"
	$(NEXT)/bin/python -m pytest -q test torchrl_grpo --doctest-modules

lint: $(VENV)/.stamp-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(NEXT) docs/_build .pytest_cache
