"""How a failure is logged: an expected condition in one line, a bug with its traceback."""
import logging
import sqlite3

from yue2_vllm.serve.errors import Unavailable, log_failure

LOG = logging.getLogger("yue2_vllm.serve.test")


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 (handed back with its traceback)
        return caught


def test_an_expected_condition_is_one_line_and_a_bug_keeps_its_traceback(caplog):
    caplog.set_level(logging.ERROR, LOG.name)
    for exc in (Unavailable("the job store cannot be written (disk full)"), OSError(28, "No space left on device"),
                sqlite3.OperationalError("database or disk is full")):
        log_failure(LOG, "watchdog: _sweep", raised(exc))
    assert [r.exc_info for r in caplog.records] == [None, None, None]
    assert caplog.messages == ["watchdog: _sweep failed: Unavailable: the job store cannot be written (disk full)",
                               "watchdog: _sweep failed: OSError: [Errno 28] No space left on device",
                               "watchdog: _sweep failed: OperationalError: database or disk is full"]
    caplog.clear()
    log_failure(LOG, "job owner: handling event", raised(KeyError("phase")))
    (record,) = caplog.records
    assert record.getMessage() == "job owner: handling event failed" and record.exc_info[0] is KeyError
    assert "Traceback (most recent call last)" in caplog.text and "KeyError: 'phase'" in caplog.text
