"""``python -m meshtron.pipeline.show``: see :mod:`meshtron.parallel.pipeline.show`."""

from meshtron.parallel.pipeline.show import main

if __name__ == "__main__":
    main()
