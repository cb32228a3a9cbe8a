"""How every entry point (pretrain_*.py, tasks/main.py, tools/*.py) ends.

    if __name__ == "__main__":
        run_entry_point(main)

* ``UserError`` (bad flag, data file or checkpoint; a run stopped on NaN): one line
  ``error: <message>`` on stderr, no traceback, exit code ``err.exit_code`` (2 unless
  the error class says otherwise);
* Ctrl-C (KeyboardInterrupt): one line ``interrupted``, exit code 130 (128 + SIGINT, what
  shells report for a process killed by Ctrl-C);
* an error that only says a peer rank went away (gloo "Connection closed by peer"):
  one ``error: [rank R] a peer rank exited ...`` line, exit code 1 -- the peer prints
  the real cause; one that says a peer did not answer in time (gloo "Timed out
  waiting"): one ``error: [rank R] a peer rank did not answer within
  --distributed-timeout-minutes ...`` line, exit code 1;
* the reader of standard output went away (``tools/plan.py ... | head``): no traceback,
  nothing more is written to it, exit code 141 (128 + SIGPIPE, what ``cat`` or ``yes``
  report in the same pipe);
* anything else is a bug: the normal traceback and exit code 1.

``--debug`` on the command line (removed before ``main`` sees it, so tools whose parser
does not know it accept it too) or ``MEGATRON_DEBUG=1`` in the environment shows the
traceback of a UserError / KeyboardInterrupt as well.

Multi-rank runs: a rank that exits here leaves its peers blocked in their next
collective or p2p wait.  With gloo they see the closed connection within seconds
(the one-line "peer rank exited" above); torchrun's agent also stops the remaining
workers at once (SIGTERM) when one fails; otherwise they fail when their collective
times out (``--distributed-timeout-minutes``).  None hangs forever.

This module imports nothing heavy (no torch) so small tools stay fast to start.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Callable, List, Optional, Tuple

from megatron.errors import UserError, let_the_printing_rank_go_first, prints_for_its_node

DEBUG_FLAG = "--debug"
DEBUG_ENV = "MEGATRON_DEBUG"
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


def debug_requested(argv: Optional[List[str]] = None) -> bool:
    """True when ``--debug`` is in ``argv`` (default sys.argv) or MEGATRON_DEBUG is set."""
    argv = sys.argv[1:] if argv is None else argv
    env = os.environ.get(DEBUG_ENV, "").strip().lower()
    return DEBUG_FLAG in argv or env not in ("", "0", "false", "no")


def run_entry_point(main: Callable[..., Any], argv: Optional[List[str]] = None) -> None:
    """Run ``main(argv)`` (or ``main()`` when ``argv`` is None) and exit the process.

    The integer ``main`` returns becomes the exit code (None means 0)."""
    debug = debug_requested(argv)
    if argv is None:
        sys.argv = [a for a in sys.argv if a != DEBUG_FLAG]
    else:
        argv = [a for a in argv if a != DEBUG_FLAG]
    if debug:
        os.environ[DEBUG_ENV] = "1"  # spawned workers inherit it
    try:
        code = main() if argv is None else main(argv)
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's exit
    except BrokenPipeError:
        if not _stdout_reader_gone():  # another pipe (a worker's, a socket): a real error
            raise
        if debug:
            traceback.print_exc()
        _stdout_gone()
    except UserError as err:
        exit_with_user_error(err, debug)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        _print_error("interrupted")
        _exit(EXIT_INTERRUPTED)
    except Exception as exc:  # noqa: BLE001 - only a lost peer is shortened, the rest re-raised
        cause = _user_error_cause(exc)
        if cause is not None:  # wrapped on its way out (e.g. by a worker or a callback)
            exit_with_user_error(cause, debug)
        gone, hung = _lost_peer(exc), _lost_peer(exc, _TIMED_OUT)
        if debug or not (gone or hung):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        what = ("a peer rank exited (it probably failed: see its own error line)" if gone
                else "a peer rank did not answer within --distributed-timeout-minutes (it is "
                     "hung or far slower than this one; a hung rank prints nothing itself)")
        _print_error(f"error: [rank {os.environ.get('RANK', '?')}] {what}; here: {first}")
        _exit(1)
    code = code if isinstance(code, int) else 0
    if _process_group_alive():
        _shutdown_process_group()
        # Even with the group destroyed, a torchrun worker sometimes aborted in the
        # interpreter's teardown ('terminate called without an active exception', no
        # Python frame left; 2 of 15 SIGTERM-and-save runs, 2026-11-23): a native thread
        # still joinable when its owner is destroyed.  The run is over and its files
        # are closed (checkpoints are fsynced and renamed, the logger is closed), so
        # skip the teardown.
        _flush_and_exit(code)
    sys.exit(code)


def _stdout_reader_gone() -> bool:
    """Standard output is a pipe whose reading end is closed (poll reports an error)."""
    try:
        import select

        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _stdout_gone() -> None:
    """Standard output's reader closed the pipe: point the descriptor at /dev/null so
    the interpreter's own final flush cannot fail again (Python would print 'Exception
    ignored ... BrokenPipeError'), and exit as a process killed by SIGPIPE would."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no descriptor behind sys.stdout: nothing to redirect
        pass
    _exit(EXIT_BROKEN_PIPE)


