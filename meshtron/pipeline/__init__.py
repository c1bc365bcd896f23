"""Only a command-line alias, no library code: ``python -m meshtron.pipeline.show`` is the older
spelling of ``python -m meshtron.parallel.pipeline.show`` and keeps working. Pipeline parallelism
itself is :mod:`meshtron.parallel.pipeline`."""
