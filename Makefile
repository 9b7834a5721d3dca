# The two commands of hetfair's README:
#   make demo   set everything up, then train the MNIST example on Fashion-MNIST end to end
#               (DEMO_FLAGS="--max-images 3000" adds flags to its hetfair-train, e.g. for a quick trial)
#   make test   set everything up, then run the test suite (what .ci/run does)
# "Everything" is a virtual environment in $(VENV) with torch (a CPU build unless an NVIDIA GPU
# is present), hetfair and the example plugin (and, for make test, the test tools), plus the Debian
# data packages. Each step is skipped when it is done already, so running either again is fast.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
DEMO_SAVE_DIR ?= checkpoints/demo
DEMO_LOGDIR ?= runs/demo
DEMO_FLAGS ?=
PYTEST_ARGS ?= -q
TEST_WORKERS ?= 2

BIN := $(VENV)/bin
STAMPS := $(VENV)/.hetfair-setup
DEMO_PACKAGES := dataset-fashion-mnist
TEST_PACKAGES := dataset-fashion-mnist jargon-text iproute2

.PHONY: help demo test setup demo-data test-data clean-demo

help:
	@echo "make demo    set up (venv, torch, hetfair, Fashion-MNIST) and train the MNIST example"
	@echo "make test    set up (venv, torch, hetfair, test data) and run the test suite"
	@echo "make setup   only set up the environment in $(VENV)"

demo: setup demo-data
	$(BIN)/hetfair-train --user-dir plugins --task mnist --dataset fashion-mnist --max-epoch 1 \
	    --save-dir $(DEMO_SAVE_DIR) --tensorboard-logdir $(DEMO_LOGDIR) $(DEMO_FLAGS)
	$(BIN)/hetfair-validate --user-dir plugins --path $(DEMO_SAVE_DIR)/checkpoint_best.pt --valid-subset test
	@echo
	@echo "Checkpoints:     $(DEMO_SAVE_DIR)/checkpoint_best.pt and checkpoint_last.pt"
	@echo "TensorBoard:     $(BIN)/tensorboard --logdir $(DEMO_LOGDIR)   then open http://localhost:6006"
	@echo "                 (the CUSTOM SCALARS tab shows every rank's share and speed on one chart)"
	@echo "The tools:       . $(BIN)/activate; hetfair-train --user-dir plugins --task mnist --help"

# make test runs the suite on TEST_WORKERS pytest-xdist workers (a test file per worker at a time), then
# the tests that hold deadlines on peers (marked serial in tests/conftest.py) in their two groups side
# by side on two workers. TEST_WORKERS=1 is one plain pass.
# (Exit status 5 is pytest's "no tests collected": a PYTEST_ARGS selection without serial tests.)
# The suite writes bytecode even where PYTHONDONTWRITEBYTECODE is set: its hundreds of processes then
# compile each module they import once between them (the test tools are installed uncompiled, below).
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest
test: $(STAMPS)/test-tools test-data
ifeq ($(TEST_WORKERS),1)
	$(PYTEST) $(PYTEST_ARGS)
else
	$(PYTEST) $(PYTEST_ARGS) -m "not serial" -n $(TEST_WORKERS) --dist loadfile
	$(PYTEST) $(PYTEST_ARGS) -m serial -n 2 --dist loadgroup || [ $$? -eq 5 ]
endif

setup: $(STAMPS)/installed

demo-data:
	@tools/install_debian_packages.sh $(DEMO_PACKAGES)

test-data:
	@tools/install_debian_packages.sh $(TEST_PACKAGES)

clean-demo:
	rm -rf $(DEMO_SAVE_DIR) $(DEMO_LOGDIR)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMPS)/torch: | $(BIN)/python
	$(PYTHON) tools/install_torch.py $(BIN)/python $(TORCH_VERSION)
	@mkdir -p $(STAMPS) && touch $@

# make test installs the test tools in the same pip run as hetfair (one resolve), without compiling every
# module as pip would (a third of its time): the suite compiles what it imports. make setup keeps pip's
# compiling: where PYTHONDONTWRITEBYTECODE is set, nothing else would, and each run would compile again.
PIP_INSTALL := $(BIN)/python -m pip install --quiet
PACKAGE_FILES := setup.cfg pyproject.toml plugins/hetfair_plugin_example/pyproject.toml

$(STAMPS)/installed: $(STAMPS)/torch $(PACKAGE_FILES)
	$(PIP_INSTALL) -e . -e plugins/hetfair_plugin_example
	@touch $@

$(STAMPS)/test-tools: $(STAMPS)/torch $(PACKAGE_FILES)
	$(PIP_INSTALL) --no-compile -e ".[test]" -e plugins/hetfair_plugin_example
	@touch $(STAMPS)/installed $@
