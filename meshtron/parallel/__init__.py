"""One module per parallelism (tensor, expert, context, data, pipeline); runner.py composes them."""
