"""``MPI``: mpi4py.MPI, imported on first use.

Importing mpi4py.MPI initialises MPI, so the modules that ``import pympar.comm`` loads (the
Communicator base, SelfComm, requests, datatypes) take ``MPI`` from here: a program that only
uses SelfComm, or that makes its own communicator later, never starts MPI by importing pympar.
"""
from __future__ import annotations


class _LazyMPI:
    __slots__ = ()
    _module = None

    def __getattr__(self, name):
        m = _LazyMPI._module
        if m is None:
            from mpi4py import MPI as m   # MPI_Init here, at the first MPI attribute asked for
            _LazyMPI._module = m
        return getattr(m, name)


MPI = _LazyMPI()
