"""``python -m decent_optim.store --port P``: serve live membership's store on this host.

The command of :func:`decent_optim.gossip.store_service.main` (see there, and
docs/surviving_failures, "The store").
"""

import sys

from decent_optim.gossip.store_service import main

if __name__ == "__main__":
    sys.exit(main())
