"""spark.gc_tuning: the collector of a serving process."""

import subprocess
import sys


def test_gc_settle_freezes_start_up_and_slows_young_collections():
    """In a process of its own: settle() changes the interpreter's collector for good."""
    code = ("import gc; from spark import gc_tuning; gc_tuning.settle(); "
            "assert gc.get_freeze_count() > 0, gc.get_freeze_count(); assert gc.get_threshold()[0] == 50000")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
