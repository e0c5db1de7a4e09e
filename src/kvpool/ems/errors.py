"""The EMS SDK's errors: one exception whose status code says what went wrong.

The guide's connector catches only :class:`EmsException` and reads ``status_code()``: an
``EMS_INVALID_ARGUMENT`` leaves EMS healthy, any other code marks it unhealthy for at least
20 s.  So this SDK raises only for a caller's mistake (``EMS_INVALID_ARGUMENT``) and, at
``Ems.init``, for a pool it cannot reach (``EMS_RECOVERD_ERROR``: the connector then
re-initialises once its health check passes).  A pool that is slow, down or missing blocks
gives partial results, never exceptions.
"""

from __future__ import annotations

import enum


class EmsErrorCode(enum.IntEnum):
    EMS_SUCCESS = 0
    EMS_INVALID_ARGUMENT = 1
    EMS_RECOVERD_ERROR = 2  # (sic) the service's own spelling: retry after a health check
    EMS_NOT_INITIALIZED = 3
    EMS_TIMEOUT = 4
    EMS_INTERNAL_ERROR = 5


class EmsException(Exception):
    def __init__(self, code: EmsErrorCode, message: str = ""):
        self.code = code
        super().__init__(f"{code.name}: {message}" if message else code.name)

    def status_code(self) -> EmsErrorCode:
        return self.code


def invalid(message: str) -> EmsException:
    return EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, message)
