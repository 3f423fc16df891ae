# moeshard — every target builds what it needs from pyproject.toml on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
REF_VENV := .venv-ref
REF_PY := $(REF_VENV)/bin/python
# The embedded default model: a small Qwen3-MoE trained by tools/train_demo.py (see models/).
DEMO_SRC := models/demo-hf
DEMO_OUT := out/demo
PROMPT ?= The function returns

.PHONY: all test lint demo demo-local demo-ppl k3-demo serve-demo fixtures ref-venv proto clean readme results \
	testbed p2p-testbed compose-check compose-test

all: test

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.stamp

lint: $(VENV)/.stamp
	$(VENV)/bin/ruff check moeshard tests tools
	$(VENV)/bin/ruff format --check moeshard tests tools
	$(VENV)/bin/lint-imports  # the dependency rule: pyproject.toml [tool.importlinter]

test: $(VENV)/.stamp lint
	$(PY) -m pytest

# Reference-only environment (torch + transformers): fixtures and demo-model training, never runtime.
$(REF_VENV)/.stamp:
	$(PYTHON) -m venv $(REF_VENV)
	$(REF_PY) -m pip install -q torch==2.13.0 transformers safetensors tokenizers numpy matplotlib sentencepiece
	touch $@

ref-venv: $(REF_VENV)/.stamp

fixtures: $(REF_VENV)/.stamp
	$(REF_PY) tools/make_fixtures.py --out tests/fixtures
	$(REF_PY) tools/make_kda_fixture.py --out tests/fixtures/kda/kimi_linear_kda.npz
	$(REF_PY) tools/make_kimi_linear_fixture.py --out tests/fixtures/kimi_linear

# (manifest.py holds the store's format version: a new one converts the demo again)
$(DEMO_OUT)/moeshard.json: $(DEMO_SRC)/model.safetensors $(DEMO_SRC)/config.json \
		$(DEMO_SRC)/tokenizer_config.json $(VENV)/.stamp moeshard/moe/storage/manifest.py
	$(VENV)/bin/moeshard convert $(DEMO_SRC) $(DEMO_OUT) --force

# The network mode on one machine: three node daemons on loopback, found with zeroconf.
demo: $(DEMO_OUT)/moeshard.json
	PY=$(PY) bash tools/demo_cluster.sh $(DEMO_OUT) "$(PROMPT)" 48

# The single-node mode under a hard RAM budget (experts streamed with O_DIRECT).
demo-local: $(DEMO_OUT)/moeshard.json
	$(VENV)/bin/moeshard generate $(DEMO_OUT) --ram 60M --prompt "$(PROMPT)" --max-tokens 48

# The embedded model behind the OpenAI-compatible API on http://127.0.0.1:8000/v1 (Ctrl-C stops).
serve-demo: $(DEMO_OUT)/moeshard.json
	$(VENV)/bin/moeshard serve $(DEMO_OUT) --name demo --port $(or $(PORT),8000)

# Kimi K3's architecture end to end on a tiny random K3 in the released layout (safetensors,
# nested config, MXFP4 experts, tiktoken): convert, inspect, generate in RAM, under a RAM
# budget and through three nodes. Random weights: the text is noise; the three agree.
K3_OUT := out/k3
k3-demo: $(VENV)/.stamp
	$(VENV)/bin/moeshard synth $(K3_OUT)-ckpt --preset k3 --checkpoint --force
	$(VENV)/bin/moeshard convert $(K3_OUT)-ckpt $(K3_OUT) --force
	$(VENV)/bin/moeshard inspect $(K3_OUT)
	$(VENV)/bin/moeshard generate $(K3_OUT) --prompt "$(PROMPT)" --max-tokens 16
	$(VENV)/bin/moeshard generate $(K3_OUT) --ram 52M --prompt "$(PROMPT)" --max-tokens 16
	PY=$(PY) bash tools/demo_cluster.sh $(K3_OUT) "$(PROMPT)" 16

# Validation perplexity of the committed model with f32 and with q4_0 experts.
demo-ppl: $(VENV)/.stamp
	$(VENV)/bin/moeshard perplexity $(DEMO_SRC) --text $(DEMO_SRC)/val.txt --experts f32,q4_0

# Regenerate the committed protobuf/gRPC modules (tests/test_wire.py checks they are current).
PROTO_OUT ?= moeshard/moe/wire
proto: $(VENV)/.stamp
	$(PY) -m grpc_tools.protoc -Iproto --python_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) \
		proto/moeshard.proto proto/health.proto
	sed -i -E 's/^import (moeshard|health)_pb2 as/from moeshard.moe.wire import \1_pb2 as/' \
		$(PROTO_OUT)/moeshard_pb2_grpc.py $(PROTO_OUT)/health_pb2_grpc.py
	$(PY) -m grpc_tools.protoc -Iproto --python_out=moeshard/moe/p2p proto/p2pd.proto

# Coordinator + 3 nodes in network namespaces on one bridge: zeroconf discovery, faults, latency
# (root; tears everything down on exit). Options go to tools/testbed.py: TESTBED_ARGS=--help
# Nodes at home behind two NATs, found and reached through the wide-area registry (root).
p2p-testbed: $(VENV)/.stamp
	$(PY) tools/p2p_testbed.py

testbed: $(VENV)/.stamp
	PY=$(PY) bash tools/testbed.sh $(TESTBED_ARGS)

# compose.yaml through a real Compose implementation's `config` (no Docker engine needed).
compose-check:
	bash tools/check_compose.sh

# The compose swarm for real: Docker engine (installed and started when absent), image built,
# 3 TLS nodes, generation checked against a local run, a node killed, scaled to 4, all removed.
compose-test: $(VENV)/.stamp
	bash tools/compose_test.sh

clean:
	rm -rf out build *.egg-info

# The README's runnable blocks (```sh run / ```python run), top to bottom as a reader would.
readme: $(VENV)/.stamp
	$(PY) tools/run_readme.py README.md

# Re-run the commands of docs/results.md's generated blocks and write their output in place
# (several minutes: benches on the demo model). RESULTS_ONLY=TEXT: only blocks naming TEXT.
results: $(DEMO_OUT)/moeshard.json
	$(PY) tools/update_results.py docs/results.md $(if $(RESULTS_ONLY),--only "$(RESULTS_ONLY)")
