"""`python -m agents.agent`: the node agent's command line."""

import sys

from agents.agent.program import main

if __name__ == "__main__":
    sys.exit(main())
