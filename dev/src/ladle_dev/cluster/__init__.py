"""A real local Kubernetes (etcd, kube-apiserver, controllers, scheduler, kwok) for tests and dev.

Everything is built from pinned Go modules, because the machines have no Docker and no binary
downloads; see ``ladle_dev.cluster.build`` and ``ladle_dev.cluster.control_plane``.
"""
