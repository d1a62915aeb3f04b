# The two commands of the README: `make demo` and `make test`. Both set up .venv/ first
# (idempotent: a second run only checks what is installed).
PY := .venv/bin/python

.PHONY: setup demo test test-quick test-portable lint notebooks bench check-install

# `make setup GPU=1`: SGLang with its CUDA dependencies, for a GPU machine (scripts/setup.sh)
setup:
	@GPU=$(GPU) bash scripts/setup.sh

demo: setup
	$(PY) -m sgl_embeds.demo

# the whole suite, then the exactness-sensitive tests again with AVX2 kernels (scripts/test_portable.sh),
# then one deliberate break in rotation that the tests must catch (scripts/sabotage_rotation.sh; its
# control is the suite's own run of the named tests, read from its JUnit report); red if any of the three fails
test: setup
	@status=0; suite=$$(mktemp -d); \
	$(PY) -m pytest -q -p no:cacheprovider --durations=30 --junitxml=$$suite/report.xml || status=1; \
	bash scripts/test_portable.sh || status=1; \
	SABOTAGE_CONTROL=$$suite/report.xml bash scripts/sabotage_rotation.sh || status=1; rm -rf $$suite; exit $$status

# `pip install .` into a fresh venv beside .venv's SGLang, serving the demo model (no network)
check-install: setup
	bash scripts/check_install.sh

test-portable: setup
	bash scripts/test_portable.sh

test-quick: setup
	$(PY) -m pytest -q -m "not server"

# ruff with pyproject.toml's [tool.ruff] rules (tests/unit/test_lint.py runs it too, so `make test` and CI do)
lint: setup
	$(PY) -m ruff check .

# the tutorials in examples/ run and saved with their outputs (tests/examples/test_notebooks.py checks them)
notebooks: setup
	$(PY) scripts/refresh_notebooks.py
