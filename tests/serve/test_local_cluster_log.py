"""What a failed ``halfmoon serve`` start shows: the log's tail without exit noise, headed
by the traceback that says why (CI once showed only Triton's nanobind leak report)."""

from __future__ import annotations

from halfmoon.serve.launch.local import log_tail

TRACEBACK = """Traceback (most recent call last):
  File "halfmoon/serve/vllm/profile.py", line 50, in _run
    raise TimeoutError("profiling the vLLM server took too long")
TimeoutError: profiling the vLLM server took too long"""

NOISE = """nanobind: leaked 4 instances!
 - leaked instance 0x7f5c5de50d48 of type "triton._C.libtriton.ir.attribute"
nanobind: leaked 514 functions!
 - leaked function "create_barrier"
 - ... skipped remainder
nanobind: this is likely caused by a reference counting issue in the binding code.
See https://nanobind.readthedocs.io/en/latest/refleaks.html
/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 1 leaked semaphore objects to clean up at shutdown
  warnings.warn('resource_tracker: There appear to be %d '
"""


def test_exit_noise_is_dropped_and_the_reason_kept():
    log = "starting\n" + TRACEBACK + "\nhalfmoon: error: decode-0 exited with code 1\n" + NOISE * 50
    tail = log_tail(log, chars=2000)
    assert "TimeoutError: profiling the vLLM server took too long" in tail
    assert "decode-0 exited with code 1" in tail
    assert "leaked" not in tail and "resource_tracker" not in tail


def test_a_traceback_further_back_heads_the_tail():
    log = TRACEBACK + "\n" + "\n".join(f"worker INFO line {i}" for i in range(500))
    tail = log_tail(log, chars=1000)
    assert tail.startswith("Traceback (most recent call last):")
    assert tail.endswith("worker INFO line 499")
    assert tail.count("TimeoutError: profiling") == 1
    assert len(tail) < 1000 + len(TRACEBACK) + 10


def test_a_log_without_traceback_is_just_its_tail():
    log = "\n".join(f"line {i}" for i in range(100))
    assert log_tail(log, chars=50) == log[-50:]
