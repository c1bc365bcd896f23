"""Command-line entry points for pipeline parallelism (the library is ``meshtron.parallel.pipeline``)."""
