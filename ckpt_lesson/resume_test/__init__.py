"""resume-test: proves that a user's own training command resumes bit for bit.

The tool runs the command once uninterrupted (the baseline), then again with
kills at planned moments, restarts it, and compares the step records. Each
module here does one part: ``plan`` chooses the kills, ``runner`` and ``procs``
run and stop the process tree, ``watch`` sees saves land, ``steps`` reads the
step log, ``compare``/``diagnose``/``evidence`` explain a difference,
``repeat`` checks that the command repeats itself before a difference is blamed on
the save, ``machine``/``image``/``outside`` simulate losing the machine,
``provenance`` ties the result to code, environment and saves, and
``verdict`` and ``report`` give the answer. The command itself
(``python -m ckpt_lesson resume-test``) lives in :mod:`ckpt_lesson.cli.resume_test`.
"""
