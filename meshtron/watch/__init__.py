"""What watches a run, apart from what runs it: the step metrics (``metrics.py``: the console line, ``metrics.jsonl``,
TensorBoard, the profiler window; ``trackers.py``: W&B and MLflow), the hang report (``watchdog.py``) and the
collectives it reads (``collective_log.py``: each rank's last collectives and the straggler clock), the one failure
report per job (``report.py``), host syncs counted on any device (``syncs.py``) and the curves of finished runs
(``plot.py``: ``python -m meshtron.watch.plot runs/X``). Nothing here changes what a step computes. See
docs/failures.md, 'Hang report' and 'No hangs', and docs/training.md, 'Training' (step 7)."""
