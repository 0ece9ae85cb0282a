"""Replica backends: the protocol (``base``) and the process, static and fake backends."""

from .base import Backend, Exit, ExitHandler, Launch, Running
from .fake import FakeBackend
from .process import ProcessBackend
from .static import StaticBackend

__all__ = [
    "Backend",
    "Exit",
    "ExitHandler",
    "FakeBackend",
    "Launch",
    "ProcessBackend",
    "Running",
    "StaticBackend",
]
