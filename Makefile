# spotagent — make demo (the whole spot lifecycle on emulated AWS), make test (the suite).
# Both set themselves up on a fresh Debian 12 machine as root: apt-get for system packages,
# a virtualenv in .venv with the pinned torch.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
TORCH := torch==2.13.0
APT_PACKAGES := python3 python3-venv python3-pip make util-linux e2fsprogs xfsprogs \
	busybox-static psmisc debootstrap systemd-container packer kmod \
	openssh-client
STAMP := $(VENV)/.installed

.PHONY: setup test lint typecheck unit test-slow wheelhouse demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "setup: apt-get install$$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" numpy
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check agent trainer tests bench

typecheck: setup
	$(VENV)/bin/mypy -p spotagent -p spottrainer

unit: setup
	$(PY) -m pytest -m "not slow" tests

test: lint typecheck unit

# The real-systemd tier (docs/systemd-tier.md): packer build -only=null.local into a booted
# systemd-nspawn container, then the unit under systemd as PID 1 (containers, and one QEMU/TCG
# guest with NVMe hot-plug). Caches its debootstrapped root and the provisioned image under
# $${SPOTAGENT_CACHE:-/var/cache/spotagent}.
test-slow: setup
	@command -v qemu-system-x86_64 >/dev/null || { echo "test-slow: apt-get install qemu-system-x86"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-system-x86; }
	$(PY) -m pytest -q -m slow tests/slow tests/test_demo.py

# spotagent and its agent dependencies as wheels, for packer/scripts/install.sh (--no-index).
wheelhouse: setup
	rm -rf build/wheelhouse
	$(PY) -m pip wheel -q --disable-pip-version-check --wheel-dir build/wheelhouse ".[agent]"

demo: setup
	$(PY) -m spotagent demo

# Every benchmark, one after the other; each prints its figures and ratios (see README).
bench: setup
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
