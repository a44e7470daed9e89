"""Benchmark cases and probes: our saves and restores timed against plain torch.

``cases`` builds the paired workloads, ``probes`` measures one (time, peak
memory), ``async_cases`` adds the background-save pairs. The ``bench`` command
(:mod:`ckpt_lesson.cli.bench`) parses arguments and prints the table.
"""
