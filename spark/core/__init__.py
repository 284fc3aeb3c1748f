"""Spark's pure core: plans, pages, scheduling policies and the step loop. No torch, no trio.

The engine (``spark.engine``) computes what a ``StepPlan`` asks; the actor host
(``spark.actors.host``) and offline generation (``spark.engine.offline``) drive
``Core.step``; everything here is plain Python, testable on a fake clock.
"""