def _process_group_alive() -> bool:
    """A torch.distributed process group exists in this process (without importing torch)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:  # noqa: BLE001 - a half-imported torch: nothing to shut down
        return False


def _shutdown_process_group() -> None:
    """Success: tear the process group down before the interpreter does.  Left to the
    interpreter's exit, gloo's threads were sometimes destroyed while joinable and the
    rank died with 'terminate called without an active exception' (SIGABRT) after a
    run that had finished and saved."""
    if _process_group_alive():
        try:
            sys.modules["torch.distributed"].destroy_process_group()
        except Exception:  # noqa: BLE001 - the run is over; exiting matters more
            pass


def _exit(code: int) -> None:
    """Exit after an error.  With a process group alive, skip the interpreter's teardown
    (``os._exit`` after flushing): a peer may still be blocked in a send or receive with
    this rank, and destroying the group would wait for it, or abort in gloo's threads.
    Checkpoints are complete files or absent (atomic renames), so nothing is lost."""
    if _process_group_alive():
        _flush_and_exit(code)
    sys.exit(code)


def _flush_and_exit(code: int) -> None:
    """``os._exit(code)`` after flushing what Python still buffers: the standard streams
    and the ``logging`` handlers."""
    import logging

    try:
        logging.shutdown()
    except Exception:  # noqa: BLE001 - exiting matters more
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def exit_with_user_error(err: BaseException, debug: Optional[bool] = None) -> None:
    """Report ``err`` as this module reports a UserError and exit: one ``error:`` line
    (the traceback first with --debug / MEGATRON_DEBUG=1), exit code ``err.exit_code``
    (2 by default).  For tools whose ``main()`` must exit by itself when called from
    Python."""
    if debug if debug is not None else debug_requested([]):
        traceback.print_exc()
    if not getattr(err, "every_rank_alike", False) or prints_for_its_node():
        _print_error(f"error: {_one_line(err)}")
    else:
        let_the_printing_rank_go_first()
    _exit(getattr(err, "exit_code", EXIT_USER_ERROR))


def _user_error_cause(exc: BaseException) -> Optional[UserError]:
    """A UserError this exception was raised from (``raise ... from err``), if any."""
    seen = 0
    exc = exc.__cause__
    while exc is not None and seen < 20:
        if isinstance(exc, UserError):
            return exc
        exc, seen = exc.__cause__, seen + 1
    return None


_LOST_PEER = ("Connection closed by peer", "Connection reset by peer")
# gloo's words when a receive or collective outlives the process group's timeout
_TIMED_OUT = ("Timed out waiting",)


def _lost_peer(exc: BaseException, words: Tuple[str, ...] = _LOST_PEER) -> bool:
    """The error only says that another rank went away (its own message says why), or,
    with ``words=_TIMED_OUT``, that one did not answer in time."""
    while exc is not None:
        if any(s in str(exc) for s in words):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text


def _print_error(line: str) -> None:
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a closed stdout must not hide the error line
        pass
    # one write of the whole line: ranks sharing torchrun's stderr do not interleave
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
