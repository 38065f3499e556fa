"""Session-wide hooks."""

from __future__ import annotations

import pytest

from kvstore.transport import nixl_binding

_status = {"code": 0}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _status["code"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """A test process that loaded NIXL ends with pytest's status without the C libraries'
    destructors, as ``kvstore`` does (:func:`nixl_binding.end_process` says why): on a
    host with RDMA providers they would crash it after every test has passed."""
    if nixl_binding.loaded():
        nixl_binding.end_process(_status["code"])
