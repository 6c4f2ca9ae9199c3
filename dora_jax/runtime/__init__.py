"""What drives real decode slices and the trainer from the scheduling core: the run
loop (loop.py), the Grain trajectory stream (stream.py) and per-step reporting
(report.py); what the entry points share (cli.py) and the run they build
(experiment.py)."""
