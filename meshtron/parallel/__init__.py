"""One module per parallelism, each touching only its mesh dimension: ``tensor.py`` (the tp and SP plan; its
styles in ``tp_styles.py`` and ``sp_projections.py``, with ``tensor_overlap.py``, ``tp_gradient.py`` and
``vocab_loss.py``), ``expert.py``, ``context/``, ``data_parallel.py`` (FSDP / HSDP / replicate), ``pipeline/``.
Beside them what is no mesh dimension: ``recompute.py`` (activation checkpointing), ``offload.py`` (saved
activations on the host), ``float8.py``, ``compile.py``, ``grad_norm.py``. ``layout.py`` validates a layout,
``compose.py`` applies the parallelisms in order, ``step.py`` declares the runner interface and the training
step, ``runner.py`` runs a step without a pipeline and picks a model's runner for its layout. See
docs/training.md, 'How the parallelisms compose'."""
