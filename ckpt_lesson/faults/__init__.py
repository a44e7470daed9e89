"""Fault injection: SIGKILL a training run at chosen points and check every restore.

``harness`` kills one single-process run at a named point, ``kill_plan`` says
where and predicts which step must come back, ``campaign`` draws many such
runs; ``rank_launch``, ``rank_programs`` and ``rank_chaos`` do the same for a
multi-rank (DCP) save under torchrun. The ``chaos`` command
(:mod:`ckpt_lesson.cli.chaos`) only parses arguments and calls in here.
"""
