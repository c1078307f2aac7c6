"""The local node agent: real pods on one machine, with processes for containers.

It registers Nodes that kwok does not manage and does for each pod bound to them what a kubelet
does: images (``images``), an address per pod (``allocators``, ``podnet.c``), volumes
(``volumes``), a sandboxed process per container (``sandbox``, ``containers``), probes,
restarts and termination (``pods``, ``probes``), status and Events (``status``, ``events``),
Leases (``node``) and ``kubectl logs`` (``server``). ``docs/node-agent.md`` describes what it
honours and what it does not.

Nothing heavy is imported here: the sandbox runs as ``python -m ladle.cluster.agent.sandbox``
once per container start.
"""
