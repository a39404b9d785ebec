"""The exceptions of dsv4: one class per status of the C API (include/dsv4/dsv4.h).

Every class derives from :class:`Error` and from the built-in exception a Python user would
catch for that kind of problem (``ValueError`` for a bad shape, ``TypeError`` for a bad dtype,
``OSError`` for a file that cannot be read). :class:`PoolExhaustedError` is the one a serving loop
acts on: nothing changed, release sequences and try again.
"""


class Error(RuntimeError):
    """Base class of every dsv4 error. ``status`` is the C API's status code."""

    status = 10


class InvalidArgumentError(Error, ValueError):
    status = 1


class BadHandleError(Error, ValueError):
    status = 2


class ShapeError(Error, ValueError):
    status = 3


class DTypeError(Error, TypeError):
    status = 4


class DeviceError(Error, ValueError):
    status = 5


class LayoutError(Error, ValueError):
    status = 6


class PoolExhaustedError(Error):
    """A cache pool has too few free pages, or max_sequences sequences are live; nothing changed."""

    status = 7


class LoadError(Error, OSError):
    status = 8


class UnsupportedError(Error, NotImplementedError):
    status = 9


class InternalError(Error):
    status = 10


_BY_STATUS = {c.status: c for c in (InvalidArgumentError, BadHandleError, ShapeError, DTypeError, DeviceError,
                                    LayoutError, PoolExhaustedError, LoadError, UnsupportedError, InternalError)}


def error_class(status):
    """The exception class of a C API status (used by the extension module)."""
    return _BY_STATUS.get(status, InternalError)
