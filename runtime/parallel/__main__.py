"""``python -m ladle.runtime.parallel FD``: a tensor-parallel rank other than 0, started by
rank 0 with its end of their socket pair."""

import sys
from multiprocessing.connection import Connection

from ladle.runtime.parallel.worker import serve

serve(Connection(int(sys.argv[1])))
