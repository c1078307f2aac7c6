import sys

from ladle.cluster.agent.agent import main

sys.exit(main(sys.argv))
