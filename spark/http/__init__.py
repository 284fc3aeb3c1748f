"""Spark's OpenAI-compatible HTTP API: a quart-trio app served by hypercorn's trio worker.

    hypercorn -k trio spark.http:app     # configured from SPARK_* variables at start-up
    spark serve ...                       # the same app through ``spark.http.serve.serve``
"""

from spark.http.application import create_app

app = create_app(exit_on_startup_error=True)  # its ServeConfig is read from the environment when it starts serving

__all__ = ["app", "create_app"]
