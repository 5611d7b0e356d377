# The two commands a newcomer needs: `make demo` and `make test`. Both set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed
EXTRAS := torch,ucx,examples,metrics,bench,dev

.PHONY: demo test test-slow lint bench docs check-dist env clean

# The distribution was named `tensorx` before it became `tensorx-rdma`: an older .venv has
# that one installed too, which the uninstall removes (and does nothing otherwise).
$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo ">> installing tensorx-rdma[$(EXTRAS)] into $(VENV) (first run takes a few minutes)"
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip uninstall --quiet --yes tensorx 2>/dev/null || true
	$(BIN)/pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	@touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/train_digits.py

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check tensorx tests benchmarks examples docs/_ext .ci
	$(BIN)/mypy

# The documentation site (mkdocs.yml), strict: a broken link or unreadable docstring fails.
$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[docs]"
	@touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The sdist and wheel, checked file by file, and the wheel installed into a new venv (numpy
# and msgpack only, from pip's cache) where `import tensorx` and `tensorx info` must work.
check-dist: $(STAMP)
	$(BIN)/python .ci/check_dist.py

# The UCX rows on a host without RDMA run UCX's tcp, which a node only runs when allowed.
bench: $(STAMP)
	TENSORX_UCX_TCP=1 $(BIN)/python benchmarks/transfer.py --sizes 64K,16M,64M --plot bench-results/transfer.png
	TENSORX_UCX_TCP=1 $(BIN)/python benchmarks/run_all.py
	$(BIN)/python benchmarks/pipeline.py --netns

clean:
	rm -rf $(VENV) build dist site *.egg-info
