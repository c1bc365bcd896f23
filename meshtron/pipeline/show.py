"""``python -m meshtron.pipeline.show``: runs ``python -m meshtron.parallel.pipeline.show`` (see
:mod:`meshtron.parallel.pipeline.show`), kept so that the older command still works."""

import sys

from meshtron.parallel.pipeline.show import main

if __name__ == "__main__":
    sys.exit(main())
