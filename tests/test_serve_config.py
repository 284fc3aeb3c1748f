"""ServeConfig from SPARK_* variables: values, defaults, and one clear line per bad variable."""

import pytest

from spark.serve_config import ServeConfig


def test_scheduler_depth_from_the_environment():
    assert ServeConfig.from_env({}).scheduler_depth is None  # the scheduler's default
    assert ServeConfig.from_env({"SPARK_SCHEDULER_DEPTH": "4"}).scheduler_depth == 4
    assert ServeConfig.from_env({"SPARK_SCHEDULER_DEPTH": "4"}, scheduler_depth=2).scheduler_depth == 2


@pytest.mark.parametrize("value", ["0", "two"])
def test_a_bad_scheduler_depth_names_the_variable(value):
    with pytest.raises(ValueError, match="scheduler_depth"):
        ServeConfig.from_env({"SPARK_SCHEDULER_DEPTH": value})

