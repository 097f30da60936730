"""The stderr relay of a multi-process run's non-zero processes (hybrid_lm/train/coordinator_loss.py):
every byte passes unchanged, except XLA's fatal message when the coordinator is lost, which becomes one
line. The message below is the one jaxlib 0.11.2 prints when process 0 is killed."""

import os
import subprocess
import sys

from hybrid_lm.train import coordinator_loss as C

LINE = b"error: lost process 0 of 2 (the coordinator, h:1): ...\n"
POLLED = (b"E1206 18:56:48.753921   25919 coordination_service_agent.cc:288] Polled an error from coordination "
          b"service (this can be an error from this or another task).\n")
FATAL = (b"F1206 18:56:48.753981   25919 client.h:86] Terminating process because the JAX distributed service "
         b"detected fatal errors. This most likely indicates that another task died; ... Either the leader task was "
         b"preempted/died/restarted unexpectedly or this task is experiencing network issues.\n"
         b"Additional GRPC error information from remote target coordination_service while calling "
         b"/xla.coordination.CoordinationService/PollForError:\n"
         b":UNAVAILABLE:Stream removed (recvmsg:Connection reset by peer)\n\n*** Check failure stack trace: ***\n"
         b"    @     0x7fed14f3d7d4  absl::lts_20260526::log_internal::LogMessage::SendToLog()\n"
         b"    @     0x7fed2429e1f5  (unknown)\n")


def _relay(*chunks: bytes) -> bytes:
    """Feed ``chunks`` through :func:`relay` as separate writes, return what comes out."""
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    pid = os.fork()
    if pid == 0:  # the relay, as in its own process
        os.close(w_in)
        os.close(r_out)
        C.relay(r_in, w_out, LINE)
        os._exit(0)
    os.close(r_in)
    os.close(w_out)
    for c in chunks:
        os.write(w_in, c)
    os.close(w_in)
    out = b""
    while data := os.read(r_out, 1 << 16):
        out += data
    os.waitpid(pid, 0)
    return out


def test_everything_passes_unchanged():
    text = [b"step 1/8  loss 5.1\n", b"W1206 12:00:00.1 1 x.cc:1] a warning\n", b"progress 10%\r", b"progress 20%\r",
            b"progress 100%\n", b"E1206 12:00:00.2 1 y.cc:2] another error\n", b"no newline at the end"]
    assert _relay(*text) == b"".join(text)
    assert _relay(POLLED, b"step 2\n") == POLLED + b"step 2\n"  # the announcement alone is shown
    assert _relay(POLLED) == POLLED


def test_the_fatal_message_becomes_one_line():
    assert _relay(b"step 3/8  loss 4.0\n", POLLED, FATAL) == b"step 3/8  loss 4.0\n" + LINE
    # written in pieces, a byte at a time at the start of the line
    pieces = [b"step 3\n", b"F", b"12", b"06 18:56", FATAL[9:40], FATAL[40:]]
    assert _relay(*pieces) == b"step 3\n" + LINE
    # the trainer already said what failed: nothing added
    said = b"error: process 1 of 2 failed: boom; stopping process 1 too.\n"
    assert _relay(said, POLLED, FATAL) == said


def test_a_progress_fragment_is_not_held():
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    child = subprocess.Popen([sys.executable, "-S", C.__file__, LINE.decode()], stdin=r_in, stderr=w_out)
    os.close(r_in)
    os.close(w_out)
    os.write(w_in, b"progress 10%\r")
    assert os.read(r_out, 100) == b"progress 10%\r"  # out before the line ends (else this read would block)
    os.write(w_in, FATAL)
    os.close(w_in)
    assert os.read(r_out, 1000) == LINE
    assert child.wait(10) == 0


def test_only_the_leaders_loss_is_replaced_and_only_a_recent_error_line_stands_for_it():
    other = (b"F1206 18:56:48.753981   25919 client.h:86] Terminating process because the JAX distributed service "
             b"detected fatal errors. ... DEADLINE_EXCEEDED: task 2 heartbeat timeout\n*** Check failure stack trace: ***\n")
    assert _relay(b"step 3\n", other) == b"step 3\n" + other  # another task's failure: XLA's words, all of them
    said = b"error: something earlier\n"
    later = [b"step %d\n" % i for i in range(C.RECENT + 1)]
    assert _relay(said, *later, FATAL) == said + b"".join(later) + LINE
    assert _relay(POLLED, b"progress 5%") == POLLED + b"progress 5%"  # a fragment after a held line: in order
