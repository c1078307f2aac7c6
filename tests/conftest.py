pytest_plugins = ["ladle.cluster.pytest_plugin"]
