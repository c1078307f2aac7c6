"""A tensor-parallel rank other than 0, as its own interpreter:

* ``python -m ladle.runtime.parallel FD``: started by rank 0 on its machine, with its end of
  their socket pair;
* ``python -m ladle.runtime.parallel --connect HOST:PORT RANK``: started on another machine
  (``ladle serve --node-rank N``), reaching rank 0 over the network.
"""

import sys
from multiprocessing.connection import Connection

from ladle.runtime.parallel.worker import connect, die_with_parent, send, serve

if sys.argv[1] == "--connect":
    die_with_parent()  # its TCP connection would outlive the node's process otherwise
    host, port = sys.argv[2].rsplit(":", 1)
    channel = connect(host, int(port))
    send(channel, int(sys.argv[3]))
    serve(channel)
else:
    serve(Connection(int(sys.argv[1])))
