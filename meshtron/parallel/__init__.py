"""One module per parallelism (tensor, expert, context, data, pipeline); compose.py composes them, runner.py picks the runner."""
