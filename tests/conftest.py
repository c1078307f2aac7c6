import sys
from pathlib import Path

# Shared test helpers (kube_harness) live beside this file; appended, so that nothing here
# can shadow a standard-library module.
sys.path.append(str(Path(__file__).resolve().parent))

pytest_plugins = ["ladle.cluster.pytest_plugin"]
