# The two commands of the README, and what they need. Everything installs from this repo's own files.
VENV   ?= .venv
PY     := $(VENV)/bin/python
APT_PACKAGES := fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv curl util-linux s3fs rclone rsync

.PHONY: install bench-install demo test bench bench-quick device-kit lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: install
	$(PY) bench/demo.py

test: install
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# The bench's own extras: matplotlib (the chart), py-spy (profiles), and the other HTTP clients of the
# data-plane A/B (bench/clients.py: obstore, awscrt).
bench-install: install
	$(PY) -m pip install -q -e '.[test,bench]'

bench: bench-install
	$(PY) bench/run.py

bench-quick: install
	$(PY) bench/run.py --quick

# What the device machine (no registry there) needs for bench/device.sh run: see bench/README.md.
device-kit: install
	bash bench/device.sh kit

lint: install
	$(VENV)/bin/ruff check fsmount tests bench

clean:
	rm -rf $(VENV) build *.egg-info
